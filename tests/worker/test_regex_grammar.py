"""Regular expressions held while sampling (regex_dfa.py, regex_grammar.py): the DFA takes exactly the texts
Python's `re` does (fullmatch for guided_regex, search for a schema's pattern), every state a byte walk
reaches can still match, a schema's `pattern` reads JSON escapes, and the guide lets a stop token end a
text that matches but could go on."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from lorafleet.worker.json_schema import SchemaError, compile_schema
from lorafleet.worker.json_schema_grammar import DONE as SCHEMA_DONE
from lorafleet.worker.json_schema_grammar import schema_grammar
from lorafleet.worker.regex_dfa import Regex, RegexError
from lorafleet.worker.regex_grammar import DONE, RegexGrammar
from tests.worker.grammar_checks import check_masks, check_text, walks_validate

PATTERNS = [r"^[0-9]{3}-[a-c]+$", r"(ab|a)*b?", r"a{2,4}", r"^(?:a|b)+_\d*$|^-", r"[^a\n]+", r"\w+\s?\.", r"é+b",
            r"a.b", r"(a|)", r"x{0}a", "", r"[-a]", r"[a-]b", r"a+?b", r"(?<n>ab)+", r"\x61\u0062", r"[\d_]{2}",
            r"[^\W\d]", r"a|b|", r"(a{1,2}){2}", r"\.\-\(", r"a{2}{", r"[a-c0]*$", r"^a*"]
ALPHABET = "ab01 -_\n.é{},"


def _python(pattern: str) -> re.Pattern:
    """The pattern for Python's re: ASCII classes and `$` only at the very end (as ECMAScript reads them)."""
    pattern = re.sub(r"\$(?=\||$)", r"\\Z", pattern).replace("(?<", "(?P<").replace("}{", "}\\{")
    return re.compile(pattern, re.ASCII)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_dfa_takes_the_texts_pythons_re_does(pattern):
    full, search, ref = Regex(pattern), Regex(pattern, search=True), _python(pattern)
    for n in range(5):
        for chars in itertools.product(ALPHABET, repeat=n) if n < 4 else (random.Random(n).choices(ALPHABET, k=6)
                                                                           for _ in range(3000)):
            text = "".join(chars)
            assert full.matches(text) is bool(ref.fullmatch(text)), (pattern, text)
            assert search.matches(text) is bool(ref.search(text)), (pattern, text)


@pytest.mark.parametrize("pattern, needle", [
    ("(a", "a missing ')'"), ("a)", "an unmatched ')'"), ("[a", "an unterminated character class"),
    (r"(a)\1", "the escape '\\1' is not supported"), (r"\bword", "the escape '\\b' is not supported"),
    ("(?=a)b", "lookaround"), ("a^b", "'^' inside the pattern"), ("*a", "nothing to repeat"),
    ("a{3,1}", "out of order"), ("[z-a]", "out of order"), ("(a{100}){100}", "too large"), ("\\", "ending in"),
    (r"\u12", "malformed"), ("[\ud800-\udfff]", "matches no text"),
    ("(?:){99999999999}", "a counted repeat above 1000"), ("((?:){1000}){1000}", "too large"),
    ("(" * 100 + ")" * 100, "groups nested deeper than 64"), (r"\x+1", "malformed"), (r"\u{ 41}", "malformed"),
    ("[]a]", "matches no text"),  # ECMAScript: [] takes nothing
    ("a**", "nothing to repeat (a quantifier right after another)"), ("x{3}{2}", "right after another"),
    ("a{2}*", "right after another"), ("a*?+", "right after another"), ("a???", "right after another"),
])
def test_patterns_that_cannot_be_held_are_refused_naming_why(pattern, needle):
    with pytest.raises(RegexError, match=re.escape(needle)):
        Regex(pattern)


def test_ecmascript_readings_of_edge_cases():
    assert Regex("a*?").matches("aaa") and Regex("a{2}?b").matches("aab")  # lazy: one quantifier, the same texts
    assert Regex("a*{").matches("aa{") and Regex("a{2}{x").matches("aa{x")  # '{' opening no bound: a literal
    assert Regex("a{²}").matches("a{²}") and not Regex("a{²}").matches("aa")  # not a quantifier: literal text
    assert Regex("[^]").matches("\n") and Regex("[^]{2}").matches("é\n")  # [^] takes any character
    assert Regex(r"\u{1F600}").matches("\U0001F600")


