"""The fewest tokens a text can encode to, known from its length alone (longest_piece).

A prompt past the model's context is refused; counting its tokens takes its whole tokenization first: 4.4 s of
a core for a 4 MB text, with the interpreter lock held for up to 0.2 s at a time. But every token of a BPE
tokenizer stands for at most as many characters of the text as its longest vocabulary string has (a byte-level
token's characters are one byte each, at most one character of the text; a SentencePiece token's are the text's
own, "▁" for a space; a byte-fallback token `<0xE2>` stands for less than one), and the added tokens are
matched whole. So a text of `n` characters encodes to at least n // longest tokens, as long as nothing in the
pipeline drops characters before the model sees them: a normalizer that composes (NFC, NFKC) or strips, a
pre-tokenizer that removes what it splits on (Whitespace, BERT's), an unknown token that swallows a run of
characters (WordPiece's `[UNK]` for a word, BPE's `fuse_unk`). Where any of these is in the pipeline there is
no such bound (0), and a prompt is tokenized before it is counted, as before.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

# Normalizers that never shorten a text: each character maps to one or more (Lowercase, the decompositions),
# or characters are added (Prepend). Replace is checked for its strings (longest_piece).
KEEPING_NORMALIZERS = frozenset({"Lowercase", "NFD", "NFKD", "Prepend"})
# Pre-tokenizers that keep every character: they split, or map one for one (ByteLevel, Metaspace's "▁").
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"})
SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})  # kept unless their behavior is "Removed"


def longest_piece(tok: HFTokenizer) -> int:
    """The most characters of a text one token of `tok` stands for (its longest vocabulary string or added
    token), or 0 where its pipeline may drop characters and the text's length bounds nothing."""
    model = tok.model
    if not isinstance(model, models.BPE):
        return 0
    vocab = tok.get_vocab(with_added_tokens=True)
    if model.fuse_unk and model.unk_token and not (model.byte_fallback and all(
            f"<0x{b:02X}>" in vocab for b in range(256))):  # a run of unknown characters: one token
        return 0
    if not _keeps(_state(tok.normalizer), "normalizers", _keeping_normalizer):
        return 0
    if not _keeps(_state(tok.pre_tokenizer), "pretokenizers", _keeping_pre_tokenizer):
        return 0
    return max(map(len, vocab), default=0)


def at_least(text_len: int, longest: int, slack: int = 0) -> int:
    """The fewest tokens a text of `text_len` characters encodes to, less `slack` (tokens its encoding in parts
    may lose where they join); 0 without a bound (`longest` 0)."""
    return max(0, text_len // longest - slack) if longest > 0 else 0


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
