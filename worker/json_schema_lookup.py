"""Lookups the structured-output grammar (json_schema_grammar.py) makes in a compiled node: a prefix among an
enum's sorted values or an object's sorted property names (bisection), and the room maxProperties leaves."""

from __future__ import annotations

from bisect import bisect_left


def enum_run(values: tuple[bytes, ...], used, prefix: bytes) -> tuple[bool, bool]:
    """(whether `prefix` is a value, whether a longer value starts with it), among the sorted `values` not in
    `used` (bisection; at most the used ones are skipped)."""
    at, whole, more = bisect_left(values, prefix), False, False
    while at < len(values) and values[at].startswith(prefix) and not more:
        if values[at] not in used:
            whole, more = whole or values[at] == prefix, more or values[at] != prefix
        at += 1
    return whole, more


def unwritten_with_prefix(node, seen: frozenset, prefix: bytes, room: bool) -> bool:
    """Whether a property not written yet, and required where there is no room for others, has a name starting
    with `prefix` (bisection over the sorted names)."""
    names = node.sorted_names
    at = bisect_left(names, prefix)
    while at < len(names) and names[at].startswith(prefix):
        i = node.names[names[at]]
        if i not in seen and (room or i in node.required):
            return True
        at += 1
    return False


def counts(node) -> bool:
    """Whether an object keeps the names of its other keys (json_schema_keys.most_keys: each written once)."""
    return node.key_cap is not None


def most(node) -> int | None:
    """The most keys the object may write: maxProperties, or the grammar's cap where smaller (None: any)."""
    caps = [n for n in (node.max_props, node.key_cap) if n is not None]
    return min(caps) if caps else None


def has_room(node, seen: frozenset) -> bool:
    """Whether a key that is not required may still be written: maxProperties keeps room for the required ones."""
    limit = most(node)
    if limit is None:
        return True
    return len(seen) + 1 + sum(1 for r in node.required if r not in seen) <= limit