def test_a_pattern_keeping_too_many_positions_open_fails_its_request_not_the_worker():
    """.*a.{300}: after n a's, n positions are open; each step would cost that much. Past MAX_OPEN the grammar
    raises (the sampler ends that request only) instead of slowing every step and growing its memo."""
    from lorafleet.worker.regex_dfa import MAX_OPEN

    grammar = RegexGrammar(".*a.{300}")
    state = grammar.advance(grammar.start, b"a" * (MAX_OPEN - 10))
    assert state is not None
    with pytest.raises(RegexError, match=f"over {MAX_OPEN} positions open"):
        grammar.advance(state, b"a" * 20)


def test_a_mask_walk_past_its_time_budget_fails_its_request(monkeypatch):
    from lorafleet.worker import regex_vocab
    from lorafleet.worker.json_vocab import JsonVocab

    vocab = JsonVocab(["".join(t).encode() for t in itertools.product("abcdefgh", repeat=4)])  # 4096 class paths
    monkeypatch.setattr(regex_vocab, "MAX_MASK_SECONDS", -1.0)
    grammar = RegexGrammar("(a|b|c|d|e|f|g|h)+")
    with pytest.raises(RegexError, match="costs over -1 s of a step"):
        vocab.mask(grammar.start, True, grammar)


def test_a_union_of_patterned_strings_scanned_past_its_time_budget_fails_its_request(monkeypatch):
    """A union of patterned strings has no one regex to walk: its mask is scanned token by token through every
    branch. That scan had no budget: 64 branches of open-ended patterns took a minute a mask on a 49k
    vocabulary, every tenant's step waiting. Past MAX_SCAN_SECONDS the request's mask raises (the sampler ends
    that request only)."""
    import time

    from lorafleet.worker import json_vocab
    from lorafleet.worker.json_vocab import JsonVocab

    schema = {"anyOf": [{"type": "string", "pattern": f"^[^Z]*[a-m][^Z]{{{20 + i}}}$"} for i in range(16)]}
    grammar = schema_grammar(schema, False)
    state = grammar.advance(grammar.start, b'"')
    assert grammar.regex_reading(state) is None  # a union: scanned, not walked
    vocab = JsonVocab(["".join(t).encode() for t in itertools.product("abcxyzZ", repeat=4)])  # 2401 tokens
    assert vocab.mask(state, True, grammar)[1] > 0  # within the budget: a mask
    monkeypatch.setattr(json_vocab, "MAX_SCAN_SECONDS", 0.001)
    state = grammar.advance(state, b"ab")
    start = time.perf_counter()
    with pytest.raises(RegexError, match="costs over 0.001 s of a step"):
        vocab.mask(state, True, grammar)
    assert time.perf_counter() - start < 1.0  # refused near its budget, not after the whole scan


def test_a_mask_walk_whose_nodes_cost_grammar_closures_is_refused_near_its_budget(monkeypatch):
    """The deadline was looked at every 1,024 trie nodes; a node of a 130-alternative nested grammar costs a
    closure, so a mask took 3.5 s to be refused at a 0.5 s budget (every tenant's step stalled meanwhile), and
    walks of fewer nodes were never timed at all. It is looked at every 32 nodes now."""
    import string
    import time

    from lorafleet.worker import regex_vocab
    from lorafleet.worker.gbnf import GbnfGrammar
    from lorafleet.worker.json_vocab import JsonVocab

    letters = string.ascii_letters + string.digits
    grammar = GbnfGrammar("root ::= e\ne ::= " + " | ".join(f'"(" e "{c}"' for c in letters) + ' | "x"\n')
    # 584 trie nodes: under 1,024, so such a walk was never timed at all, however long its nodes took
    vocab = JsonVocab(["".join(t).encode() for t in itertools.product("(x" + letters[:6], repeat=3)])
    monkeypatch.setattr(regex_vocab, "MAX_MASK_SECONDS", 0.001)
    state = grammar.start
    for _ in range(30):  # deeper and deeper: each mask costs more
        start = time.perf_counter()
        try:
            vocab.mask(state, True, grammar)
        except RegexError:
            assert time.perf_counter() - start < 1.0
            return
        state = grammar.advance(state, b"(")
    raise AssertionError("no mask was refused")


