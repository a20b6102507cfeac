"""ItemReader: how the structured-output grammar (json_schema_grammar.py) reads an array's items, byte by byte,
and keeps them apart where uniqueItems asks: enum values by their encodings (json_schema_grammar._enum_byte),
strings and numbers free of patterns, lengths and bounds by their values as JSON Schema compares them ("u" and
"m" frames: a string by its text however escaped, a number by value, 1 the same as 1.0). Such an item can
always grow into a value not written yet (an integer "0" cannot: it is refused at its digit once 0 is
written), so no item begun is a dead end.
"""

from __future__ import annotations

import json
from fractions import Fraction
from functools import lru_cache

from lorafleet.worker.json_constraint import _NUMBER_ENDS, _WS, string_byte
from lorafleet.worker.json_schema_bounds import number_byte

EMPTY = hash("")  # the hash of a string item with no character yet
_DIGITS = frozenset(b"0123456789")
MAX_DIGITS = 4300  # digits of a number item (Python's int() refuses more by default)
MAX_SIGNIFICANT = 15  # significant digits of a number (not integer) item: distinct ones stay distinct as doubles
MAX_FRACTION = 300  # digits after its point: no underflow


class ItemReader:
    """The array frames of SchemaGrammar (its `nodes` and `schema`, a compiled schema's)."""

    nodes: list

    def _array_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        _, index, count, phase, used = top
        if c in _WS:
            return self._ws(st)
        node = self.nodes[index]
        if c == 0x5D and phase in ("open", "after"):  # ']'
            return [self._pop(st[:-1])] if count >= node.min_items else []
        if c == 0x2C and phase == "after":
            more = (node.max_items is None or count < node.max_items) and (node.unique is None or len(used) < node.unique)
            return [st[:-1] + (("a", index, count, "next", used),)] if more else []
        if phase in ("open", "next") and (node.max_items is None or count < node.max_items):
            return self._begin(st[:-1] + (("a", index, count, "value", used),), self.schema.item(node, count), c)
        return []

    def _distinct_string_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        """Byte `c` of a string item of an array whose items are unique and may take any string (uniqueItems,
        json_schema_unions.MANY): a hash of its text so far is kept (each character folded in once whole, an
        escape decoded), and it may not close as a text written before it."""
        _, mode, pending, digest = top
        nxt = string_byte(mode, c)
        if nxt is None:
            return []
        if nxt == "after":
            value = ("string", digest)
            return [] if value in st[-2][4] else [self._pop(st[:-1], value)]
        pending += bytes((c,))
        if nxt == "str":  # a character is whole: folded in
            digest, pending = fold(digest, _decoded(pending)), b""
        return [st[:-1] + (("u", nxt, pending, digest),)]

    def _distinct_number_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        """Byte `c` of such a number item (no exponent; with a fraction, at most 15 significant digits and 300
        after the point, so that numbers equal as doubles are equal as decimals): a digit or point is taken only
        where a value not written yet can still end the number; the number ends only as one (by value, as JSON
        Schema compares: 1 is 1.0)."""
        _, mode, integer, text = top
        used = st[-2][4]
        nxt = _number_next(mode, c, integer, text)
        if nxt is not None:
            return [st[:-1] + (("m", nxt, integer, text + bytes((c,))),)] if _viable(nxt, integer, text + bytes((c,)), used) else []
        value = number_key(text) if mode in _NUMBER_ENDS else None
        if value is None or value in used:
            return []
        return self._byte(self._pop(st[:-1], value), c)


def distinct_start(c: int, types: frozenset, used) -> tuple | None:
    """The frame of a string or number item of such an array begun with byte `c` (None where it cannot begin
    one that can end as a value not written yet)."""
    if c == 0x22:
        return ("u", "str", b"", EMPTY) if "string" in types else None
    if not types & {"number", "integer"} or not (c == 0x2D or c in _DIGITS):
        return None
    mode, integer = "minus" if c == 0x2D else "zero" if c == 0x30 else "int", "number" not in types
    return ("m", mode, integer, bytes((c,))) if _viable(mode, integer, bytes((c,)), used) else None


def fold(digest: int, chars: str) -> int:
    """A string item's hash after `chars` (the same text, however escaped, folds to the same hash)."""
    for ch in chars:
        digest = hash((digest, ch))
    return digest


def _decoded(raw: bytes) -> str:
    """The text of one whole character as written in a JSON string: a plain byte, UTF-8, or an escape."""
    return json.loads(b'"' + raw + b'"') if raw[:1] == b"\\" else raw.decode()


def number_key(text: bytes) -> tuple:
    """A number item's value as uniqueItems compares it: exact (same_key's form; with the limits of
    _number_next, numbers equal as doubles are equal exactly)."""
    return ("number", Fraction(text.decode()))


def _number_next(mode: str, c: int, integer: bool, text: bytes) -> str | None:
    """The number mode after byte `c` within the item limits: no exponent; an integer item (read as an exact
    int) at most MAX_DIGITS digits; a number item (read as a double) at most MAX_SIGNIFICANT significant digits,
    MAX_FRACTION after its point."""
    nxt = number_byte(mode, c, integer)
    if nxt is None or nxt.startswith("exp"):
        return None
    whole, point, fraction = (text + bytes((c,))).lstrip(b"-").partition(b".")
    if len(whole) + len(fraction) > MAX_DIGITS:
        return None
    if not integer and (len(fraction) > MAX_FRACTION or len((whole + fraction).lstrip(b"0")) > MAX_SIGNIFICANT
                        or nxt == "dot" and len(whole.lstrip(b"0")) >= MAX_SIGNIFICANT):
        return None
    return nxt


@lru_cache(maxsize=1024)
def _viable(mode: str, integer: bool, text: bytes, used: frozenset, depth: int = 0) -> bool:
    """Whether the number begun as `text` can still end as a value not in `used`: now, or after more digits
    (explored only while the values it could end as are written: a few levels, as `used` holds at most
    MANY values)."""
    if mode in _NUMBER_ENDS and number_key(text) not in used:
        return True
    if depth > 4:  # the number this check began at has a path 5 bytes on within the limits, so over 1,000
        return True  # endings (the digits allowed do not depend on those chosen), and `used` holds at most MANY
    for c in b"0123456789.":
        nxt = _number_next(mode, c, integer, text)
        if nxt is not None and _viable(nxt, integer, text + bytes((c,)), used, depth + 1):
            return True
    return False
