"""Whether a parsed JSON value is one a compiled schema (json_schema.py) takes, as JSON Schema reads it: the
check of a strict function's arguments that a model wrote freely (tool_choice "auto", tool_calls.py).

The sampling grammar (json_schema_grammar.py) holds text to forms that keep every state able to go on: a
bounded number or a set's number item has no exponent, and a set's number item at most 15 significant
digits. Those are forms of writing, not of the value: `1e-07` is a number a schema with `minimum: 0` takes,
and reading parsed values here takes it too. A number meets bounds as the decimal it is written as (0.1 is
one tenth, as the grammar reads bounds), `1.0` is an integer, enum values and uniqueItems compare as JSON
values (1 is 1.0, keys in any order, true is not 1), keys by their text, and patterns (the formats the grammar
holds as patterns included) in ECMA-262's reading, as the grammar reads them.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from functools import lru_cache
from typing import Any

from lorafleet.worker.json_schema_bounds import as_fraction, encode, kind, same_key, value_fits
from lorafleet.worker.json_schema_keys import value_of


def takes(schema, index: int, value: Any) -> bool:
    """Whether node `index` of the JsonSchema `schema` takes `value` (one of its alternatives does)."""
    return any(_node_takes(schema, schema.nodes[a], value) for a in schema.alternatives(index))


def _node_takes(schema, node, value: Any) -> bool:
    if node.enum is not None:  # compared as JSON values: 1 is 1.0, keys in any order, true is not 1
        return same_key(value, Fraction) in _enum_values(node.enum)
    k = kind(value)
    if k == "number" and math.isfinite(value) and value.is_integer():  # 1.0 is an integer
        k = "integer"
    if k == "integer" and "integer" not in node.types:  # and an integer is a number
        k = "number"
    if k not in node.types:
        return False
    if k in ("number", "integer"):
        return node.bounds is None or math.isfinite(value) and node.bounds.takes(as_fraction(value))  # as written
    if k == "string":
        return value_fits(value, {}, node)  # lengths and pattern
    if k == "object":
        return _object_takes(schema, node, value)
    return k != "array" or _array_takes(schema, node, value)


@lru_cache(maxsize=256)
def _enum_values(enum: tuple[bytes, ...]) -> frozenset:
    return frozenset(same_key(json.loads(e), Fraction) for e in enum)


def _object_takes(schema, node, value: dict) -> bool:
    if len(value) < node.min_props or node.max_props is not None and len(value) > node.max_props:
        return False
    written = set()
    for key, item in value.items():
        listed = node.names.get(_encoded(key))
        if listed is not None:
            written.add(listed)
            target = node.props[listed][1]
        elif not node.others or node.language is not None and not node.language.matches(key):
            return False
        else:
            target = value_of(node, key)
        if target is None or not takes(schema, target, item):
            return False
    return node.required <= written


def _array_takes(schema, node, value: list) -> bool:
    if len(value) < node.min_items or node.max_items is not None and len(value) > node.max_items:
        return False
    if node.unique is not None and len({same_key(v, Fraction) for v in value}) < len(value):
        return False
    return all(takes(schema, schema.item(node, i), v) for i, v in enumerate(value))


def _encoded(key: str) -> bytes | None:
    """A key as listed names are held (json.dumps between its quotes); None for one no listed name can be (a lone
    surrogate)."""
    try:
        return encode(key)[1:-1]
    except UnicodeEncodeError:
        return None
