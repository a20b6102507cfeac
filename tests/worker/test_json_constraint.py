"""JSON mode's byte-level validator (json_constraint.py) and its token masks (json_vocab.py), against
Python's json module as the reference."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lorafleet.worker.json_constraint import START, advance, is_complete, is_valid_prefix
from lorafleet.worker.json_vocab import JsonVocab

COMPLETE = [
    b"{}",
    b'  \n\t{"a": 1}',
    b'{"a":[1,2.5,-3e+10,0,-0.0e-1,1E5],"b":{"c":null,"d":true,"e":false},"f":[]}',
    b'{"s": "quote \\" backslash \\\\ slash \\/ \\b\\f\\n\\r\\t \\u00e9 \\uD83D\\ude00"}',
    '{"unicode": "h\u00e9llo \u4e16\u754c \U0001f600", "k\u00e9y": [[[{}]]]}'.encode(),
    b'{ "nested" : [ { "a" : [ 1 , { } ] } , [ ] ] }',
]

INVALID = [
    b"[1]",  # the top-level value must be an object
    b'"text"',
    b"1",
    b"x",
    b"{,",
    b'{"a" 1}',
    b'{"a":}',
    b'{"a":1,}',
    b'{"a":01}',
    b'{"a":1.}',  # a fraction needs digits
    b'{"a":-}',
    b'{"a":.5}',
    b'{"a":1e}',
    b'{"a":+1}',
    b'{"a":tru}',
    b'{"a":nul1}',
    b'{"a":True}',
    b'{"a":[1,]}',
    b'{"a":[1}',
    b'{"a":{]}',
    b'{"a":"x\\q"}',  # not an escape
    b'{"a":"\\u12G4"}',
    b'{"a":"\\ud800"}',  # a lone high surrogate: not text (strict parsers refuse it)
    b'{"a":"\\uDBFFx"}',
    b'{"a":"\\udc00"}',  # a lone low surrogate
    b'{"a":"\\ud83d\\n"}',  # a high surrogate must be followed by an escaped low one
    b'{"a":"\\ud83d\\u0041"}',
    b'{"a":"\\ud83d\\ud83d"}',
    b'{"\\udfff":1}',
    b'{"a":"tab\there"}',  # control bytes must be escaped in strings
    b"{}}",
    b"{} ",  # nothing may follow the object, not even whitespace
    b"{}{}",
    b"{'a': 1}",
    b'{a: 1}',
]


@pytest.mark.parametrize("text", COMPLETE)
def test_complete_objects_are_complete_and_every_prefix_is_valid(text):
    assert isinstance(json.loads(text), dict)
    for i in range(len(text)):
        state = advance(START, text[:i])
        assert state is not None and not is_complete(state), text[:i]
    assert is_complete(advance(START, text))


@pytest.mark.parametrize("text", INVALID)
def test_invalid_texts_are_refused(text):
    assert advance(START, text) is None


@pytest.mark.parametrize("text", COMPLETE)
def test_any_split_into_tokens_gives_the_same_state(text):
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        state = START
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            state = advance(state, text[a:b])
        assert state == advance(START, text)


def test_one_token_can_close_several_levels_and_bytes_after_the_object_are_refused():
    state = advance(START, b'{"a":[{"b":[1')
    assert state == ("int", "{[{[")
    assert is_complete(advance(state, b"]}]}"))
    assert advance(state, b"]}]} ") is None
    assert advance(state, b"]}]]") is None
    assert advance(state, b"]}") == ("after", "{[")


def test_split_utf8_and_number_endings():
    emoji = "\U0001f600".encode()
    state = advance(START, b'{"a":"' + emoji[:2])
    assert state == ("str~280bf", "{") and advance(state, emoji[2:] + b'"}') == ("done", "")  # 2 bytes to come
    assert advance(START, b'{"a":12') == ("int", "{")
    assert advance(START, b'{"a":12 ') == ("after", "{")
    assert advance(START, b'{"a":0') == ("zero", "{")
    assert advance(START, b'{"a":1.5e-') == ("exp_sign", "{")
    assert advance(START, b'{"a":true') == ("after", "{")


def test_random_json_objects_are_accepted_and_random_bytes_match_a_parse():
    rng = random.Random(0)

    def value(depth):
        kind = rng.randrange(7 if depth < 3 else 4)
        return [lambda: rng.choice([None, True, False]), lambda: rng.uniform(-1e6, 1e6),
                lambda: rng.randrange(-10**9, 10**9), lambda: "".join(chr(rng.randrange(1, 0x3000)) for _ in range(5)),
                lambda: [value(depth + 1) for _ in range(rng.randrange(3))],
                lambda: {str(k): value(depth + 1) for k in range(rng.randrange(3))},
                lambda: {"x": value(depth + 1)}][kind]()

    for _ in range(200):
        obj = {f"k{i}": value(0) for i in range(rng.randrange(4))}
        text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])).encode()
        assert is_complete(advance(START, text)), text
    # Short random texts over JSON's alphabet: complete exactly when json.loads parses an object.
    alphabet = b'{}[]":,0123456789-+.eE truefalsn\\u '
    for _ in range(3000):
        text = b"{" + bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 8)))
        state = advance(START, text)
        try:
            ok = isinstance(json.loads(text), dict) and text == text.rstrip()
        except ValueError:
            ok = False
        assert (state is not None and is_complete(state)) == ok, text
        if state is not None:
            assert is_valid_prefix(text)


def test_masks_match_accepts_and_are_cached():
    rng = random.Random(1)
    pieces = [bytes([b]) for b in range(256)] + [b'"}', b'"]}', b"}]}", b' "', b"true", b"  ", b"\\u00", b'":',
                                                 b"12.5", b"abc", b'a"', b"\\", b"\xe4\xb8", b"", b"}"]
    tokens = [*pieces, *(bytes(rng.randrange(32, 127) for _ in range(rng.randrange(1, 6))) for _ in range(300))]
    vocab = JsonVocab([*tokens, None])  # the last token is special: never JSON
    for text in (b"", b"{", b'{"a', b'{"a\\', b'{"a":', b'{"a":[1', b'{"a":[{"b":tr', b'{"a":"x\\u0'):
        state = advance(START, text)
        for may_complete in (True, False):
            invalid, num_valid = vocab.mask(state, may_complete)
            mask = ~invalid
            expected = torch.tensor([vocab.accepts(state, t, may_complete) for t in range(len(tokens) + 1)])
            assert torch.equal(mask, expected) and num_valid == int(expected.sum()), text
            assert not mask[-1] and not mask[pieces.index(b"")]
    built = vocab.num_built
    vocab.mask(advance(START, b'{"a":[1'))
    assert vocab.num_built == built
    state = advance(START, b'{"a":[1')
    assert not vocab.accepts(state, pieces.index(b"}]}"))  # '}' does not close '['
    assert vocab.accepts(advance(START, b'{"a":[{"b":1'), pieces.index(b"}]}"))  # three levels at once
    closing = advance(START, b'{"a":[1]')
    assert vocab.accepts(closing, pieces.index(b"}"), True) and not vocab.accepts(closing, pieces.index(b"}"), False)


def test_escaped_text_is_accepted_and_escaped_lone_surrogates_are_not():
    """json.dumps(ensure_ascii) writes characters past U+FFFF as escaped surrogate pairs: accepted, split
    anywhere; Python's json also reads a lone escaped surrogate, which is no character: refused."""
    rng = random.Random(1)
    points = [c for c in range(0x20, 0x110000, 97) if not 0xD800 <= c <= 0xDFFF] + [0xD7FF, 0xE000, 0x10FFFF]
    for _ in range(300):
        text = json.dumps({"".join(map(chr, rng.sample(points, 2))): "".join(map(chr, rng.sample(points, 6)))}).encode()
        assert is_complete(advance(START, text)), text
        cut = rng.randrange(1, len(text))
        assert advance(advance(START, text[:cut]), text[cut:]) == ("done", "")
    for lone in (0xD800, 0xDBFF, 0xDC00, 0xDFFF):
        for text in (json.dumps({"a": chr(lone)}), json.dumps({"a": "x" + chr(lone) + "\U0001f600"}),
                     json.dumps({chr(lone): 1})):
            assert json.loads(text) and advance(START, text.encode()) is None, text
