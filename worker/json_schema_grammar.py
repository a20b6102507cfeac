"""SchemaGrammar: whether bytes extend a prefix of a JSON value a compiled schema (json_schema.py) takes.

The grammar JsonGuide holds a structured-output request's output to, byte by byte, as json_constraint.py
does for JSON mode (same interface: `start`, `advance`, `is_complete`, `is_in_string`, `ws_uniform`). A
state is a set of stacks, one per reading of the bytes so far (a union's alternatives that still fit), or
DONE once the value is complete. A stack's frames, innermost last:

    ("v", node)                      a value of `node` comes next (whitespace may come first)
    ("o", node, seen, phase, cur)    in an object: phase open | after | next | colon | value; seen: the listed
                                     properties written (and the names of others, where the object counts its
                                     keys: _written); cur: the listed property whose value is read, or for another
                                     key (its value's node, its name where counted); -1 between keys
    ("k", buf)                       in a key that may still be one of the object's unwritten properties
    ("K", mode, buf)                 in another key of any text: a string mode of json_constraint and its bytes,
                                     read when it closes (a listed name escaped, `"\u0061"`, is that property:
                                     written already, it is refused); its value's schema is chosen then
                                     (patternProperties, else additionalProperties: json_schema_keys.py)
    ("R", dstate, pending, text)     in another key held to the object's key language (patternProperties,
                                     propertyNames): as "K", read through that regex (regex_grammar.text_byte),
                                     keeping its text; where the object counts its keys by name, a character is
                                     taken only where a key not written yet can still follow (_unwritten_after)
    ("a", node, count, phase, used)  in an array: phase open | after | next | value; used: the items written where
                                     they must be unique (uniqueItems: enum values' encodings, or the same_key of
                                     strings and numbers; each is kept from the rest)
    ("u", mode, pending, digest)     in a string item of such an array: a hash of its text, the bytes of a
                                     character begun; refused as it closes if written before (json_schema_item_reader)
    ("m", mode, integer, text)       in a number item of such an array: as "n", its text kept, within limits
    ("s", mode)                      in a string value
    ("S", node, mode, count)         in a string value with a length: count, its characters so far (capped)
    ("P", node, dstate, pending)     in a string value with a pattern: its DFA state, the bytes of a character
                                     begun (regex_grammar.text_byte)
    ("n", mode, integer)             in a number (json_constraint's number modes); integer: no '.' or exponent
    ("N", node, mode, integer, text) in a number with bounds (no exponent): text, its bytes so far, or None once
                                     every number it may still become is inside them
    ("l", rest)                      in true, false or null: the bytes still to come
    ("e", node, buf)                 in an enum/const value: its compact encoding so far
    ("t", node, buf)                 in a union of objects read with their tag first (json_schema_tag_reader.py):
                                     the bytes after its `{` up to the tag's value, whitespace left out

A number ends at the first byte that cannot continue it, which its container then reads; every other value
ends at its own last byte. Readings are bounded (MAX_READINGS): a schema whose unions stay ambiguous
through many nested levels fails its request with GrammarError instead of growing without bound. Keys and enum values are matched against their encodings as written in the
schema, so a property can be written once, and a required one must be before its object closes.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from lorafleet.worker.json_constraint import _NUMBER_ENDS, _PLAIN_RUN, _WS, string_byte
from lorafleet.worker.json_schema import JsonSchema, SchemaError, compile_schema
from lorafleet.worker.json_schema_bounds import length_cap, number_byte, number_text_takes
from lorafleet.worker.json_schema_check import takes
from lorafleet.worker.json_schema_item_reader import ItemReader, distinct_start, fold
from lorafleet.worker.json_schema_key_reader import KeyReader
from lorafleet.worker.json_schema_lookup import enum_run, most
from lorafleet.worker.json_schema_tag_reader import TagReader
from lorafleet.worker.json_schema_unions import MANY
from lorafleet.worker.regex_grammar import CLOSE, text_byte

DONE = "done"
STR = ("s", "str")
MAX_READINGS = 64  # stacks a state may hold
MAX_BOUNDED_DIGITS = 1000  # characters of a number under bounds kept to check them (each byte reads them all)
_DIGITS = frozenset(b"0123456789")
_LITERALS = {ord("t"): ("boolean", b"rue"), ord("f"): ("boolean", b"alse"), ord("n"): ("null", b"ull")}
_REPROCESS = object()  # an enum value or number ended before this byte: its container reads it


def _ends_in_time(bounds, text: bytes) -> bool:
    """Near MAX_BOUNDED_DIGITS: whether the number can end inside its bounds as written, or with one more digit
    where one may still come (so the cap never leaves a number that can neither go on nor end)."""
    if number_text_takes(bounds, text.rstrip(b".")):
        return True
    return len(text) < MAX_BOUNDED_DIGITS and any(number_text_takes(bounds, text + bytes((d,))) for d in b"0123456789")


class GrammarError(RuntimeError):
    """The output cannot be followed within the grammar's bounds (its request fails; the others go on)."""


