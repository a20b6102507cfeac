"""CompletionJob's response shapes: logprobs of tokens that hold part of a UTF-8 character."""

from __future__ import annotations

import json

import pytest

from lorafleet.worker.completion_job import chat_logprobs, completion_logprobs, text_offsets
from lorafleet.worker.sequence import TokenLogprob
from lorafleet.worker.token_bytes import token_bytes
from lorafleet.worker.tokenizer import Tokenizer

TEXT = "héllo 😊 日本!"


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)  # byte-level BPE without merges: one token per byte


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style BPE with byte fallback (as Llama 2, Mistral): "<0xF0>" tokens, "▁" for spaces."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "▁": 258, "h": 259, "é": 260,
             "!": 261}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>"])
    path = tmp_path_factory.mktemp("sp")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return Tokenizer(path)


def _lps(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=t, logprob=-1.0, top=[(t, -1.0)]) for t in ids]


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_logprob_bytes_are_the_tokens_raw_bytes(kind, byte_tokenizer, sentencepiece_tokenizer):
    """Emoji and CJK are split over byte tokens whose text is U+FFFD; their `bytes` are the raw bytes,
    so the bytes of all tokens join into the text's UTF-8."""
    tokenizer = byte_tokenizer if kind == "byte_level" else sentencepiece_tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    content = chat_logprobs(tokenizer, _lps(ids))["content"]
    assert any(c["token"] == "\ufffd" for c in content)  # partial characters: no text of their own
    joined = b"".join(bytes(c["bytes"]) for c in content)
    assert joined.decode().strip() == TEXT  # SentencePiece: a leading "▁" (space) starts the text
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    pieces = [c["bytes"] for c in content]
    start = pieces.index([0xF0])
    assert pieces[start:start + 4] == [[0xF0], [0x9F], [0x98], [0x8A]]


def test_special_tokens_are_their_content(byte_tokenizer, sentencepiece_tokenizer):
    assert token_bytes(byte_tokenizer)(byte_tokenizer.eos_token_id) == b"</s>"
    assert token_bytes(sentencepiece_tokenizer)(1) == b"<s>"
    assert token_bytes(sentencepiece_tokenizer)(258) == b" "


def test_text_offsets_point_at_the_character_a_token_belongs_to(byte_tokenizer):
    ids = byte_tokenizer.encode("é😊!", add_special_tokens=False)  # 2 + 4 + 1 byte tokens
    whole = completion_logprobs(byte_tokenizer, _lps(ids), 0)["text_offset"]
    assert whole == [0, 0, 1, 1, 1, 1, 2]
    # Streamed: the emoji's text is held back until its last byte, so the second chunk starts at 1.
    first = completion_logprobs(byte_tokenizer, _lps(ids[:4]), 0)["text_offset"]
    second = completion_logprobs(byte_tokenizer, _lps(ids[4:]), 1)["text_offset"]
    assert first + second == whole


@pytest.mark.parametrize("pieces, start, offsets", [
    ([b"h", b"i"], 5, [5, 6]),
    ([b"\xc3", b"\xa9", b"!"], 0, [0, 0, 1]),
    ([b"\xa9", b"!"], 3, [3, 4]),  # the chunk opens with the end of a held-back "é" at 3
    ([b"\xa9!", b"x"], 3, [3, 5]),
    ([b"\x9f", b"\x98", b"\x8a", b"\xf0"], 2, [2, 2, 2, 3]),
    ([], 0, []),
])
def test_text_offsets(pieces, start, offsets):
    assert text_offsets(pieces, start) == offsets