def _walk_bytes(grammar: RegexGrammar, rng: random.Random, stop: float = 0.15) -> str:
    """Random bytes the grammar takes until it is done or may stop (then stops with probability `stop`)."""
    state, out = grammar.start, bytearray()
    for _ in range(60):
        if state == DONE or grammar.may_stop(state) and rng.random() < stop:
            return out.decode()
        allowed = [b for b in range(256) if grammar.advance(state, bytes((b,))) is not None]
        assert allowed, bytes(out)  # a state reached always goes on
        out.append(rng.choice(allowed))
        state = grammar.advance(state, out[-1:])
    return ""


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-c]+", r"(yes|no)( indeed)?", r"é[^a-z.]{1,3}\.", r"\d{1,3}(,\d{3})*",
                                     r"[\u00e0-\u00ff\u{1F600}]{2}"])
def test_byte_walks_end_in_texts_that_match_and_utf8_is_whole(pattern):
    grammar, rng = RegexGrammar(pattern), random.Random(1)
    ref = re.compile(pattern.replace(r"\u{1F600}", "\U0001F600"))
    texts = [_walk_bytes(grammar, rng) for _ in range(60)]
    assert sum(bool(t) for t in texts) >= 20
    for text in filter(None, texts):
        assert ref.fullmatch(text), (pattern, text)


def test_done_and_may_stop():
    grammar = RegexGrammar(r"(yes|no)( indeed)?")
    yes = grammar.advance(grammar.start, b"yes")
    assert yes != DONE and grammar.may_stop(yes) and not grammar.may_stop(grammar.start)
    assert grammar.advance(yes, b" indeed") == DONE and grammar.advance(yes, b" indeed!") is None
    assert grammar.advance(DONE, b"") == DONE and grammar.advance(yes, b" in") != DONE
    assert RegexGrammar("").start == DONE


def test_the_guide_lets_a_stop_token_end_a_matching_text_that_could_go_on():
    from lorafleet.worker.json_guide import JsonGuide
    from lorafleet.worker.json_vocab import JsonVocab
    from lorafleet.worker.sampling_params import SamplingParams
    from lorafleet.worker.sequence import Sequence

    pieces = ["1", "23", "a", "1a", " ", "4,", "567"]
    vocab = JsonVocab([p.encode() for p in pieces] + [None])
    eos = len(pieces)
    guide = JsonGuide(lambda: vocab, eos_token_ids=[eos])
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=8, grammar=RegexGrammar(r"\d{1,3}(,\d{3})*")))
    allowed = (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist()
    assert allowed == [0, 1, 5, 6] and not guide.accepts(seq, eos)  # nothing written: no match yet
    seq.output_token_ids.append(0)  # "1"
    allowed = (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist()
    assert allowed == [0, 1, 5, eos] and guide.accepts(seq, eos)
    seq.output_token_ids.append(5)  # "14,"
    assert (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist() == [0, 1, 6] and not guide.accepts(seq, eos)


PATTERNED = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]?$"},
    "email": {"type": "string", "pattern": "@"},
    "line": {"type": "string", "pattern": "^a\\nb$"},
    "tag": {"enum": ["abc", "xyz", "a@b", "\u0001@"], "pattern": "@"},
}, "required": ["code"]}


@pytest.mark.parametrize("text, ok", [
    ('{"code":"ABC"}', True), ('{"code":"ABC1"}', True), ('{"code":"AB"}', False), ('{"code":"ABCD"}', False),
    ('{"code":"ABC","email":"x@y"}', True), ('{"code":"ABC","email":"@"}', True), ('{"code":"ABC","email":"xy"}', False),
    ('{"code":"ABC","line":"a\\nb"}', True),  # the escape is the character the pattern reads
    ('{"code":"ABC","line":"a\\u000ab"}', False),  # \\u escapes are not taken under a pattern
    ('{"code":"\\u0041BC"}', False), ('{"code":"ABC","tag":"a@b"}', True), ('{"code":"ABC","tag":"abc"}', False),
    ('{"code":"ABC","tag":"\\u0001@"}', True),  # an enum value is written from its encoding, control characters too
])
def test_a_schemas_pattern_is_searched_in_the_strings_text(text, ok):
    check_text(PATTERNED, text, ok)


def test_random_walks_under_patterns_give_values_the_reference_validator_takes():
    walks_validate(PATTERNED, seed=2, tries=30, at_least=5, max_bytes=900)
    grammar = schema_grammar(PATTERNED)
    assert grammar.advance(grammar.start, b'{"code":"ABC"}') == SCHEMA_DONE


