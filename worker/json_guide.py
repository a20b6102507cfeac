"""JsonGuide: JSON mode (`response_format: {"type": "json_object"}`) and structured output (`"json_schema"`)
for the sampler's constrained rows.

A constrained sequence's output is a prefix of one JSON object (JSON mode, json_constraint.py), or of one
value its schema takes (json_schema_grammar.py): the row's grammar. Its stop tokens (EOS and its
stop_token_ids) may be drawn only once the object is complete, and then nothing else may (ignore_eos: see
below); while it has fewer than min_tokens - 1 tokens, no token may complete the object (it could not end
there). Each sequence's validator state is kept on it with the number of output tokens it covers and
advanced by the tokens gained since, so a recomputed (preempted) sequence, which keeps its output tokens,
finds it as it left it.

With ignore_eos, EOS ends nothing, so after the object only its stop_token_ids and tokens of JSON
whitespace may follow: the request still runs to max_tokens as ignore_eos asks (fixed-length outputs, as
for rows without JSON mode) and its output stays one JSON text (RFC 8259: `ws object ws`) that any JSON
parser takes, instead of an object followed by EOS ids until max_tokens.

The vocabulary table (json_vocab.py) scans the whole vocabulary, up to a second on real tokenizers, so it
is built once in a worker thread (`prepare`), never in a step of the engine's thread, where it would stall
every other request's decoding: the AsyncEngine has a JSON-mode request wait for it before the engine sees
the request. Offline use (Engine.generate) builds it at its first JSON-mode step.

The sampler draws as usual and keeps the token when the row accepts it; otherwise it draws again among
the row's mask (sampler.py), which is exactly the distribution restricted to the valid tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch

from lorafleet.worker.json_constraint import JSON_OBJECT
from lorafleet.worker.json_schema_grammar import GrammarError
from lorafleet.worker.json_vocab import JsonVocab, json_vocab
from lorafleet.worker.sequence import Sequence
from lorafleet.worker.tokenizer import Tokenizer

MAX_WS_RUN = 8  # whitespace-only tokens in a row between JSON's tokens (_ws_run_spent)


class JsonModeError(RuntimeError):
    """A JSON-mode sequence cannot go on (its request fails; the others are not affected)."""


class StopTokensInTheWay(GrammarError):
    """The request's stop_token_ids are the only tokens that continue its grammar: its fault (a 400)."""

    param = "stop_token_ids"


