"""Checks of a compiled schema's nodes as a whole (json_schema.py): every node takes a finite value, and
`oneOf` is held as `anyOf` where no value can match two of its alternatives.

"Exactly one alternative matches" cannot be checked while sampling, but it needs no check where the
alternatives are disjoint: then a value one of them takes matches no other. Two alternatives are taken as
disjoint when their kinds of value do not meet (an integer is a number), when both are enums with no value in
common (compared as JSON values: 1 and 1.0 are one value, true and 1 are not), or when both are objects that
require a property whose values are enums with none in common: the tagged unions pydantic writes for a
discriminated union (`Field(discriminator=...)`, `{"oneOf": [...], "discriminator": {...}}`). Anything else is
refused, as the grammar could write a value two alternatives take.
"""

from __future__ import annotations

import functools
import json

from lorafleet.worker.json_schema_bounds import TYPES, kind, same_key

MAX_ONE_OF_PAIRS = 50_000  # distinct pairs of alternatives a schema's oneOfs may ask to compare (one compile)
MAX_ONE_OF_WALK = 20 * MAX_ONE_OF_PAIRS  # pairs looked up, compared before or not (a lookup costs little)


class TooManyPairs(Exception):
    pass


def one_of_problem(schema, one_ofs: list[tuple[str, tuple[int, ...]]]) -> str | None:
    """Why the schema's oneOfs (where, alternatives) cannot be held, or None. A union used in several places
    (the same alternatives: pydantic's $refs to $defs) is checked once, and each pair of alternatives once;
    past MAX_ONE_OF_PAIRS distinct pairs the schema is refused."""
    checked: dict[tuple[int, int], bool] = {}
    done: set[tuple[tuple[int, ...], ...]] = set()
    walked = 0
    for where, parts in one_ofs:
        alts = tuple(tuple(schema.alternatives(p)) for p in parts)
        if alts in done:
            continue
        done.add(alts)
        sizes = [len(a) for a in alts]
        walked += (sum(sizes) ** 2 - sum(n * n for n in sizes)) // 2
        too_many = (f"{where}.oneOf: the schema's oneOf alternatives are too many to check that no value matches "
                    f"two (over {MAX_ONE_OF_PAIRS} pairs); use anyOf")
        if walked > MAX_ONE_OF_WALK:  # unions of the same alternatives in other orders, many times over
            return too_many
        try:
            overlap = one_of_overlap(schema, alts, checked)
        except TooManyPairs:
            return too_many
        if overlap is not None:
            return (f"{where}.oneOf: {overlap}, and exactly one must match, which cannot be held while sampling; "
                    "make them disjoint (e.g. a required property with a different const in each) or use anyOf")
    return None


def one_of_overlap(schema, alts: tuple[tuple[int, ...], ...], checked: dict[tuple[int, int], bool]) -> str | None:
    """None where the alternatives (each expanded into nodes of the JsonSchema `schema`) are disjoint; else
    which two may meet. `checked`: pairs of nodes compared before (TooManyPairs past MAX_ONE_OF_PAIRS)."""
    for i in range(len(alts)):
        for j in range(i + 1, len(alts)):
            for a in alts[i]:
                for b in alts[j]:
                    key = (a, b) if a <= b else (b, a)
                    apart = checked.get(key)
                    if apart is None:
                        if len(checked) >= MAX_ONE_OF_PAIRS:
                            raise TooManyPairs
                        apart = checked[key] = _disjoint(schema, a, b)
                    if not apart:
                        return f"alternatives {i} and {j} may both take one value"
    return None


def _disjoint(schema, a: int, b: int) -> bool:
    na, nb = schema.nodes[a], schema.nodes[b]
    if a == b:
        return False
    if na.enum is not None and nb.enum is not None:
        return not (_values(na.enum) & _values(nb.enum))
    shared = _kinds(na) & _kinds(nb)
    if not shared:
        return True
    return shared == {"object"} and na.enum is None and nb.enum is None and _tagged_apart(schema, na, nb)


def _kinds(node) -> frozenset[str] | set[str]:
    """The kinds of value a validator may find the node taking: an enum's, else its types; every kind where the
    types were inferred from keywords with no `type` (`{"properties": ...}` takes a string too)."""
    if node.enum is not None:
        return _enum_kinds(node.enum)
    kinds = set(TYPES) if node.untyped else set(node.types)
    return {"number" if k == "integer" else k for k in kinds}