class SchemaGrammar(KeyReader, ItemReader, TagReader):
    def __init__(self, schema: JsonSchema, compact: bool = False, tag: bytes | None = None) -> None:
        self.schema = schema
        self.nodes = schema.nodes
        self.compact = compact  # no whitespace between tokens of JSON (vLLM's disable_any_whitespace)
        self.tag = tag  # unions of objects told apart by this property's constant are read with it first
        self._tag_unions = {}
        # The grammar's name in the vocabulary's mask cache.
        self.key = schema.key + (":compact" if compact else "") + ("" if tag is None else f":tag={tag.hex()}")
        self.start = frozenset({(("v", schema.root),)})
        self.pads = True  # JSON whitespace may follow the complete value (JsonGuide._pads)

    @staticmethod
    def is_complete(state) -> bool:
        return state == DONE

    @staticmethod
    def may_stop(state) -> bool:
        return False  # only a complete value ends (is_complete)

    def regex_reading(self, state):
        """(pattern, DFA state, True) where the one reading is a patterned string between characters, else None."""
        if state == DONE or len(state) != 1:
            return None
        st = next(iter(state))
        top = st[-1]
        if top[0] == "R" and not top[2]:  # a key held to its object's key language
            return self.nodes[st[-2][1]].language, top[1], True
        return (self.nodes[top[1]].pattern, top[2], True) if top[0] == "P" and not top[3] else None

    @staticmethod
    def is_in_string(state) -> bool:
        """Every reading is inside a string, where plain content (json_constraint._PLAIN_RUN) may follow as far
        as string_room allows (a key of any text too: it closes only at its quote)."""
        return state != DONE and all(_in_plain(st[-1]) for st in state)

    def string_room(self, state) -> int | None:
        """In a state is_in_string takes: the most characters of plain content that may follow (None: any)."""
        room = 0
        for st in state:
            top = st[-1]
            most = None if top == STR or top[0] in "Ku" else self.nodes[top[1]].max_len
            if most is None:
                return None
            room = max(room, most - top[3])
        return room

    @staticmethod
    def ws_uniform(state) -> bool:
        """Whether every whitespace byte leads to the same state (not inside a string, key or enum value)."""
        return state == DONE or all(st[-1][0] not in "sSPkKRuet" for st in state)

    def validates(self, value) -> bool:
        """Whether a parsed JSON value is one the schema takes, as JSON Schema reads it (json_schema_check.py:
        not held to the forms the grammar writes numbers in)."""
        try:
            return takes(self.schema, self.schema.root, value)
        except (RecursionError, UnicodeError, ValueError, OverflowError):  # nested deeper than this check follows
            return False  # (a few hundred levels), or a number or text no value here can be: refused, not an error

    def advance(self, state, data: bytes):
        """The state after `data`, or None when `data` cannot continue a value of the schema from `state`."""
        if state == DONE:
            return None if data else state
        stacks, i, n = state, 0, len(data)
        while i < n:
            if len(stacks) == 1:  # a run of plain content at once
                st = next(iter(stacks))
                run = self._plain_run(st, data, i)
                if run is not None:
                    i, stacks = run[0], frozenset((run[1],))
                    continue
            nxt: set = set()
            for st in stacks:
                nxt.update(self._byte(st, data[i]))
            if not nxt:
                return None
            i += 1
            if () in nxt:  # the value is complete (at the top level, no other reading can go on)
                return DONE if i == n else None
            if len(nxt) > MAX_READINGS:
                raise GrammarError(f"structured output: more than {MAX_READINGS} readings of the output fit the schema "
                                   "at once (anyOf alternatives that stay alike through many nested levels); make the "
                                   "alternatives differ early, e.g. by a const property")
            stacks = frozenset(nxt)
        return stacks

    def _plain_run(self, st: tuple, data: bytes, i: int) -> tuple[int, tuple] | None:
        """(where a run of plain string content from data[i] ends, the stack after it), None when there is no
        run to take at once (not in a string, no plain byte next, or more characters than a length allows)."""
        top = st[-1]
        if not _in_plain(top):
            return None
        j = _PLAIN_RUN.match(data, i).end()
        if j == i:
            return None
        if top == STR:
            return j, st
        if top[0] == "K":  # a key of any text: its bytes kept
            return j, st[:-1] + (("K", "str", top[2] + data[i:j]),)
        if top[0] == "u":  # a unique string item: its text folded into its hash
            return j, st[:-1] + (("u", "str", b"", fold(top[3], data[i:j].decode())),)
        node = self.nodes[top[1]]
        count = top[3] + sum(1 for b in data[i:j] if not 0x80 <= b < 0xC0)  # characters: bytes that lead one
        if node.max_len is not None and count > node.max_len:
            return None  # byte by byte: refused where the length runs out
        return j, st[:-1] + (("S", top[1], "str", min(count, length_cap(node))),)

    def _byte(self, st: tuple, c: int) -> list[tuple]:
        if not st:
            return []
        top = st[-1]
        tag = top[0]
        if tag == "v":
            return self._ws(st) if c in _WS else self._begin(st[:-1], top[1], c)
        if tag == "s":
            mode = string_byte(top[1], c)
            return [] if mode is None else [self._pop(st[:-1])] if mode == "after" else [st[:-1] + (("s", mode),)]
        if tag == "o":
            return self._object_byte(st, top, c)
        if tag == "a":
            return self._array_byte(st, top, c)
        if tag == "k":
            return self._key_byte(st, top[1], c)
        if tag == "K":
            return self._other_key_byte(st, top[1], top[2], c)
        if tag == "u":
            return self._distinct_string_byte(st, top, c)
        if tag == "m":
            return self._distinct_number_byte(st, top, c)
        if tag == "R":
            return self._language_key_byte(st, top[1], top[2], top[3], c)
        if tag == "t":
            return self._tag_byte(st, top, c)
        if tag == "S":
            return self._boundedstring_byte(st, top, c)
        if tag == "P":
            read = text_byte(self.nodes[top[1]].pattern, top[2], top[3], c, True)
            return [] if read is None else [self._pop(st[:-1])] if read == CLOSE else [st[:-1] + (("P", top[1], *read),)]
        if tag == "N":
            return self._boundednumber_byte(st, top, c)
        if tag == "n":
            mode = number_byte(top[1], c, top[2])
            if mode is not None:
                return [st[:-1] + (("n", mode, top[2]),)]
            return self._byte(self._pop(st[:-1]), c) if top[1] in _NUMBER_ENDS else []
        if tag == "l":
            if c != top[1][0]:
                return []
            return [self._pop(st[:-1])] if len(top[1]) == 1 else [st[:-1] + (("l", top[1][1:]),)]
        return self._enum_byte(st[:-1], top[1], top[2], c)  # "e"

    def _ws(self, st: tuple) -> list[tuple]:
        """Whitespace between tokens of JSON: it changes nothing, and with `compact` it may not come."""
        return [] if self.compact else [st]

    def _begin(self, below: tuple, index: int, c: int) -> list[tuple]:
        """The stacks after `c`, the first byte of a value of node `index`, on top of `below`."""
        if self.tag is not None and (tagged := self._tagged_begin(below, index, c)) is not None:
            return tagged  # (tested here: no call on every value's first byte of the grammars without a tag)
        out = []
        distinct = bool(below) and below[-1][0] == "a" and self.nodes[below[-1][1]].unique == MANY
        for a in self.schema.alternatives(index):  # memoized at compile time
            node = self.nodes[a]
            if node.enum is not None:
                out.extend(self._enum_byte(below, a, b"", c))
            elif distinct and (c == 0x22 or c == 0x2D or c in _DIGITS):  # an item kept apart from those before it
                frame = distinct_start(c, node.types, below[-1][4])
                out.extend(() if frame is None else (below + (frame,),))
            elif c == 0x7B and "object" in node.types:  # '{'
                out.append(below + (("o", a, frozenset(), "open", -1),))
            elif c == 0x5B and "array" in node.types:  # '['
                out.append(below + (("a", a, 0, "open", frozenset()),))
            elif c == 0x22 and "string" in node.types:
                out.append(below + (("P", a, node.pattern.start, b"") if node.pattern is not None else STR
                                    if node.min_len == 0 and node.max_len is None else ("S", a, "str", 0),))
            elif (c == 0x2D or c in _DIGITS) and node.types & {"number", "integer"}:
                mode = "minus" if c == 0x2D else "zero" if c == 0x30 else "int"
                integer = "number" not in node.types
                if node.bounds is None:
                    out.append(below + (("n", mode, integer),))
                else:
                    out.extend(self._bounded_number(below, a, mode, integer, bytes((c,))))
            elif c in _LITERALS and _LITERALS[c][0] in node.types:
                out.append(below + (("l", _LITERALS[c][1]),))
        return out

    def _pop(self, st: tuple, value: bytes | tuple | None = None) -> tuple:
        """The stack once the value on top of `st` is complete: its container moves past it (an array whose
        items are unique keeps the enum `value` written)."""
        if not st:
            return ()
        top = st[-1]
        if top[0] == "o":  # ("o", node, seen, "value", cur)
            return st[:-1] + (("o", top[1], self._written(top[1], top[2], top[4]), "after", -1),)
        node, used = self.nodes[top[1]], top[4]  # ("a", node, count, "value", used)
        cap = max(node.min_items, node.max_items or 0, len(node.prefix))  # counts past it read alike
        used = used | {value} if node.unique is not None and value is not None else used
        return st[:-1] + (("a", top[1], min(top[2] + 1, cap), "after", used),)

    def _object_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        _, index, seen, phase, cur = top
        if c in _WS:
            return self._ws(st)
        node = self.nodes[index]
        if phase == "colon":
            if c != 0x3A:
                return []
            value = node.props[cur][1] if isinstance(cur, int) else cur[0]
            return [st[:-1] + (("o", index, seen, "value", cur), ("v", value))]
        if c == 0x7D and phase in ("open", "after"):  # '}'
            return [self._pop(st[:-1])] if node.required <= seen and len(seen) >= node.min_props else []
        listed = sum(1 for i in seen if isinstance(i, int))
        may_add = (node.others or listed < len(node.props)) \
            and (most(node) is None or len(seen) < most(node))
        if c == 0x2C and phase == "after":  # ','
            return [st[:-1] + (("o", index, seen, "next", -1),)] if may_add else []
        if c == 0x22 and phase in ("open", "next") and may_add:
            if listed < len(node.props):
                return [st + (("k", b""),)]
            return [st + (("K", "str", b""),) if node.language is None else st + (("R", node.language.start, b"", ""),)]
        return []

    def _written(self, index: int, seen: frozenset, cur: int | tuple) -> frozenset:
        """`seen` once property `cur`'s value is read: a listed one by its index; another, where the object counts
        its keys (json_schema_lookup.counts), by its name, so that it is not written twice."""
        if isinstance(cur, int):
            return seen | {cur}
        return seen if cur[1] is None else seen | {cur[1]}

    def _boundedstring_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        """Byte `c` of a string with a length: a character counts when its last byte is read (a plain byte, an
        escape's last, a UTF-8 character's last); none may begin once maxLength are written, nor the string
        close before minLength."""
        _, index, mode, count = top
        node = self.nodes[index]
        if mode == "str" and c == 0x22:
            return [self._pop(st[:-1])] if count >= node.min_len else []
        if mode == "str" and node.max_len is not None and count >= node.max_len:
            return []
        nxt = string_byte(mode, c)
        if nxt is None:
            return []
        if nxt == "str":
            count = min(count + 1, length_cap(node))
        return [st[:-1] + (("S", index, nxt, count),)]

    def _bounded_number(self, below: tuple, index: int, mode: str, integer: bool, text: bytes | None) -> list[tuple]:
        """The stack of a number with bounds that has begun with `text` ([] when no number inside them does)."""
        bounds = self.nodes[index].bounds
        if text is not None and (len(text) > MAX_BOUNDED_DIGITS or not bounds.may_begin(text, integer)
                                 or len(text) >= MAX_BOUNDED_DIGITS - 1 and not _ends_in_time(bounds, text)):
            return []  # past MAX_BOUNDED_DIGITS the number may only end: each byte reads its whole text
        if text is not None and bounds.holds_all(text, integer):
            text = None
        return [below + (("N", index, mode, integer, text),)]

    def _boundednumber_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        _, index, mode, integer, text = top
        nxt = number_byte(mode, c, integer)
        if nxt is not None and not nxt.startswith("exp"):
            return self._bounded_number(st[:-1], index, nxt, integer, None if text is None else text + bytes((c,)))
        if nxt is None and mode in _NUMBER_ENDS and (text is None or number_text_takes(self.nodes[index].bounds, text)):
            return self._byte(self._pop(st[:-1]), c)  # the number ended inside its bounds: its container reads c
        return []

    def _enum_byte(self, below: tuple, index: int, buf: bytes, c: int) -> list[tuple]:
        values = self.nodes[index].enum  # sorted: the values a prefix starts are a run found by bisection
        used = below[-1][4] if below and below[-1][0] == "a" else ()  # an item of a unique array: not these
        longer = buf + bytes((c,))
        whole, more = enum_run(values, used, longer)
        if whole or more:
            if whole and not more:  # complete, and no longer value: ends at its last byte
                return [self._pop(below, longer)]
            return [below + (("e", index, longer),)]
        at = bisect_left(values, buf)
        if at < len(values) and values[at] == buf and buf not in used:  # a number value ended: its container reads c
            return self._byte(self._pop(below, buf), c)
        return []


def _in_plain(top: tuple) -> bool:
    """Whether plain string content may follow a stack's top: in a string value, a key of any text or a unique
    array's string item, between characters."""
    return top == STR or top[0] == "S" and top[2] == "str" or top[0] in "Ku" and top[1] == "str"


def schema_grammar(schema: Any, compact: bool = False, tag: bytes | None = None) -> SchemaGrammar:
    """The grammar of a schema (json_schema.SchemaError when it cannot be enforced); one per schema text (and
    `compact` and `tag`), shared by the requests that send it, with its cached alternatives (and the vocabulary's
    masks, keyed by its key). `tag`: unions of objects told apart by that property's constant take it first
    (json_schema_tag_reader.py)."""
    compiled = compile_schema(schema)
    grammar = compiled.grammars.get((compact, tag))
    if grammar is None:
        try:
            grammar = compiled.grammars[compact, tag] = SchemaGrammar(compiled, compact, tag)
        except RecursionError:
            raise SchemaError("the schema nests too deeply to compile") from None
    return grammar
