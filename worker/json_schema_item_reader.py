"""ItemReader: how the structured-output grammar (json_schema_grammar.py) reads an array's items, byte by byte,
and keeps them apart where uniqueItems asks: enum values by their encodings (json_schema_grammar._enum_byte),
strings and numbers free of patterns, lengths and bounds by their values as JSON Schema compares them ("u" and
"m" frames: a string by its text however escaped, a number by value, 1 the same as 1.0). Such an item can
always grow into a value not written yet (an integer "0" cannot: it is refused at its digit once 0 is
written), so no item begun is a dead end.
"""

from __future__ import annotations

import json

from lorafleet.worker.json_constraint import _NUMBER_ENDS, _WS, string_byte
from lorafleet.worker.json_schema_bounds import number_byte, same_key

ZERO = same_key(0)


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
        json_schema_unions.MANY): its bytes are kept, and it may not close as a text written before it."""
        nxt = string_byte(top[1], c)
        if nxt is None:
            return []
        if nxt != "after":
            return [st[:-1] + (("u", nxt, top[2] + bytes((c,))),)]
        value = same_key(json.loads(b'"' + top[2] + b'"'))
        return [] if value in st[-2][4] else [self._pop(st[:-1], value)]

    def _distinct_number_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        """Byte `c` of such a number item: it may not end as a number written before it (by value, as JSON Schema
        compares: 1 is 1.0); an integer "-0" cannot grow, so it is refused at its digit once 0 is written."""
        _, mode, integer, text = top
        nxt = number_byte(mode, c, integer)
        if nxt is not None:
            if nxt == "zero" and integer and ZERO in st[-2][4]:
                return []
            return [st[:-1] + (("m", nxt, integer, text + bytes((c,))),)]
        if mode not in _NUMBER_ENDS:
            return []
        value = _number_key(text)
        return [] if value in st[-2][4] else self._byte(self._pop(st[:-1], value), c)


def _number_key(text: bytes) -> tuple:
    """A number item's value as uniqueItems compares it (same_key: as a reader parsing JSON numbers sees it)."""
    try:
        return same_key(json.loads(text))
    except (OverflowError, ValueError):  # past a double's range: by its text
        return ("number", text)
