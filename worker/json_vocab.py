"""JsonVocab: which vocabulary tokens may follow a JSON-mode state (json_constraint.py), as boolean masks.

A token may follow when its bytes (token_bytes.py) continue the JSON object's prefix. Special tokens and
tokens of no bytes never do (their text is not JSON, and an empty token would not advance the object);
the stop tokens (EOS, stop_token_ids) are the sampler's business, not this table's.

Scanning ~49k tokens in Python at every step would cost tens of milliseconds, so:
* a regex's states (guided_regex, a schema's pattern) walk a trie of the whole-text tokens by the regex's
  character classes (regex_vocab.py) and scan only the rest;
* masks are cached per (grammar, state, may_complete) in a bounded LRU, on the device: a request's states recur (inside a string,
  after a value, ...) and requests share them;
* tokens are bucketed by first byte, and only the buckets whose first byte is valid are scanned;
* inside a string, the tokens of plain content (whole UTF-8 characters, no '"', '\\' or control byte) are
  valid as one precomputed mask (those short enough, where a schema's maxLength applies), and only the other
  tokens are scanned; inside a character split across
  tokens, only the buckets led by one of its continuation bytes are.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections import OrderedDict

import torch

from lorafleet.worker.json_constraint import JSON_OBJECT, advance
from lorafleet.worker.regex_dfa import RegexError
from lorafleet.worker.regex_length import LengthRegex
from lorafleet.worker.regex_vocab import ClassTrie
from lorafleet.worker.token_bytes import token_bytes
from lorafleet.worker.tokenizer import Tokenizer

_WS = b" \t\n\r"
_NO_LOCK = contextlib.nullcontext()  # _cached for a cache one thread uses
MAX_CACHED_MASKS = 512  # 512 masks of 49k booleans: 25 MB
MAX_PREPARED_TRIES = 2  # of one request (JsonVocab.prepare)
MAX_CACHED_TRIES = 8  # regex class tries (regex_vocab.py): ~25k nodes each on a 49k vocabulary
# One mask's scan of the tokens through the grammar, on the engine's step that every request waits for: past it
# the request fails. A union of patterned strings (one reading per branch) is scanned token by token: legitimate
# ones take up to about 1 s on a 49k vocabulary; 64 branches of open-ended patterns took a minute a mask.
MAX_SCAN_SECONDS = 3.0
SCAN_CHECK_EVERY = 64  # tokens between looks at the clock
MAX_CACHED_ENDS = 32  # trie walks of patterns beside lengths (_length_ends), up to a node's worth of groups each


class JsonVocab:
    def __init__(self, token_bytes: list[bytes | None], *, device: torch.device | str = "cpu") -> None:
        """`token_bytes[i]`: token i's bytes, None for a token that is never JSON text (special tokens)."""
        self.vocab_size = len(token_bytes)
        self.device = torch.device(device)
        self._bytes = [b or b"" for b in token_bytes]
        # Buckets: [first byte] -> {second byte (-1: none) -> token ids}, so that a scan skips whole groups.
        self._buckets = _new_buckets()  # tokens not led by whitespace
        self._special_buckets = _new_buckets()  # every token that is not plain string content
        self._escaped_buckets = _new_buckets()  # plain string content with an escape (not in regex class tries)
        # Tokens led by whitespace (half of a GPT-2 style vocabulary: " the"), by the bytes after it: where
        # whitespace leaves the state as it is, such a token is valid when the rest of it is.
        self._ws_buckets = _new_buckets()
        # The same tokens and those of whitespace only, by their own bytes: scanned where whitespace bytes lead
        # to different states (inside a key or an enum value of a schema).
        self._ws_whole_buckets = _new_buckets()
        self._rest: dict[int, bytes] = {}
        plain = torch.zeros(self.vocab_size, dtype=torch.bool)
        chars = torch.zeros(self.vocab_size, dtype=torch.int32)  # a plain token's characters (string lengths)
        all_ws = torch.zeros(self.vocab_size, dtype=torch.bool)
        for token_id, data in enumerate(token_bytes):
            if not data:
                continue
            rest = data.lstrip(_WS)
            if len(rest) < len(data):
                _add(self._ws_whole_buckets, data, token_id)
            if not rest:
                all_ws[token_id] = True
            elif len(rest) < len(data):
                _add(self._ws_buckets, rest, token_id)
                self._rest[token_id] = rest
            else:
                _add(self._buckets, data, token_id)
            if advance(("str", "{"), data) == ("str", "{"):
                plain[token_id] = True
                chars[token_id] = len(json.loads(b'"' + data + b'"'))  # an escape is one character
                if 0x5C in data:  # its text is not its bytes: a pattern reads the characters its escapes write
                    _add(self._escaped_buckets, data, token_id)
            else:
                _add(self._special_buckets, data, token_id)
        self._plain, self._plain_chars, self._all_ws = plain, chars, all_ws
        self._not_ws = (~all_ws).to(self.device)  # what may not follow a complete object in a JSON text
        self.num_whitespace = int(all_ws.sum())
        self._none = torch.zeros(self.vocab_size, dtype=torch.bool)
        self._masks: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()
        self._masks_lock = threading.Lock()
        self._tries: OrderedDict[tuple[str, bool], ClassTrie] = OrderedDict()  # regex_vocab.py, per (regex, in JSON)
        self._tries_lock = threading.Lock()
        self._ends: OrderedDict[tuple, list] = OrderedDict()  # a pattern's trie walks from a state (_length_ends)
        self._ends_lock = threading.Lock()  # prepare() builds a first mask in a request's thread, beside the steps
        self.num_built = 0  # masks scanned (cache misses), for tests and benchmarks

    @functools.cached_property
    def spellings(self) -> tuple[set[bytes], int]:
        """(every token's bytes, the longest): what a grammar checks it can be written with (choice_grammar.py)."""
        spelled = {b for b in self._bytes if b}
        return spelled, max(map(len, spelled), default=0)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's bytes; empty for special tokens and ids past the tokenizer's vocabulary."""
        return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""

    def is_whitespace(self, token_id: int) -> bool:
        """Whether the token is JSON whitespace only (RFC 8259's `ws`, which may follow the object)."""
        return 0 <= token_id < self.vocab_size and bool(self._all_ws[token_id])

    def not_whitespace(self) -> torch.Tensor:
        """bool [V] on the device, True where a token is not JSON whitespace only. Do not modify it."""
        return self._not_ws

    def accepts(self, state, token_id: int, may_complete: bool = True, grammar=JSON_OBJECT) -> bool:
        """Whether token `token_id` may follow `state`; with may_complete False, not a token that completes it."""
        data = self.token_bytes(token_id)
        if not data:
            return False
        nxt = grammar.advance(state, data)
        return nxt is not None and (may_complete or not grammar.is_complete(nxt))

    def has_mask(self, state, may_complete: bool = True, grammar=JSON_OBJECT) -> bool:
        """Whether `mask` has that mask cached (it costs no build)."""
        return (grammar.key, state, may_complete) in self._masks

    def mask(self, state, may_complete: bool = True, grammar=JSON_OBJECT) -> tuple[torch.Tensor, int]:
        """(bool [V] on the device, True where a token may NOT follow `state`; how many may). Cached: do not
        modify it. `grammar`: JSON mode's (json_constraint.JSON_OBJECT) or a schema's (json_schema_grammar.py).
        Thread-safe: a request's thread builds its grammar's first mask (`prepare`) beside the engine's steps."""
        def build() -> tuple[torch.Tensor, int]:
            valid = self._build(grammar, state, may_complete)
            return (~valid).to(self.device), int(valid.sum())

        return _cached(self._masks, (grammar.key, state, may_complete), build, MAX_CACHED_MASKS, self._masks_lock)

    def _build(self, grammar, state, may_complete: bool) -> torch.Tensor:
        self.num_built += 1
        deadline = time.thread_time() + MAX_SCAN_SECONDS
        ids: list[int] = []
        reading = grammar.regex_reading(state)
        if reading is not None:  # a regex between characters: whole-text tokens through its class trie
            regex, dstate, in_json = reading
            mask = self._none.clone()
            if isinstance(regex, LengthRegex):  # a pattern beside a length: the pattern's walk, the count per token
                valid = [ids for state, chars, ids in self._length_ends(regex, dstate[0], in_json)
                         if regex.fits(state, dstate[1], chars)]
            else:  # in a JSON string, whole text never completes the value
                valid = self._trie(regex, in_json).valid(regex, dstate, may_complete or in_json)
            if valid:
                mask[torch.cat(valid)] = True
            for first in grammar.rescanned_bytes(state):  # read by the grammar, not the trie
                for buckets in (self._buckets, self._ws_whole_buckets):
                    for group in buckets[first].values():
                        mask[torch.tensor(group, dtype=torch.int64)] = False
                        ids.extend(t for t in group if self.accepts(state, t, may_complete, grammar))
            if in_json:
                self._scan(grammar, state, self._special_buckets, self._bytes, may_complete, ids, deadline)
                self._scan(grammar, state, self._escaped_buckets, self._bytes, may_complete, ids, deadline)
            else:
                self._scan(grammar, state, self._partial[1], self._bytes, may_complete, ids, deadline)
        elif grammar.is_in_string(state):
            room = grammar.string_room(state)  # a schema's maxLength: plain tokens of at most `room` characters
            mask = self._plain.clone() if room is None else self._plain & (self._plain_chars <= room)
            self._scan(grammar, state, self._special_buckets, self._bytes, may_complete, ids, deadline)
        elif not grammar.ws_uniform(state):  # each token whole: " " may continue a key where "\t" may not
            mask = self._none.clone()
            self._scan(grammar, state, self._buckets, self._bytes, may_complete, ids, deadline)
            self._scan(grammar, state, self._ws_whole_buckets, self._bytes, may_complete, ids, deadline)
        else:
            mask = self._none.clone()
            self._scan(grammar, state, self._buckets, self._bytes, may_complete, ids, deadline)
            after_ws = grammar.advance(state, b" ")  # every whitespace byte leads to the same state here
            if after_ws is not None:
                mask |= self._all_ws
                self._scan(grammar, after_ws, self._ws_buckets, self._rest, may_complete, ids, deadline)
        if ids:
            mask[torch.tensor(ids, dtype=torch.int64)] = True
        return mask  # bool [V] on the CPU, True where a token may follow

    def _trie(self, regex, in_json: bool) -> ClassTrie:
        """The class trie of the tokens that are whole text: plain string content inside JSON, else complete UTF-8."""
        def build() -> ClassTrie:
            tokens = [(i, self._bytes[i].decode()) for i in self._plain.nonzero().flatten().tolist()
                      if 0x5C not in self._bytes[i]] if in_json else self._partial[0]
            return ClassTrie(regex, tokens)

        # prepare() builds in a request's thread beside the engine's steps: the cache is shared under a lock
        return _cached(self._tries, (regex.key, in_json), build, MAX_CACHED_TRIES, self._tries_lock)

    def prepare(self, grammar, may_complete: bool = True) -> None:
        """Build, in the calling thread, the class tries a grammar's patterns read through (0.1-0.2 s each on a
        49k vocabulary), and the mask of its first state (its request's first draw: `may_complete` as that draw
        takes it): before its request joins the batch, so that the engine's step, which every row waits for,
        does not. The pattern the output begins in (guided_regex), or a schema's first patterns: a few, as each
        may push out of the cache a trie that a running row reads."""
        readings = [grammar.regex_reading(grammar.start)]
        readings += [(node.pattern, None, True) for node in getattr(grammar, "nodes", ()) if node.pattern is not None]
        for regex, _, in_json in [r for r in readings if r is not None][:MAX_PREPARED_TRIES]:
            if not isinstance(regex, LengthRegex):
                self._trie(regex, in_json)
        self.mask(grammar.start, may_complete, grammar)

    def _length_ends(self, regex: LengthRegex, dstate: frozenset, in_json: bool) -> list:
        """ClassTrie.ends of the pattern itself from `dstate`, cached: every count at that state filters the same
        walk (the count only decides at a token's end: a state that can still end inside the length is reached
        only through ones that can)."""
        return _cached(self._ends, (regex.regex.key, dstate, in_json),
                       lambda: self._trie(regex.regex, in_json).ends(regex.regex, dstate), MAX_CACHED_ENDS, self._ends_lock)

    @functools.cached_property
    def _partial(self) -> tuple[list[tuple[int, str]], list[dict[int, list[int]]]]:
        """(the tokens that are complete UTF-8, with their text; buckets of the others: a partial character)."""
        whole, buckets = [], _new_buckets()
        for token_id, data in enumerate(self._bytes):
            if not data:
                continue
            try:
                whole.append((token_id, data.decode()))
            except UnicodeDecodeError:
                _add(buckets, data, token_id)
        return whole, buckets

    @staticmethod
    def _scan(grammar, state, buckets: list[dict[int, list[int]]], data_of, may_complete: bool, ids: list[int],
              deadline: float) -> None:
        """Append to `ids` the tokens of `buckets` whose bytes `data_of[id]` may follow `state`. RegexError past
        `deadline` (the mask's build's, MAX_SCAN_SECONDS): its request fails, the others' step goes on."""
        scanned = 0
        for first, groups in enumerate(buckets):
            if not groups:
                continue
            after_first = grammar.advance(state, bytes((first,)))
            if after_first is None:
                continue
            for second, group in groups.items():
                if second >= 0 and grammar.advance(after_first, bytes((second,))) is None:
                    continue
                for token_id in group:
                    scanned += 1
                    if scanned % SCAN_CHECK_EVERY == 0 and time.thread_time() > deadline:
                        raise RegexError(f"holding the output to this schema costs over {MAX_SCAN_SECONDS:g} s of a "
                                         f"step (a union of patterned strings, each read at every token?): simplify "
                                         f"it, or give the union's branches distinct first characters")
                    nxt = grammar.advance(state, data_of[token_id])
                    if nxt is not None and (may_complete or not grammar.is_complete(nxt)):
                        ids.append(token_id)


def _cached(cache: OrderedDict, key, build, limit: int, lock: threading.Lock | contextlib.nullcontext = _NO_LOCK):
    """cache[key], built by build() on a miss; the least recently used entry goes past `limit`. `lock`: for a
    cache several threads use, held for its lookups but not the build (no thread waits for another's)."""
    with lock:
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
            return value
    value = build()
    with lock:
        value = cache.setdefault(key, value)
        cache.move_to_end(key)
        if len(cache) > limit:
            cache.popitem(last=False)
    return value


def _new_buckets() -> list[dict[int, list[int]]]:
    return [{} for _ in range(256)]


def _add(buckets: list[dict[int, list[int]]], data: bytes, token_id: int) -> None:
    buckets[data[0]].setdefault(data[1] if len(data) > 1 else -1, []).append(token_id)


def json_vocab(tokenizer: Tokenizer, vocab_size: int, device: torch.device | str = "cpu") -> JsonVocab:
    """The JsonVocab of a model's `vocab_size` logits (ids past the tokenizer's vocabulary never JSON)."""
    spell = token_bytes(tokenizer)
    num_known = min(vocab_size, tokenizer.vocab_size)
    return JsonVocab([None if i in spell.special_ids else spell(i) for i in range(num_known)]
                     + [None] * (vocab_size - num_known), device=device)
