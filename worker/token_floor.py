"""The fewest tokens a text can encode to, known from its length alone (token_floor).

A prompt past the model's context is refused; counting its tokens takes its whole tokenization first: 4.4 s of
a core for a 4 MB text, with the interpreter lock held for up to 0.2 s at a time. But every token of a BPE
tokenizer stands for at most as many characters of the text as its longest vocabulary string has (a byte-level
token's characters are one byte each, at most one character of the text; a SentencePiece token's are the text's
own, "▁" for a space; a byte-fallback token `<0xE2>` stands for less than one), and the added tokens are
matched whole. So a text of `n` characters encodes to at least n // longest tokens, as long as nothing in the
pipeline drops characters before the model sees them: a normalizer that composes (NFC, NFKC) or strips, a
pre-tokenizer that removes what it splits on (Whitespace, BERT's), an unknown token that swallows a run of
characters (WordPiece's `[UNK]` for a word, BPE's `fuse_unk`), a BPE with no token for a character (no unknown
token, no byte for it), an added token that takes the whitespace beside it (`lstrip`, `rstrip`). Where any of
these is in the pipeline there is no such bound (0), and a prompt is tokenized before it is counted, as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

# Normalizers that never shorten a text: each character maps to one or more (Lowercase, the decompositions),
# or characters are added (Prepend). Replace is checked for its strings (_keeping_normalizer).
KEEPING_NORMALIZERS = frozenset({"Lowercase", "NFD", "NFKD", "Prepend"})
# Pre-tokenizers that keep every character: they split, or map one for one (ByteLevel, Metaspace's "▁").
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"})
SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})  # kept unless their behavior is "Removed"


@dataclass(frozen=True, slots=True)
class TokenFloor:
    """A tokenizer's bound: `longest` characters (bytes, where `dropped`) one token stands for at most, 0 for no
    bound; `dropped`: bytes a byte-level vocabulary has no token for (SmolLM2 lacks eight), which
    the model drops, so a text's bytes are counted without them."""

    longest: int = 0
    dropped: bytes = b""

    def at_least(self, texts: Iterable[str], slack: int = 0) -> int:
        """The fewest tokens `texts` (encoded one after another) encode to, less `slack` (tokens an encoding in
        parts may lose where they join); 0 without a bound."""
        if not self.longest:
            return 0
        if not self.dropped:
            size = sum(map(len, texts))
        else:  # bytes, as a byte-level model reads them, less those it drops
            size = 0
            for text in texts:
                data = text.encode("utf-8", "surrogatepass")
                size += len(data.translate(None, self.dropped))  # one pass: 7 ms for 4 MB
        return max(0, size // self.longest - slack)


def token_floor(tok: HFTokenizer) -> TokenFloor:
    """`tok`'s bound: the most characters of a text one token stands for (its longest vocabulary string or added
    token), or none where its pipeline may drop characters and the text's length bounds nothing."""
    model = tok.model
    if not isinstance(model, models.BPE):
        return TokenFloor()
    vocab = tok.get_vocab(with_added_tokens=True)
    pre_tokenizer = _state(tok.pre_tokenizer)
    if any(t.lstrip or t.rstrip for t in tok.get_added_tokens_decoder().values()):
        return TokenFloor()  # an added token that takes the whitespace beside it stands for a run of any length
    if not _keeps(_state(tok.normalizer), "normalizers", _keeping_normalizer):
        return TokenFloor()
    if not _keeps(pre_tokenizer, "pretokenizers", _keeping_pre_tokenizer):
        return TokenFloor()
    longest = max(map(len, vocab), default=0)
    if model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return TokenFloor(longest)  # every byte has a token
    if _has(pre_tokenizer, "ByteLevel"):  # a byte-level vocabulary: each byte one character of its alphabet
        dropped = bytes(sorted(b for c, b in gpt2_byte_decoder().items() if c not in vocab and b in _UTF8))
        # Counted in bytes where some are dropped: a token then stands for at most its string's UTF-8 bytes.
        return TokenFloor(max(len(t.encode()) for t in vocab), dropped) if dropped else TokenFloor(longest)
    if model.unk_token and model.unk_token in vocab and not model.fuse_unk:
        return TokenFloor(longest)  # a character without a token is the unknown token, one each
    return TokenFloor()  # a character without a token is dropped, or a run of them is one token (fuse_unk)


_UTF8 = frozenset(range(0xC0)) | frozenset(range(0xC2, 0xF5))  # the bytes UTF-8 text can hold


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode inverted: the byte each character of a byte-level vocabulary stands for (printable
    Latin-1 bytes are their own character, the others U+0100 on, in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


def _has(state: dict | None, kind: str) -> bool:
    """Whether the pre-tokenizer `state` is, or holds in its sequence, one of type `kind`."""
    if state is None:
        return False
    return state.get("type") == kind or any(_has(m, kind) for m in state.get("pretokenizers") or ())


def _state(component: Any) -> dict | None:
    """A normalizer's or pre-tokenizer's definition, as tokenizer.json writes it (None: there is none)."""
    return None if component is None else json.loads(component.__getstate__())


def _keeps(state: dict | None, members: str, keeping) -> bool:
    if state is None:
        return True
    if state.get("type") == "Sequence":
        return all(_keeps(member, members, keeping) for member in state.get(members) or ())
    return keeping(state)


def _keeping_normalizer(state: dict) -> bool:
    kind = state.get("type")
    if kind == "Replace":  # a literal string replaced by one at least as long; a regex may match any length
        pattern = state.get("pattern") or {}
        return "String" in pattern and len(state.get("content") or "") >= len(pattern["String"])
    return kind in KEEPING_NORMALIZERS


def _keeping_pre_tokenizer(state: dict) -> bool:
    kind = state.get("type")
    if kind in SPLITTING_PRE_TOKENIZERS:
        return state.get("behavior", "Isolated") != "Removed"
    return kind in KEEPING_PRE_TOKENIZERS
