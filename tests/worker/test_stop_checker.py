"""StopChecker: stop strings across token boundaries, partial UTF-8 held back, stop ids, lengths."""

from __future__ import annotations

from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence, SequenceStatus
from lorafleet.worker.stop_checker import StopChecker
from lorafleet.worker.tokenizer import Tokenizer

EOS = 257


def _feed(checker, seq, token_ids):
    """Append tokens one by one like the engine; returns the streamed pieces."""
    pieces, emitted = [], 0
    for t in token_ids:
        seq.output_token_ids.append(t)
        checker.check(seq)
        if seq.finish_reason:
            seq.status = SequenceStatus.FINISHED
        final = checker.final_text_len(seq, emitted)
        pieces.append(seq.text[emitted:final])
        emitted = final
        if seq.finish_reason:
            break
    return pieces


def test_partial_utf8_is_held_back_until_complete(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    checker = StopChecker(tok, [EOS], 1000)
    seq = Sequence("r", [1], SamplingParams(max_tokens=10))
    ids = tok.encode("aé日", add_special_tokens=False)  # byte tokens: 1 + 2 + 3
    pieces = _feed(checker, seq, ids)
    assert pieces == ["a", "", "é", "", "", "日"]
    assert "".join(pieces) == seq.text == "aé日"


def test_stop_string_spanning_tokens_cuts_text_and_never_streams_it(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    checker = StopChecker(tok, [EOS], 1000)
    seq = Sequence("r", [1], SamplingParams(max_tokens=50, stop=["END", "xyz"]))
    pieces = _feed(checker, seq, tok.encode("hello ENDING", add_special_tokens=False))
    assert seq.finish_reason == "stop" and seq.text == "hello "
    assert "".join(pieces) == "hello " and not any("E" in p for p in pieces)
    seq = Sequence("r", [1], SamplingParams(max_tokens=50, stop=["END"], include_stop_str_in_output=True))
    _feed(checker, seq, tok.encode("hello ENDING", add_special_tokens=False))
    assert seq.text == "hello END"


def test_eos_stop_ids_ignore_eos_and_lengths(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    checker = StopChecker(tok, [EOS], max_model_len=6)
    a, b = tok.encode("AB", add_special_tokens=False)
    seq = Sequence("r", [1], SamplingParams(max_tokens=10))
    _feed(checker, seq, [a, EOS, b])
    assert seq.output_token_ids == [a, EOS] and seq.text == "A" and seq.finish_reason == "stop"
    seq = Sequence("r", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    _feed(checker, seq, [EOS, EOS, EOS, EOS])
    assert len(seq.output_token_ids) == 3 and seq.finish_reason == "length"
    seq = Sequence("r", [1], SamplingParams(max_tokens=10, stop_token_ids=[b]))
    _feed(checker, seq, [a, b, a])
    assert seq.output_token_ids == [a, b] and seq.text == "A" and seq.finish_reason == "stop"
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=10))
    _feed(checker, seq, [a] * 10)
    assert seq.num_tokens == 6 and seq.finish_reason == "length"  # max_model_len


def test_a_stop_string_in_text_held_back_to_the_last_token_is_cut(tiny_llama_dir, tmp_path):
    """A token may hold a stop string and the first byte of a character ("\\n" + c3): its text waits for
    the character's end. When the request ends first (max_tokens, EOS), that last text is searched too."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    tok.add_tokens(["ĊÃ"])  # byte-level spelling of b"\n\xc3"
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    newline_c3 = tok.token_to_id("ĊÃ")
    (a,) = tok.encode("a", add_special_tokens=False)
    checker = StopChecker(tok, [EOS], 1000)
    for ids, max_tokens in (([a, newline_c3], 2), ([a, newline_c3, EOS], 10)):
        seq = Sequence("r", [1], SamplingParams(max_tokens=max_tokens, stop=["\n"]))
        pieces = _feed(checker, seq, ids)
        assert (seq.text, seq.finish_reason, "".join(pieces)) == ("a", "stop", "a"), ids


def test_bytes_that_can_never_be_utf8_stream_as_they_come(tiny_llama_dir):
    # The detokenizer holds back a character that may still complete; a U+FFFD in the text is final, so the
    # stream does not hold a run of them back until other text follows.
    from tests.worker.test_detokenizer import _byte_token

    tok = Tokenizer(tiny_llama_dir)
    checker = StopChecker(tok, [EOS], 1000)
    seq = Sequence("r", [1], SamplingParams(max_tokens=100))
    pieces = _feed(checker, seq, [_byte_token(tok, 0x80)] * 5 + tok.encode("ok", add_special_tokens=False))
    assert pieces[:5] == ["\ufffd"] * 5 and "".join(pieces[5:]) == "ok"


def test_a_stop_string_completed_before_min_tokens_stays_whatever_other_strings_are_listed(tiny_llama_dir):
    """Stop strings are not searched before min_tokens: a "," written at the second token stays, and the third
    token's "," ends the text, with or without a longer stop string beside it (the search window was sized by the
    longest string, and reached back to the earlier ",")."""
    tok = Tokenizer(tiny_llama_dir)
    checker = StopChecker(tok, [EOS], 1000)
    ids = tok.encode("a,b,c", add_special_tokens=False)  # byte tokens: one character each
    for stop in ([","], [",", "an unrelated longer stop string"]):
        seq = Sequence("r", [1], SamplingParams(max_tokens=10, min_tokens=3, stop=stop))
        _feed(checker, seq, ids)
        assert (seq.text, seq.finish_reason, seq.stop_reason) == ("a,b", "stop", ","), stop
