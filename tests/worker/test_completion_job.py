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


def test_tokens_of_equal_text_keep_the_sampled_tokens_logprob_in_top_logprobs(byte_tokenizer):
    """Byte tokens 0x80 and 0x81 both read U+FFFD: one key. It said the logprob of whichever came last,
    not the sampled token's (token_logprobs said another value for the same token)."""
    table = token_bytes(byte_tokenizer)
    x80, x81 = (next(i for i in range(byte_tokenizer.vocab_size) if table(i) == bytes([b])) for b in (0x80, 0x81))
    a = byte_tokenizer.encode("a", add_special_tokens=False)[0]
    lps = [TokenLogprob(token_id=x80, logprob=-4.108, top=[(a, -1.0), (x80, -4.108), (x81, -4.128)]),
           TokenLogprob(token_id=a, logprob=-1.0, top=[(x81, -0.9), (a, -1.0), (x80, -1.2)])]
    got = completion_logprobs(byte_tokenizer, lps, TextOffsets())
    assert got["token_logprobs"] == [-4.108, -1.0]
    assert got["top_logprobs"] == [{"a": -1.0, "\ufffd": -4.108}, {"\ufffd": -0.9, "a": -1.0}]


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


def _reference_offsets(pieces: list[bytes]) -> tuple[str, list[int]]:
    """The final text and, per token, how many of its characters end within the bytes before the token.
    Character spans come from the strict codec: a valid character, or the maximal invalid run it reports
    (one U+FFFD in the lenient text)."""
    data, spans, pos = b"".join(pieces), [], 0
    while pos < len(data):
        try:
            width = len(data[pos:].decode()[0].encode())
        except UnicodeDecodeError as exc:  # a valid character before the error, or the error's run
            width = len(data[pos:pos + exc.start].decode()[0].encode()) if exc.start else exc.end
        spans.append((pos, pos + width))
        pos += width
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    text = data.decode(errors="replace")
    assert len(spans) == len(text)
    return text, [sum(end <= start for _, end in spans) for start in starts]


BYTE_RUNS = [
    ([b"\xc3", b"A", b"B"], [0, 1, 2]),  # "\ufffdAB": "A" cannot continue c3
    ([b"\xc3", b"\xc3", b"A"], [0, 1, 2]),  # a run of lead bytes: one U+FFFD each
    ([b"\xf0", b"\xf0", b"\xf0\x9f\x98\x8a", b"!"], [0, 1, 2, 3]),
    ([b"\xe2", b"\x82", b"A"], [0, 0, 1]),  # "\xe2\x82" is one U+FFFD (a truncated "€")
    ([b"\xe2\x82", b"A"], [0, 1]),
    ([b"\xf0\x9f", b"\x98", b"A", b"\xc3\xa9"], [0, 0, 1, 2]),
    ([b"\xc3", b"\xa9", b"\xc3", b"B"], [0, 0, 1, 2]),  # "é\ufffdB"
    ([b"\xe2", b"\x82\xac", b"x"], [0, 0, 1]),  # "€x": a valid character split over tokens
    ([b"\xed\xa0", b"\x80"], [0, 2]),  # an encoded surrogate: three U+FFFD
    ([b"\xff\xfe", b"x"], [0, 2]),
    ([b"a", b"\xe2", b"\x82"], [0, 1, 1]),  # ends inside a character: a U+FFFD at the end of the text
    ([b"\xc3", b"", b"A"], [0, 1, 1]),  # a token without bytes: after the U+FFFD, at "A"
]


@pytest.mark.parametrize(("pieces", "expected"), BYTE_RUNS)
def test_text_offsets_follow_the_returned_text_after_invalid_bytes(pieces, expected):
    text, reference = _reference_offsets(pieces)
    assert reference == expected
    assert TextOffsets()(pieces) == expected
    for i, piece in enumerate(pieces):  # each token's text starts where its offset points (U+FFFD aside)
        if piece and piece.decode(errors="replace").isascii():
            assert text[expected[i]:].startswith(piece.decode())
    for cut in range(1, len(pieces)):  # streamed in two chunks: the same offsets
        if pieces[cut - 1]:  # (a token without bytes at a chunk's end cannot look past it)
            offsets = TextOffsets()
            assert offsets(pieces[:cut]) + offsets(pieces[cut:]) == expected


def _echo_job(tokenizer, prompt: str, skip_special_tokens: bool = True):
    from lorafleet.worker.completion_job import CompletionJob
    from lorafleet.worker.openai_protocol import SamplingOptions
    from lorafleet.worker.tenants import Tenant

    options = SamplingOptions(max_tokens=4, logprobs=0, echo=True, skip_special_tokens=skip_special_tokens)
    return CompletionJob("completions", "cmpl-1", "m", None, [tokenizer.encode(prompt)], options,
                         Tenant("t", is_dev=True), prompts=[prompt], choice_prompt=[0])


def test_echoed_offsets_follow_the_prompt_as_sent(sentencepiece_tokenizer):
    """A string prompt is echoed as sent, without the BOS token's "<s>" and SentencePiece's leading space
    its tokens spell: the completion's tokens start at the end of the echoed prompt, not beyond."""
    tok = sentencepiece_tokenizer
    job = _echo_job(tok, "hé!")
    job.prompt_ids[0].insert(0, 1)  # <s>, as a Llama 2 tokenizer adds it
    completion = [258, 259, 261]  # "▁", "h", "!": " h!"
    choice = job.choice(tok, 0, " h!", _lps(completion), "length", delta=False)
    text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text == "hé! h!"
    assert offsets[-len(completion):] == [3, 4, 5]
    assert offsets[:len(job.prompt_ids[0])] == [0, 0, 0, 1, 2]  # <s> and "▁" at the prompt's start
    streamed = TextOffsets()
    first = job.choice(tok, 0, " h", _lps(completion[:2]), None, delta=True, first=True, offsets=streamed)
    last = job.choice(tok, 0, "!", _lps(completion[2:]), "length", delta=True, offsets=streamed)
    assert first["logprobs"]["text_offset"] + last["logprobs"]["text_offset"] == offsets


def test_skipped_special_tokens_take_no_room(byte_tokenizer):
    """With skip_special_tokens (the default) "</s>" is not in the text: tokens after it start where it was."""
    tok = byte_tokenizer
    h, i = tok.encode("hi", add_special_tokens=False)
    job = _echo_job(tok, "a")
    job.options.echo = False
    choice = job.choice(tok, 0, "hi", _lps([h, tok.eos_token_id, i]), "length", delta=False)
    assert choice["logprobs"]["text_offset"] == [0, 1, 1]
    job.options.skip_special_tokens = False
    choice = job.choice(tok, 0, "h</s>i", _lps([h, tok.eos_token_id, i]), "length", delta=False)
    assert choice["logprobs"]["text_offset"] == [0, 1, 5]
