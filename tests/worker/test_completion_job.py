"""CompletionJob's response shapes: logprobs of tokens that hold part of a UTF-8 character."""

from __future__ import annotations

import json

import pytest

from lorafleet.worker.completion_job import TextOffsets, chat_logprobs, completion_logprobs
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
    whole = completion_logprobs(byte_tokenizer, _lps(ids), TextOffsets())["text_offset"]
    assert whole == [0, 0, 1, 1, 1, 1, 2]
    # Streamed: one TextOffsets per choice carries the emoji begun in the first chunk into the second.
    offsets = TextOffsets()
    first = completion_logprobs(byte_tokenizer, _lps(ids[:4]), offsets)["text_offset"]
    second = completion_logprobs(byte_tokenizer, _lps(ids[4:]), offsets)["text_offset"]
    assert first + second == whole


def test_completion_top_logprobs_always_hold_the_sampled_token(byte_tokenizer):
    """OpenAI's completions `logprobs`: the sampled token is always among `top_logprobs` (so up to
    `logprobs` + 1 entries), also when it is not one of the most likely."""
    a, b, c = byte_tokenizer.encode("abc", add_special_tokens=False)
    lps = [TokenLogprob(token_id=c, logprob=-3.0, top=[(a, -0.5), (b, -1.0)]),  # sampled, not in the top 2
           TokenLogprob(token_id=a, logprob=-0.5, top=[(a, -0.5), (b, -1.0)]),  # sampled, the most likely
           TokenLogprob(token_id=b, logprob=-1.0, top=[])]  # logprobs=0: only the sampled token
    tops = completion_logprobs(byte_tokenizer, lps, TextOffsets())["top_logprobs"]
    assert tops == [{"a": -0.5, "b": -1.0, "c": -3.0}, {"a": -0.5, "b": -1.0}, {"b": -1.0}]


@pytest.mark.parametrize("chunks, offsets", [
    ([[b"h", b"i"]], [[0, 1]]),
    ([[b"\xc3", b"\xa9", b"!"]], [[0, 0, 1]]),
    ([[b"ab\xc3"], [b"\xa9", b"!"]], [[0], [2, 3]]),  # the next chunk opens with the end of "é" at 2
    ([[b"\xc3"], [b"\xa9!", b"x"]], [[0], [0, 2]]),
    ([[b"ab\xf0"], [b"\x9f", b"\x98", b"\x8a", b"\xf0"]], [[0], [2, 2, 2, 3]]),
    ([[b"a"], [], [b"b"]], [[0], [], [1]]),
    ([[b"a\xff", b"b"]], [[0, 2]]),  # a byte that is no UTF-8 is one U+FFFD in the text
])
def test_text_offsets(chunks, offsets):
    text_offsets = TextOffsets()
    assert [text_offsets(pieces) for pieces in chunks] == offsets
