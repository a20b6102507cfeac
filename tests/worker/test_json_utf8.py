"""JSON mode's validator (json_constraint.py) takes only well-formed UTF-8 (RFC 3629) inside strings: a
constrained output is a valid JSON text (RFC 8259 wants UTF-8), whatever byte pieces the tokens hold."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from lorafleet.worker.json_constraint import START, advance, is_complete, is_in_string
from lorafleet.worker.json_vocab import JsonVocab

KEY = b'{"k'  # inside a key
VALUE = b'{"a":"'  # inside a value string

MALFORMED = [
    b"\x80",  # a continuation byte with no lead
    b"a\xbf",
    b"\xc3\xa9\xa9",  # one continuation byte too many
    b"\xc0\xaf",  # overlong '/'
    b"\xc1\xbf",
    b"\xe0\x80\xaf",  # overlong 3-byte form
    b"\xe0\x9f\xbf",
    b"\xf0\x80\x80\xaf",  # overlong 4-byte form
    b"\xf0\x8f\xbf\xbf",
    b"\xed\xa0\x80",  # U+D800, a surrogate
    b"\xed\xbf\xbf",  # U+DFFF
    b"\xf4\x90\x80\x80",  # U+110000, past Unicode
    b"\xf5\x80\x80\x80",
    b"\xf8\x88\x80\x80\x80",  # 5-byte forms were never UTF-8
    b"\xfe",
    b"\xff",
    b"\xc3a",  # a lead byte followed by ASCII
    b"\xe4\xb8a",
]

TRUNCATED = [b"\xc3", b"\xe4\xb8", b"\xf0\x9f\x98", b"\xe4", b"\xf0"]  # cut before the closing quote

TEXTS = ["\u00e9", "\u4e2d", "\U0001f600", "\u00e9t\u00e9 \u4e2d\u6587 \U0001f600\U0001f680!", "\U0010ffff",
         "\ud7ff\ue000\uffff", "\u0080\u07ff\u0800"]


@pytest.mark.parametrize("prefix", [KEY, VALUE])
@pytest.mark.parametrize("piece", MALFORMED)
def test_malformed_utf8_in_strings_is_refused(prefix, piece):
    assert advance(START, prefix + piece) is None
    # Byte by byte too: the first byte that cannot continue a character is refused on its own.
    state = advance(START, prefix)
    for i in range(len(piece)):
        state = advance(state, piece[i:i + 1])
        if state is None:
            break
    assert state is None


@pytest.mark.parametrize("piece", TRUNCATED)
def test_a_character_cut_by_the_closing_quote_is_refused(piece):
    state = advance(START, VALUE + piece)
    assert state is not None and not is_in_string(state)  # waits for the rest of the character
    assert advance(state, b'"') is None and advance(state, b'"}') is None
    assert advance(START, KEY + piece + b'":1}') is None
    assert advance(state, b"\\n") is None  # nor an escape


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_split_anywhere_across_tokens_is_accepted(text):
    whole = b'{"' + text.encode() + b'": "' + text.encode() + b'"}'
    assert is_complete(advance(START, whole)) and json.loads(whole) == {text: text}
    for cut in range(1, len(whole)):  # every single cut, and every pair of cuts
        assert advance(advance(START, whole[:cut]), whole[cut:]) == ("done", "")
    for a, b in itertools.combinations(range(1, len(whole)), 2):
        state = advance(advance(advance(START, whole[:a]), whole[a:b]), whole[b:])
        assert state == ("done", ""), (a, b)


def test_random_bytes_in_a_string_match_pythons_utf8_decoder():
    """Every split of random bytes is accepted exactly when Python's strict decoder takes them (and JSON
    would not need them escaped)."""
    rng = random.Random(0)
    alphabet = [*range(0x80, 0x100), 0xC3, 0xE0, 0xED, 0xF0, 0xF4, 0xE4, 0xB8, 0xA9, 0x9F, 0x8F, 0x90, 0x61]
    for _ in range(4000):
        piece = bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 6)))
        try:
            piece.decode("utf-8")
            ok = True
        except UnicodeDecodeError:
            ok = False
        whole = VALUE + piece + b'"}'
        assert is_complete(advance(START, whole) or START) == ok, piece
        cut = rng.randrange(1, len(whole))
        state = advance(START, whole[:cut])
        assert (state is not None and advance(state, whole[cut:]) == ("done", "")) == ok, (piece, cut)


def test_token_masks_follow_utf8_inside_strings():
    pieces = [bytes([b]) for b in range(256)] + [b"\xc3\xa9", b"\xe4\xb8", b"\xb8\xad", b"\xad", b'\xad"}',
                                                 b"\xed\xa0\x80", b"ab\xf0\x9f", b"\x98\x80", b"\xc3\xa9\xa9"]
    vocab = JsonVocab(pieces)
    for text in (VALUE, VALUE + b"\xe4", VALUE + b"\xe4\xb8", VALUE + b"\xf0\x9f", VALUE + b"\xed", KEY + b"\xc3"):
        state = advance(START, text)
        invalid, num_valid = vocab.mask(state)
        expected = [vocab.accepts(state, t) for t in range(len(pieces))]
        assert (~invalid).tolist() == expected and num_valid == sum(expected), text
        prefix = VALUE if text.startswith(VALUE) else KEY
        for t, ok in enumerate(expected):
            after = advance(state, pieces[t])
            assert ok == (after is not None)
            if ok and is_in_string(after):  # back in the string: every character so far is whole
                (text + pieces[t])[len(prefix):].decode("utf-8")
    inside = advance(START, VALUE)
    assert vocab.accepts(inside, pieces.index(b"\xc3\xa9")) and not vocab.accepts(inside, pieces.index(b"\xad"))
    assert not vocab.accepts(inside, pieces.index(b"\xed\xa0\x80"))
    assert not vocab.accepts(inside, pieces.index(b"\xc3\xa9\xa9"))
    after_lead = advance(START, VALUE + b"\xe4")
    assert vocab.accepts(after_lead, pieces.index(b"\xb8\xad")) and not vocab.accepts(after_lead, pieces.index(b"a"))
    assert is_complete(advance(advance(START, VALUE + b"\xe4\xb8"), b'\xad"}'))