@pytest.mark.parametrize("schema, needle", [
    ({"type": "string", "pattern": "(a"}, "#.pattern: a missing ')'"),
    ({"type": "string", "pattern": 5}, "#.pattern: a pattern must be a string"),
    ({"type": "string", "pattern": "a.{0,300}b", "enum": ["a" * 300 + "b"]}, "#.pattern: the pattern keeps over"),
])
def test_patterns_a_schema_cannot_hold_are_refused(schema, needle):
    with pytest.raises(SchemaError, match=re.escape(needle)):
        compile_schema(schema)


@pytest.mark.parametrize("grammar", [RegexGrammar(r"[0-9]{1,3}(-[a-c]+)?é?"), RegexGrammar(r"(\"q\"|[^a]\n)*x"),
                                     schema_grammar(PATTERNED), schema_grammar({"pattern": r"^[a-z\\]+$"})],
                         ids=["digits", "quotes", "schema", "escapes"])  # `\n` is a newline to a pattern, not 'n'
def test_regex_masks_through_the_class_trie_equal_a_token_by_token_check(grammar):
    from lorafleet.worker.json_vocab import JsonVocab

    pieces = ["1", "12", "123", "1234", "-", "-a", "-ab", "a", "bc", "é", "\xc3", "\xa9", "x", "\"", "\"q\"", "\n",
              "b\n", "\\n", "\\\"", "AB", "ABC", "C1", "\"}", "@", "x@y", "\"code\":\"", "{\"", "\":\"", " ", "ab\"q"]
    tokens = [p.encode("latin-1") if p in ("\xc3", "\xa9") else p.encode() for p in pieces]
    assert check_masks(JsonVocab([*tokens, None]), grammar, random.Random(6), walks=10, steps=25) > 60


def _nested_object(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_inputs_nesting_past_the_interpreters_stack_are_refused_as_the_requests_fault():
    """Stacked quantifiers, chains of rules and deep schemas each recurse once per level: a RecursionError
    from a crafted input is the request's error (a 400 naming it), never the worker's (a 500)."""
    import sys

    from lorafleet.worker.gbnf import GbnfGrammar

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default; a test run before may have raised it (hypothesis does)
    try:
        _refused_past_the_stack(GbnfGrammar)
    finally:
        sys.setrecursionlimit(limit)


def _refused_past_the_stack(GbnfGrammar) -> None:
    for pattern in ("a" + "{1}" * 1300, "a" + "*" * 1500):  # refused at the second quantifier now, as ECMAScript
        with pytest.raises(RegexError, match="right after another"):
            RegexGrammar(pattern)
        with pytest.raises(SchemaError, match="right after another"):
            schema_grammar({"type": "string", "pattern": pattern})
    chain = "root::=a0\n" + "".join(f'a{i}::=a{i + 1} "x"\n' for i in range(500)) + 'a500::="z"\n'
    for grammar in ('root ::= "a"' + "{1}" * 3000, chain):
        with pytest.raises(RegexError, match="nests too deeply"):
            GbnfGrammar(grammar)
    with pytest.raises(SchemaError, match="nests"):
        schema_grammar(_nested_object(480))
    with pytest.raises(SchemaError, match="nests"):
        schema_grammar(_nested_object(5000))


def test_a_grammars_pattern_tries_are_built_before_its_request_joins_the_batch(monkeypatch):
    """A new pattern's class trie walks the whole vocabulary (0.1-0.2 s at 49k tokens): JsonVocab.prepare builds
    it in the request's thread (AsyncEngine._prepare), so the engine step's mask finds it built."""
    import lorafleet.worker.json_vocab as json_vocab
    from lorafleet.worker.json_vocab import JsonVocab

    built = []
    real = json_vocab.ClassTrie
    monkeypatch.setattr(json_vocab, "ClassTrie", lambda *a: built.append(1) or real(*a))
    vocab = JsonVocab([b"a", b"ab", b"b", b"c", b"{", b"}", b'"', b":"])
    regex = RegexGrammar("a+b")
    schema = schema_grammar({"type": "object", "properties": {"s": {"type": "string", "pattern": "^c+$"}}})
    for grammar in (regex, schema):
        vocab.prepare(grammar)
    assert len(built) == 2
    invalid, _ = vocab.mask(regex.start, True, regex)
    assert len(built) == 2 and not invalid[0] and invalid[2]  # "a" may begin, "b" may not