class JsonGuide:
    def __init__(self, build_vocab: Callable[[], JsonVocab], eos_token_ids: Iterable[int] = ()) -> None:
        self._build_vocab = build_vocab  # a scan of the whole vocabulary: run by prepare(), in a worker thread
        self._vocab: JsonVocab | None = None
        self._building: Future | None = None  # the build in flight, shared by every request that waits for it
        self._lock = threading.Lock()  # guards _vocab and _building
        self.eos_token_ids = frozenset(eos_token_ids)

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int],
           device: torch.device | str) -> JsonGuide | None:
        """The guide of a model's `vocab_size` logits; None without a tokenizer (no token bytes)."""
        if tokenizer is None:
            return None
        return cls(lambda: json_vocab(tokenizer, vocab_size, device), eos_token_ids)

    @property
    def is_ready(self) -> bool:
        """Whether the vocabulary table is built: JSON-mode rows then cost no scan of the whole vocabulary."""
        return self._vocab is not None

    def prepare(self) -> Future:
        """Future of the vocabulary table, built once in a worker thread; concurrent callers share the build.
        A failed build sets a JsonModeError that says so, and the next call tries again. Cancelling the
        future does nothing (a caller that leaves must not cancel the others' build)."""
        with self._lock:
            if self._building is not None:
                return self._building
            done: Future = Future()
            done.set_running_or_notify_cancel()
            if self._vocab is not None:
                done.set_result(self._vocab)
                return done
            self._building = done
        threading.Thread(target=self._build, args=(done,), name="json-vocab", daemon=True).start()
        return done

    def _build(self, done: Future) -> None:
        try:
            vocab = self._build_vocab()
        except Exception as exc:
            error = JsonModeError(f"JSON mode is unavailable: building its table of the model's vocabulary "
                                  f"failed ({exc!r}); retry, or send the request without response_format")
            error.__cause__ = exc
            with self._lock:
                self._building = None
            done.set_exception(error)
            return
        with self._lock:
            self._vocab, self._building = vocab, None
        done.set_result(vocab)

    @property
    def vocab(self) -> JsonVocab:
        """The vocabulary table; built here, waiting for it, when no request prepared it (offline use)."""
        vocab = self._vocab
        return vocab if vocab is not None else self.prepare().result()

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        return self.eos_token_ids | seq.adapter_eos | frozenset(seq.params.stop_token_ids)

    def end_ids(self, seq: Sequence) -> frozenset[int]:
        """The stop tokens that end the request: its stop_token_ids, and EOS (its adapter's own too) unless it
        ignores EOS."""
        ends = frozenset(seq.params.stop_token_ids)
        return ends if seq.params.ignore_eos else ends | self.eos_token_ids | seq.adapter_eos

    @staticmethod
    def grammar(seq: Sequence):
        """The sequence's grammar: its schema's (structured output), else JSON mode's (any JSON object)."""
        return seq.params.grammar or JSON_OBJECT

    def state(self, seq: Sequence):
        """The validator's state after the sequence's output tokens."""
        output = seq.output_token_ids
        grammar = self.grammar(seq)
        num_done, state = seq.json_state or (0, grammar.start)
        if num_done > len(output):  # never expected (outputs only grow): start over
            num_done, state = 0, grammar.start
        stops = self.stop_ids(seq)
        vocab = self.vocab
        for token_id in output[num_done:]:
            if grammar.is_complete(state) and (token_id in stops or vocab.is_whitespace(token_id)) \
                    or token_id in stops and grammar.may_stop(state):
                continue  # trailing whitespace, or a stop token that did not end the request (ignore_eos)
            data = vocab.token_bytes(token_id) if token_id not in stops else b""
            nxt = grammar.advance(state, data) if data else None
            if nxt is None:
                raise JsonModeError(f"JSON mode: output token {token_id} does not continue the JSON value")
            state = nxt
        seq.json_state = (len(output), state)
        return state

    @staticmethod
    def may_complete(seq: Sequence) -> bool:
        """Whether the next token may complete the object: a stop token could follow within min_tokens."""
        return len(seq.output_token_ids) + 1 >= seq.params.min_tokens

    def accepts(self, seq: Sequence, token_id: int) -> bool:
        state = self.state(seq)
        grammar = self.grammar(seq)
        if grammar.is_complete(state):
            return token_id in self.end_ids(seq) or (self._pads(seq) and self.vocab.is_whitespace(token_id))
        if token_id in self.stop_ids(seq):
            return token_id in self.end_ids(seq) and grammar.may_stop(state)
        if self._ws_run_spent(seq, grammar, state) and self.vocab.is_whitespace(token_id):
            return False
        return self.vocab.accepts(state, token_id, self.may_complete(seq), grammar)

    def needs_mask(self, seq: Sequence) -> bool:
        """Whether the row's next draw, if its grammar refuses the token drawn, builds a mask (its state's is not
        cached): what grammar_pacing charges a row with. False where nothing is known yet (no vocabulary table)
        or the state cannot be read (the draw fails the row)."""
        vocab = self._vocab
        if vocab is None:
            return False
        try:
            state = self.state(seq)
        except Exception:
            return False
        grammar = self.grammar(seq)
        return not grammar.is_complete(state) and not vocab.has_mask(state, self.may_complete(seq), grammar)

    def invalid(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        """bool [V] on `device`, True where the sequence may NOT draw its next token (JsonModeError when it may
        draw none). The vocabulary's cached mask itself unless a stop token id is also a text token."""
        state = self.state(seq)
        vocab = self.vocab
        grammar = self.grammar(seq)
        if grammar.is_complete(state):
            return self._after_object(seq, vocab, device)
        text_stops = [t for t in _ids(self.stop_ids(seq), vocab) if vocab.token_bytes(t)]  # never content
        may_complete = self.may_complete(seq)
        invalid = self._without(vocab.mask(state, may_complete, grammar), text_stops)
        if invalid is None and not may_complete:  # a value of fixed length (an enum, true) can only end:
            invalid = self._without(vocab.mask(state, True, grammar), text_stops)  # it ends; whitespace pads min_tokens
        if grammar.may_stop(state) and (ends := _ids(self.end_ids(seq), vocab)):  # a text that may end or go on
            invalid = torch.ones(vocab.vocab_size, dtype=torch.bool) if invalid is None else invalid.clone()
            invalid[torch.tensor(ends, dtype=torch.int64, device=invalid.device)] = False
        if invalid is None and text_stops and vocab.mask(state, True, grammar)[1] > 0:
            # The request's own stop tokens are all that may write on: a stop token ends the output unwritten.
            raise StopTokensInTheWay(f"stop_token_ids {sorted(text_stops)[:8]} are the only tokens that continue the "
                               f"structured output after {len(seq.output_token_ids)} tokens; a stop token ends the output "
                               "without writing its text, so the output could not be completed: leave them out")
        if invalid is None:
            raise JsonModeError("JSON mode: no token of the vocabulary continues the JSON value")
        if self._ws_run_spent(seq, grammar, state):
            spent = invalid | ~vocab.not_whitespace().to(invalid.device)
            invalid = spent if not bool(spent.all()) else invalid
        return invalid.to(device)

    def _ws_run_spent(self, seq: Sequence, grammar, state) -> bool:
        """Whether the output ends in MAX_WS_RUN tokens of whitespace only between JSON's tokens (not in a string,
        key or pattern, where whitespace is text): then the next one may not be whitespace only. Small models
        otherwise loop on newlines and indentation until max_tokens."""
        out = seq.output_token_ids
        if len(out) < MAX_WS_RUN or not grammar.pads or not grammar.ws_uniform(state) or grammar.is_in_string(state) \
                or grammar.is_complete(state):
            return False
        vocab = self.vocab
        return all(vocab.is_whitespace(t) for t in out[-MAX_WS_RUN:])

    @staticmethod
    def _without(mask: tuple[torch.Tensor, int], text_stops: list[int]) -> torch.Tensor | None:
        """A cached mask (invalid, how many valid) with the stop ids that are text tokens made invalid too (a
        copy then); None when no token is left."""
        invalid, num_valid = mask
        if text_stops:
            invalid = invalid.clone()
            invalid[torch.tensor(text_stops, device=invalid.device)] = True
        if num_valid <= len(text_stops) and not bool((~invalid).any()):
            return None
        return invalid

    @staticmethod
    def _pads(seq: Sequence) -> bool:
        """Whether JSON whitespace may follow the complete value: with ignore_eos (the module's docstring says why),
        and while the request is short of min_tokens, whose stop tokens cannot be drawn yet (a value of fixed
        length, an enum or a literal, may complete before it: nothing else could follow it)."""
        return JsonGuide.grammar(seq).pads and (seq.params.ignore_eos or len(seq.output_token_ids) < seq.params.min_tokens)

    def _after_object(self, seq: Sequence, vocab: JsonVocab, device: torch.device) -> torch.Tensor:
        """The invalid mask once the object is complete: all but the tokens that end the request, and the JSON
        whitespace tokens too where the value may be padded (_pads)."""
        ends = _ids(self.end_ids(seq), vocab)
        if self._pads(seq) and vocab.num_whitespace:
            invalid = vocab.not_whitespace().to(device, copy=True)
            invalid[torch.tensor(_ids(self.eos_token_ids, vocab), dtype=torch.int64, device=device)] = True
        elif ends:
            invalid = torch.ones(vocab.vocab_size, dtype=torch.bool, device=device)
        else:
            raise JsonModeError("JSON mode: the object is complete but no stop token may end the request")
        invalid[torch.tensor(ends, dtype=torch.int64, device=device)] = False
        return invalid


def _ids(token_ids: Iterable[int], vocab: JsonVocab) -> list[int]:
    """The ids of `token_ids` within the vocabulary, sorted."""
    return sorted(t for t in token_ids if 0 <= t < vocab.vocab_size)
