"""The keys an object schema takes besides the properties it lists, and the schema of each key's value:
`additionalProperties`, `patternProperties` and `propertyNames`, compiled for json_schema.py.

pydantic writes `dict[SomeEnum, V]` and `dict[Literal["a", "b"], V]` as `propertyNames` holding an enum (or a
$ref to one) beside `additionalProperties: V`, and `dict[Annotated[str, Field(pattern=P, max_length=n)], V]`
as `patternProperties: {P: V}` beside `propertyNames: {"maxLength": n}`. As JSON Schema reads them:
* `propertyNames` holds every key, listed or not: a listed property whose name it refuses is dropped (an
  error where that property is required);
* a key a pattern of `patternProperties` matches takes a value its schema describes, a listed key too (both
  schemas then hold: refused unless they are the same); a key neither listed nor matched takes
  `additionalProperties`;
* where the schema is silent, an object that lists properties or patterns takes no other key (json_schema.py's
  strict reading).

Held so: an enum's key names become listed properties, each with the value its pattern or
additionalProperties gives, so each is written at most once. Other keys are read through one regex, the key
language (the union of the patterns, or any text where additionalProperties takes the rest, held to
propertyNames' pattern or lengths), so every key begun can end as one the object takes; its value's schema is
chosen as it closes. Refused, with the keyword named: two patterns with different schemas that one key may
match (its value would have to fit both, an allOf this grammar cannot hold), propertyNames' own pattern beside
patternProperties with no additionalProperties (the keys would be the texts both take), a union of key
schemas, object sizes the keys the object can take cannot reach, and more than MAX_PATTERNS patterns in an
object (or, in all of a schema, more than MAX_PAIRS steps of the checks that patterns stay apart).

Patterns are read as ECMA-262, JSON Schema's dialect: `$` is the end of the text, and `\\d`, `\\w` are ASCII. A
validator built on Python's `re` reads `$` as also matching before a final newline and `\\d`, `\\w`, `\\s` over
Unicode: where patternProperties sits beside additionalProperties, it may give a key such as "a\\n" or "٣" another
pattern's schema than this grammar did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lorafleet.worker.json_schema_bounds import BoundsError, encode, value_fits
from lorafleet.worker.regex_dfa import Regex, RegexError
from lorafleet.worker.regex_grammar import JSON_TEXT, compile_pattern
from lorafleet.worker.regex_length import NoText, length_regex

MAX_OTHER_KEYS = 1024  # keys of an object besides its listed properties
MAX_PATTERNS = 16  # patternProperties of one object
MAX_PAIRS = 20_000  # state pairs the checks that two patterns never match one key may visit, in all of a schema
MAX_COUNTED = 4096  # states a count of the key language's texts may visit
MAX_COUNT_DEPTH = 256  # characters deep that count may go


@dataclass(frozen=True, slots=True)
class Keys:
    listed: tuple[tuple[str, int], ...]  # (name, value node) of the properties written by name
    required: tuple[str, ...] = ()  # names of listed properties that must be written
    additional: int | None = None  # the value node of another key no pattern matches; None: no such key
    patterns: tuple[tuple[Regex, int], ...] = ()  # (pattern, value node) of the other keys it matches
    language: Any = None  # the Regex or LengthRegex other keys are read through; None: any text

    @property
    def others(self) -> bool:
        """Whether a key other than the listed ones may be written."""
        return self.additional is not None or bool(self.patterns)


def object_keys(schema, s: dict, where: str, depth: int) -> Keys:
    """The keys of the object schema `s` (compiling its property, pattern and additional schemas into nodes of
    the JsonSchema `schema`); BoundsError, its message led by the keyword, where they cannot be held."""
    props, required = s.get("properties", {}), s.get("required", [])
    if not isinstance(props, dict):
        raise BoundsError("properties must be an object of schemas")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise BoundsError("required must be a list of property names")
    if missing := [r for r in required if r not in props]:
        raise BoundsError(f"required names {', '.join(missing)}, which properties does not describe")
    extra = s.get("additionalProperties", not {"properties", "patternProperties"} & set(s))
    additional = None if extra is False else schema._node(extra, f"{where}.additionalProperties", depth + 1)
    patterns = _patterns(schema, s, where, depth)
    names = _names_node(schema, s, where, depth)
    listed = []
    for name, sub in props.items():
        if names is not None and not _name_fits(names, name):
            if name in required:
                raise BoundsError(f"required: {name!r} is required, and propertyNames does not take it")
            continue
        own = _canonical(sub)
        for text, _, canon, regex in patterns:
            if canon != own and regex.matches(name):
                raise BoundsError(f"properties.{name}: its name matches patternProperties {text!r} too, whose schema "
                                  "differs; its value would have to fit both, which cannot be held while sampling "
                                  "(give both the same schema)")
        listed.append((name, schema._node(sub, f"{where}.properties.{name}", depth + 1)))
    if names is not None and names.enum is not None:  # the keys are the enum's strings
        taken = {name for name, _ in listed}
        for key in (json.loads(e) for e in names.enum):
            if isinstance(key, str) and key not in taken and (value := _value_of(key, patterns, additional)) is not None:
                listed.append((key, value))
        return Keys(tuple(listed), tuple(required))
    if names is not None and "string" not in names.types or additional is None and not patterns:
        return Keys(tuple(listed), tuple(required))
    _check_apart(schema, patterns)
    try:
        language = _language(names, patterns, additional)
    except NoText:  # no key of propertyNames' lengths matches a pattern
        return Keys(tuple(listed), tuple(required), additional)
    except RegexError as exc:
        raise BoundsError(f"patternProperties: {exc}") from None
    return Keys(tuple(listed), tuple(required), additional,
                tuple((regex, node) for _, node, _, regex in patterns), language)


def value_of(node, key: str) -> int | None:
    """The value node of another key `key` of the object `node` (a Node with Keys' fields)."""
    for pattern, value in node.patterns:
        if pattern.matches(key):
            return value
    return node.additional


def most_keys(keys: Keys, lo: int, hi: int | None) -> tuple[int | None, int | None]:
    """(maxProperties as held, the most keys the grammar writes) for minProperties `lo` and maxProperties `hi`.
    An object that takes other keys counts them by name, so that none is written twice (a small model may loop
    on one), and writes at most MAX_OTHER_KEYS of them (None: not counted, duplicates let be, where the key
    language is too large to count and no size is asked). Where the texts its key language takes besides the
    listed names run out first, maxProperties is no more than the keys there are (so no comma is left with no
    key to follow it). BoundsError where minProperties cannot be reached, or asked sizes cannot be checked."""
    if not keys.others:
        return hi, None
    cap = max(lo, len(keys.listed) + MAX_OTHER_KEYS)
    if keys.language is None:
        return hi, cap
    need = max(lo, hi or 0, MAX_OTHER_KEYS) + 1
    listed = sum(1 for name, _ in keys.listed if keys.language.matches(name))
    total = count_texts(keys.language, need + listed)
    if total is None:
        if lo or hi is not None:
            raise BoundsError("minProperties/maxProperties beside the keys its patterns take cannot be checked (too "
                              "many states to count); drop the sizes or simplify the key patterns")
        return hi, None
    most = len(keys.listed) + total - listed
    if total - listed >= need:
        return hi, cap
    if lo > most:
        raise BoundsError(f"minProperties {lo}, where the object takes {most} keys at most (its listed properties and "
                          "the keys its patterns take)")
    return (most if hi is None else min(hi, most)), min(cap, most)


def count_texts(language, limit: int, start=None) -> int | None:
    """How many texts a Regex or LengthRegex takes (from its state `start`, by default its start), counted up to
    `limit` (None: past MAX_COUNTED states or MAX_COUNT_DEPTH characters before reaching it). A loop among
    live states takes texts without end."""
    memo: dict = {}
    path: set = set()

    def count(state, deep: int) -> int:
        if state in path:
            return limit
        hit = memo.get(state)
        if hit is not None:
            return hit
        if len(memo) >= MAX_COUNTED or deep > MAX_COUNT_DEPTH:
            raise _TooMany
        total = 1 if language.accepts(state) else 0
        points = sorted(language.cuts(state))
        steps = [(nxt - lo, after) for lo, nxt in zip(points, points[1:], strict=False)
                 if (after := language.step(state, lo)) is not None]
        if total + sum(width for width, _ in steps) >= limit:  # each live state takes a text at least
            memo[state] = limit
            return limit
        path.add(state)
        for width, after in steps:
            if total >= limit:
                break
            total += width * count(after, deep + 1)
        path.discard(state)
        memo[state] = total = min(total, limit)
        return total

    try:
        return count(language.start if start is None else start, 0)
    except (_TooMany, RegexError):
        return None


class _TooMany(Exception):
    pass


def _patterns(schema, s: dict, where: str, depth: int) -> list[tuple[str, int, str, Regex]]:
    """(pattern, value node, the value schema's canonical text, its Regex) of each of patternProperties."""
    pattern_props = s.get("patternProperties", {})
    if not isinstance(pattern_props, dict):
        raise BoundsError("patternProperties must be an object of schemas, by pattern")
    if len(pattern_props) > MAX_PATTERNS:
        raise BoundsError(f"patternProperties: more than {MAX_PATTERNS} patterns in one object")
    out = []
    for text, sub in pattern_props.items():
        try:
            regex = Regex(text, search=True)  # its own: a schema's many patterns would churn compile_pattern's cache
        except RegexError as exc:
            raise BoundsError(f"patternProperties: {text!r}: {exc}") from None
        out.append((text, schema._node(sub, f"{where}.patternProperties.{text}", depth + 1), _canonical(sub), regex))
    return out


def _names_node(schema, s: dict, where: str, depth: int):
    """The Node of propertyNames (None where there is none): one schema, no union."""
    if "propertyNames" not in s:
        return None
    index = schema._node(s["propertyNames"], f"{where}.propertyNames", depth + 1)
    try:
        alternatives = schema.alternatives(index)
    except AttributeError:  # a node still being compiled: the key schema refers back to this object
        raise BoundsError("propertyNames refers back to the object whose keys it names") from None
    if len(alternatives) != 1:
        raise BoundsError("propertyNames: a union of key schemas (anyOf, oneOf) is not supported; give one schema: "
                          "an enum, or a string's pattern, format and lengths")
    return schema.nodes[alternatives[0]]


def _name_fits(names, name: str) -> bool:
    if names.enum is not None:
        return encode(name) in names.enum
    return "string" in names.types and value_fits(name, {}, names)


def _value_of(key: str, patterns: list[tuple[str, int, str, Regex]], additional: int | None) -> int | None:
    """The value node of an enum's key name: its patterns' (refused where two differ), else additional's."""
    matched = {canon: node for _, node, canon, regex in patterns if regex.matches(key)}
    if len(matched) > 1:
        raise BoundsError(f"patternProperties: the key {key!r} propertyNames takes matches patterns with different "
                          "schemas; its value would have to fit all of them, which cannot be held while sampling")
    return next(iter(matched.values()), additional)


def _check_apart(schema, patterns: list[tuple[str, int, str, Regex]]) -> None:
    for i, (a, _, canon_a, regex_a) in enumerate(patterns):
        for b, _, canon_b, regex_b in patterns[i + 1:]:
            if canon_a != canon_b and _may_meet(schema, regex_a, regex_b):
                raise BoundsError(f"patternProperties: {a!r} and {b!r} may both match one key, and their schemas "
                                  "differ; its value would have to fit both, which cannot be held while sampling "
                                  "(anchor the patterns apart, or give them one schema)")


def _may_meet(schema, a: Regex, b: Regex) -> bool:
    """Whether some text matches both patterns: their DFAs walked in step, the pairs visited counted against the
    schema's MAX_PAIRS (BoundsError past it)."""
    start = (a.start, b.start)
    todo, seen = [start], {start}
    while todo:
        x, y = todo.pop()
        if a.accepts(x) and b.accepts(y):
            return True
        points = sorted(a.cuts(x) | b.cuts(y))
        for lo, _ in zip(points, points[1:], strict=False):
            nx = a.step(x, lo)
            ny = None if nx is None else b.step(y, lo)
            if ny is not None and (nx, ny) not in seen:
                schema._key_pairs = getattr(schema, "_key_pairs", 0) + 1
                if schema._key_pairs > MAX_PAIRS:
                    raise BoundsError("patternProperties: the patterns are too many or too large to check that no key "
                                      "matches two of them with different schemas")
                seen.add((nx, ny))
                todo.append((nx, ny))
    return False


def _language(names, patterns: list[tuple[str, int, str, Regex]], additional: int | None):
    """The Regex (or LengthRegex) another key is read through; None: any text (NoText: none)."""
    pattern = None if names is None else names.pattern  # propertyNames' pattern or format, held to its lengths
    low, high = (0, None) if names is None else (names.min_len, names.max_len)
    bounded = low > 0 or high is not None
    if additional is not None:
        if pattern is not None or not bounded:
            return pattern
        return length_regex(compile_pattern("", True, True), low, high)
    if pattern is not None:
        raise BoundsError("propertyNames: a pattern or format beside patternProperties, with no additionalProperties, "
                          "cannot be held: the keys would be the texts both take (put the pattern in patternProperties)")
    union = Regex(tuple(text for text, _, _, _ in patterns), search=True, writable=JSON_TEXT)
    return length_regex(union, low, high) if bounded else union


def _canonical(sub: Any) -> str:
    return json.dumps(sub, sort_keys=True, separators=(",", ":"))
