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


def _language(rules: dict, n: int) -> set[str]:
    """The texts of at most `n` characters over "ab" the root derives: each rule's language, to a fixpoint."""
    def lang(tree, env) -> set[str]:
        kind = tree[0]
        if kind == "set":
            return {ch for ch in "ab" if any(lo <= ord(ch) <= hi for lo, hi in tree[1])}
        if kind == "ref":
            return env[tree[1]]
        if kind == "alt":
            return set().union(*(lang(t, env) for t in tree[1]))
        if kind == "cat":
            out = {""}
            for t in tree[1]:
                part = lang(t, env)
                out = {x + y for x in out for y in part if len(x) + len(y) <= n}
            return out
        _, inner, lo, hi = tree
        part, out, cur = lang(inner, env), set(), {""}
        for k in range(max(lo, n + 1) if hi is None else hi + 1):
            if k >= lo:
                out |= cur
            cur = {x + y for x in cur for y in part if len(x) + len(y) <= n}
        return out

    env = {name: set() for name in rules}
    while (new := {name: lang(tree, env) for name, tree in rules.items()}) != env:
        env = new
    return env["root"]


def _random_rule(rng: random.Random, names: list[str], depth: int = 0) -> str:
    def atom() -> str:
        pick = rng.random()
        text = rng.choice(['"a"', '"b"', '"ab"', "[ab]", '""']) if pick < 0.5 or depth > 1 else \
            rng.choice(names) if pick < 0.8 else f"({_random_rule(rng, names, depth + 1)})"
        return text + rng.choice(["", "", "", "?", "*", "+", "{1,2}"])
    return " | ".join(" ".join(atom() for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3)))


def test_random_grammars_take_the_texts_they_derive():
    """Random grammars of three rules (recursion, nullable parts, repeats): every text of up to 6 characters is
    taken exactly when the grammar derives it; left-recursive ones are refused."""
    from lorafleet.worker.gbnf_parse import GbnfParser

    rng, checked = random.Random(11), 0
    for _ in range(500):
        names = ["root", "x", "y"]
        text = "\n".join(f"{name} ::= {_random_rule(rng, names)}" for name in names)
        try:
            machine = GrammarMachine(text)
        except RegexError as exc:
            assert "left-recursive" in str(exc) or "derives no text" in str(exc), (text, exc)
            continue
        derived = _language(GbnfParser(text).rules(), 6)
        for k in range(7):
            for chars in itertools.product("ab", repeat=k):
                word = "".join(chars)
                assert machine.matches(word) is (word in derived), (text, word)
        checked += 1
    assert checked > 80


def test_equal_states_share_their_links_and_machines_do_not_share_keys():
    """States are compared as cache keys: built twice, the same state holds the same link objects (interned),
    so comparing them never walks every path below (exponential where paths merge, as here)."""
    grammar = ('root ::= expr\nexpr ::= term "+" expr | term\nterm ::= factor "*" term | factor\n'
               'factor ::= "(" expr ")" | [0-9]+')
    machine, states = GrammarMachine(grammar), []
    for _ in range(2):
        machine._steps.clear()  # the memo starts over: the second walk builds its states anew
        state = machine.start
        for ch in "1+(" * 30:
            state = machine.step(state, ord(ch))
        states.append(state)
    first, second = states
    assert first == second
    assert {id(link) for _, links in first for link in links} == {id(link) for _, links in second for link in links}
    assert GrammarMachine(grammar).key != machine.key  # another machine's states are never looked up as these
