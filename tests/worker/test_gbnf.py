"""GBNF grammars (gbnf.py): the texts taken are those the grammar derives (against `re` where the grammar is
regular, against a recursive reference where it is not), every state reached can still end in a whole root,
masks equal a token-by-token check, and what a grammar or its output may cost is bounded."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from lorafleet.worker.gbnf import GbnfGrammar, GrammarMachine
from lorafleet.worker.json_vocab import JsonVocab
from lorafleet.worker.regex_dfa import RegexError
from lorafleet.worker.regex_grammar import DONE
from tests.worker.grammar_checks import allowed, check_masks

ALPHABET = "ab(),x "
REGULAR = [  # (grammar, the same language as a Python regex)
    ('root ::= "a" | "b" "a"*', r"a|ba*"),
    ('root ::= x{2,3} "b"?\nx ::= [ab]', r"[ab]{2,3}b?"),
    ('root ::= (w " ")* w\nw ::= [a-b]+ # words', r"([ab]+ )*[ab]+"),
    ('root ::= ("(" | ")")+ [^ab()x]?', r"[()]+[^ab()x]?"),
    ('root ::= e\ne ::= "" | "a" e', r"a*"),
    ('root ::= "\\x61\\u0062" "\\U00000078"?', r"abx?"),
    ('root ::= list\nlist ::= "x" ("," list)?', r"x(,x)*"),
]


@pytest.mark.parametrize("grammar, pattern", REGULAR)
def test_a_regular_grammar_takes_the_texts_its_regex_does(grammar, pattern):
    machine, ref = GrammarMachine(grammar), re.compile(pattern)
    for n in range(6):
        for chars in itertools.product(ALPHABET, repeat=n):
            text = "".join(chars)
            assert machine.matches(text) is bool(ref.fullmatch(text)), (grammar, text)


def _balanced(text: str) -> bool:
    """The reference for NESTED: e ::= "x" | "(" e ("," e)* ")"."""
    def e(i: int) -> int:
        if text.startswith("x", i):
            return i + 1
        if not text.startswith("(", i):
            return -1
        i = e(i + 1)
        while i >= 0 and text.startswith(",", i):
            i = e(i + 1)
        return i + 1 if i >= 0 and text.startswith(")", i) else -1
    return e(0) == len(text)


NESTED = 'root ::= e\ne ::= "x" | "(" e ("," e)* ")"'


def test_a_recursive_grammar_takes_the_texts_a_recursive_reader_does():
    machine = GrammarMachine(NESTED)
    for n in range(8):
        for chars in itertools.product("x(),", repeat=n):
            text = "".join(chars)
            assert machine.matches(text) is _balanced(text), text
    assert machine.matches("(" * 200 + "x" + ")" * 200)
    with pytest.raises(RegexError, match="deeper than 256"):
        machine.matches("(" * 300)


@pytest.mark.parametrize("grammar", [g for g, _ in REGULAR] + [NESTED])
def test_byte_walks_always_have_a_way_on_and_end_in_texts_the_grammar_takes(grammar):
    guide, rng, done = GbnfGrammar(grammar), random.Random(1), 0
    for _ in range(40):
        state, out = guide.start, bytearray()
        while state != DONE and len(out) < 40:
            ways = allowed(guide, state)
            assert ways, bytes(out)  # a state reached always has a way on
            out.append(rng.choice(ways))
            state = guide.advance(state, out[-1:])
            if guide.may_stop(state) and rng.random() < 0.3:
                break
        if state == DONE or guide.may_stop(state):
            assert guide.regex.matches(out.decode()), out
            done += 1
    assert done >= 10


def test_masks_equal_a_token_by_token_check():
    guide = GbnfGrammar('root ::= "SELECT " col (", " col)* " FROM " ("users" | "orders")\ncol ::= [a-z_]+ | "*"')
    pieces = ["SELECT", " ", "SELECT ", "*", "a", "ab", "_x", ",", ", ", " FROM", " FROM ", "users", "user", "s",
              "orders", "é", "\\n", "\"", "FROM"]
    assert check_masks(JsonVocab([p.encode() for p in pieces] + [None]), guide, random.Random(3), walks=12,
                       steps=20) > 100


@pytest.mark.parametrize("grammar, needle", [
    ('root ::= x', "the rule 'x' is used but not defined"),
    ('start: "a"', "a Lark rule"),
    ('main ::= "a"', "no 'root' rule"),
    ('root ::= root "a" | "b"', "left-recursive (root -> root"),
    ('root ::= a\na ::= b "x" | "z"\nb ::= "y"? a', "left-recursive (a -> b -> a"),
    ('root ::= "a" | root', "left-recursive"),
    ('root ::= "abc', "an unterminated string"),
    ('root ::= [a-', "an unterminated character class"),
    ('root ::= ("a"', "a missing ')'"),
    ('root ::= "a" root', "root derives no text"),
    ('root ::= "a"\nroot ::= "b"', "the rule 'root' defined twice"),
    ('root ::= \\d', "an unexpected"),
    ('root ::= "\\d"', "not GBNF"),
    ('root ::= "\\b"', "the escape '\\b' is not GBNF"),
    ('root ::= "\\U+0000041"', "a malformed '\\U' escape"),
    ('root ::= "a"{1001}', "a counted repeat above 1000"),
])
def test_grammars_that_cannot_be_held_are_refused_naming_why(grammar, needle):
    with pytest.raises(RegexError, match=re.escape(needle)):
        GrammarMachine(grammar)


def test_readings_that_share_a_future_are_kept_once():
    """A stack per reading would double every character here (each "a" may close with "b" or "c"), and an
    arithmetic grammar's common prefixes would multiply at every parenthesis: both stay small."""
    machine = GrammarMachine('root ::= s\ns ::= "a" s "b" | "a" s "c" | "z"')
    text = "a" * 60 + "z" + "bc" * 30
    assert machine.matches(text) and not machine.matches(text + "b")
    arithmetic = GrammarMachine('root ::= expr\nexpr ::= term "+" expr | term "-" expr | term\n'
                                'term ::= factor "*" term | factor "/" term | factor\nfactor ::= "(" expr ")" | [0-9]+')
    assert arithmetic.matches("(" * 40 + "1+2*3" + ")" * 40 + "-4/(5)")
    assert not arithmetic.matches("(1+2))")
    k = 24  # each rule calls the next at its start: one link per alternative, not 2^k stacks
    chain = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a" | r{i + 1} "b"\n' for i in range(k)) + f'r{k} ::= "c"'
    assert GrammarMachine(chain).matches("c" + "ab" * 12)


def test_a_closure_past_its_bound_fails_its_request(monkeypatch):
    """MAX_CLOSURE bounds the (state, link) pairs one character's closure visits: a step past it fails."""
    from lorafleet.worker import gbnf

    grammar = 'root ::= e\ne ::= "x" | "(" e ("," e)* ")"'
    monkeypatch.setattr(gbnf, "MAX_CLOSURE", 3)
    machine = GrammarMachine(grammar)
    with pytest.raises(RegexError, match="over 3 ways"):
        machine.matches("((x")  # "x" ends e: its closure returns through the links below
    monkeypatch.setattr(gbnf, "MAX_CLOSURE", 20_000)
    assert GrammarMachine(grammar).matches("((((x,(x)))))")