@functools.lru_cache(maxsize=4096)
def _enum_kinds(enum: tuple[bytes, ...]) -> frozenset[str]:
    return frozenset("number" if k == "integer" else k for k in (kind(json.loads(e)) for e in enum))


@functools.lru_cache(maxsize=4096)  # each alternative's, once, not once per pair
def _values(enum: tuple[bytes, ...]) -> frozenset:
    """Enum values as JSON compares them (_same)."""
    return frozenset(same_key(json.loads(e)) for e in enum)


def _tagged_apart(schema, na, nb) -> bool:
    """Whether both objects require a property whose enum values do not meet."""
    for name, i in na.names.items():
        j = nb.names.get(name)
        if j is None or i not in na.required or j not in nb.required:
            continue
        va, vb = _property_values(schema, na.props[i][1]), _property_values(schema, nb.props[j][1])
        if va is not None and vb is not None and not (va & vb):
            return True
    return False


def _property_values(schema, index: int) -> set | None:
    """The values a property may take, where every alternative of it is an enum (None otherwise)."""
    values: set[tuple] = set()
    for a in schema.alternatives(index):
        enum = schema.nodes[a].enum
        if enum is None:
            return None
        values |= _values(enum)
    return values


def all_finite(schema) -> bool:
    """Whether every node takes some finite value (else a value entering it could never end): a fixpoint from the
    scalars up through objects (every required property finite, and enough others for minProperties), arrays
    (the items minItems needs finite) and unions (one finite alternative)."""
    finite: set[int] = set()
    changed = True
    while changed:
        changed = False
        for i, node in enumerate(schema.nodes):
            if i in finite:
                continue
            if node.any_of:
                ok = any(a in finite for a in schema.alternatives(i))
            else:
                ok = node.enum is not None or bool(node.types - {"object", "array"}) \
                    or ("object" in node.types and all(node.props[r][1] in finite for r in node.required)
                        and _enough_keys(node, finite)) \
                    or ("array" in node.types and all(schema.item(node, k) in finite
                                                      for k in range(min(node.min_items, len(node.prefix) + 1))))
            if ok:
                finite.add(i)
                changed = True
    return len(finite) == len(schema.nodes)


def _enough_keys(node, finite: set[int]) -> bool:
    """Whether an object can reach minProperties with finite values beyond its required ones."""
    need = node.min_props - len(node.required)
    optional = sum(1 for i, (_, value) in enumerate(node.props) if i not in node.required and value in finite)
    return need <= optional or node.additional in finite or any(value in finite for _, value in node.patterns)


MANY = 1024  # unique_items: the items take values without end, of which an array holds at most this many


def unique_items(schema, node) -> int | str:
    """uniqueItems: how many distinct items the array `node` may hold, where its items are enum or const values
    (pydantic's set of an Enum or a Literal: each value written is then kept from the items after it), or MANY
    where they are strings and numbers free of patterns, lengths and bounds (a set of str, int or float: each
    may always grow into a value not written yet); else why it cannot be held."""
    if node.prefix:
        return "uniqueItems beside prefixItems cannot be held while sampling"
    items = [schema.nodes[a] for a in schema.alternatives(node.items)]
    if all(_free(item) for item in items):
        if node.min_items > MANY:
            return f"uniqueItems with minItems {node.min_items}: an array of such items holds at most {MANY}"
        return MANY
    values: dict = {}
    for item in items:
        enum = item.enum
        if enum is None:
            return ("uniqueItems is held where the items are enum or const values (an Enum or a Literal), or strings "
                    "and numbers with no pattern, length or bound (a set of str, int or float), which a sampler "
                    "can keep apart; this array's items take other values")
        for e in enum:
            if values.setdefault(same_key(json.loads(e)), e) != e:
                return f"uniqueItems over {values[same_key(json.loads(e))]!r} and {e!r}, one value written two ways"
    if len(values) < node.min_items:
        return f"uniqueItems with minItems {node.min_items}, where the items take {len(values)} distinct values"
    return len(values)


def _free(node) -> bool:
    """A string or number node with no enum, pattern, length or bound (an item that can always grow)."""
    return node.enum is None and bool(node.types) and node.types <= {"string", "integer", "number"} \
        and node.pattern is None and node.min_len == 0 and node.max_len is None and node.bounds is None
