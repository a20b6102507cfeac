"""KeyReader: how the structured-output grammar (json_schema_grammar.py) reads an object's keys, byte by byte: a
listed property's name ("k" frames, matched against the sorted names), another key of any text ("K"), or one
held to the object's key language ("R": patternProperties and propertyNames, json_schema_keys.py). A key is
decided at its closing quote: a listed name however escaped is that property, written once; another key's
name picks its value's schema. Where the object counts its other keys by name (its key_cap, json_schema_keys.
most_keys: nearly always) each is written once too. A key held to a language takes a character only where a
key not written yet (listed, or counted) can still follow, so no key begun is a dead end.
"""

from __future__ import annotations

import json

from lorafleet.worker.json_constraint import string_byte, string_mode
from lorafleet.worker.json_schema_bounds import encode
from lorafleet.worker.json_schema_keys import count_texts, value_of
from lorafleet.worker.json_schema_lookup import counts, has_room, unwritten_with_prefix
from lorafleet.worker.regex_grammar import CLOSE, completed_char, pending_chars, text_byte

MAX_KEY_MEMO = 4096  # entries of a grammar's key memo, then it starts over
_MISSING = object()


class KeyReader:
    """The key frames of SchemaGrammar (its `nodes`, a compiled schema's)."""

    nodes: list

    def rescanned_bytes(self, state) -> set[int]:
        """Where regex_reading takes a key held to a language: the first bytes of the tokens whose text may begin
        a key written already, so that the grammar reads them (_unwritten_after), not the trie."""
        st = next(iter(state))
        if st[-1][0] != "R" or not st[-2][2]:
            return set()
        node = self.nodes[st[-2][1]]
        seen, text = st[-2][2], st[-1][3]
        prefix = encode(text)[1:-1]
        names = (node.props[w][0] if isinstance(w, int) else w for w in seen)
        return {name[len(prefix)] for name in names if len(name) > len(prefix) and name.startswith(prefix)}

    def _key_byte(self, st: tuple, buf: bytes, c: int) -> list[tuple]:
        obj = st[-2]
        node, seen = self.nodes[obj[1]], obj[2]
        room = has_room(node, seen)
        if c == 0x22:  # the closing quote, unless it is escaped inside a name (`\"`)
            i = node.names.get(buf)
            if i is not None and i not in seen and (room or i in node.required):
                return [self._key_done(st[:-1], i)]
        longer = buf + bytes((c,))
        if unwritten_with_prefix(node, seen, longer, room):
            return [st[:-1] + (("k", longer),)]
        if not node.others or not room:
            return []
        if node.language is None:
            return self._other_key_byte(st, string_mode(buf), buf, c)
        read = (node.language.start, b"", "")
        for b in buf:  # a listed name's bytes so far, through the key language
            read = _language_byte(node.language, *read, b)
            if read is None:
                return []
        return self._language_key_byte(st, *read, c)

    def _other_key_byte(self, st: tuple, mode: str | None, buf: bytes, c: int) -> list[tuple]:
        """Byte `c` of a key not (or no longer) matched against the listed names, `buf` its bytes so far in string
        mode `mode`: read whole, and decided at its closing quote (a listed name written otherwise is that
        property, refused once written; any other is an additional key)."""
        mode = None if mode is None else string_byte(mode, c)
        if mode is None:
            return []
        if mode != "after":
            return [st[:-1] + (("K", mode, buf + bytes((c,))),)]
        return self._key_closed(st, buf)

    def _language_key_byte(self, st: tuple, dstate, pending: bytes, text: str, c: int) -> list[tuple]:
        """Byte `c` of another key read through its object's key language (a "K" key held to a regex)."""
        obj = st[-2]
        node = self.nodes[obj[1]]
        read = _language_byte(node.language, dstate, pending, text, c)
        if read is None:
            return []
        if read == CLOSE:
            return self._key_closed(st, text)
        if not self._may_go_on(node, obj[2], *read):
            return []
        return [st[:-1] + (("R", *read),)]

    def _key_closed(self, st: tuple, key: bytes | str) -> list[tuple]:
        """The closing quote of a key read whole (its bytes, or its text): a listed property's name (however
        escaped), or another key, whose value's node its name decides."""
        obj = st[-2]
        text = json.loads(b'"' + key + b'"') if isinstance(key, bytes) else key
        node, seen, name = self.nodes[obj[1]], obj[2], encode(text)[1:-1]
        listed = node.names.get(name, -1)
        if listed in seen or name in seen or not (has_room(node, seen) or listed in node.required):
            return []  # written already (a counting object keeps its other keys' names), or no room left
        if listed >= 0:
            return [self._key_done(st[:-1], listed)]
        value = value_of(node, text)
        return [] if value is None else [self._key_done(st[:-1], (value, name if counts(node) else None))]

    def _may_go_on(self, node, seen: frozenset, dstate, pending: bytes, text: str) -> bool:
        """Whether a key the object has not written yet can still follow `text` (and the character `pending` has
        begun): a written key (listed, or counted by name) begun again could otherwise only end as itself,
        refused."""
        if not seen:  # nothing written yet: the language's own states all go on
            return True
        if not pending:
            return self._unwritten_after(node, seen, dstate, text)
        written = {w[len(text)] for w in self._written_texts(node, seen) if len(w) > len(text) and w.startswith(text)}
        language = node.language
        for lo, hi in pending_chars(pending):  # some character it may become begins no written key, or one that can
            points = sorted({lo, hi + 1} | {x for x in language.cuts(dstate) if lo < x <= hi})
            for a, b in zip(points, points[1:], strict=False):
                if language.step(dstate, a) is None:
                    continue
                if b - a > sum(1 for ch in written if a <= ord(ch) < b):
                    return True
                if any(a <= ord(ch) < b and self._unwritten_after(node, seen, language.step(dstate, ord(ch)), text + ch)
                       for ch in written):
                    return True
        return False

    def _unwritten_after(self, node, seen: frozenset, dstate, text: str) -> bool:
        """Whether, after `text` in the key language's `dstate`, more texts can follow than keys were written."""
        written = sum(1 for w in self._written_texts(node, seen) if w.startswith(text))
        if not written:
            return True
        more = self._memo(("texts", node.language, written + 1, dstate), lambda: count_texts(node.language, written + 1, dstate))
        return more is None or more > written  # None: too many to count, and so more than were written

    def _written_texts(self, node, seen: frozenset) -> list[str]:
        """The keys an object wrote that its key language takes: its other keys, and listed names in the language."""
        def texts() -> list[str]:
            out = []
            for w in seen:
                name = json.loads(b'"' + (node.props[w][0] if isinstance(w, int) else w) + b'"')
                if isinstance(w, bytes) or node.language.matches(name):
                    out.append(name)
            return out

        return self._memo(("written", id(node), seen), texts)

    def _memo(self, key, make):
        """A value of this grammar's key memo (counts and decoded names its masks ask for again per token)."""
        memo = self.__dict__.setdefault("_key_memo", {})
        hit = memo.get(key, _MISSING)
        if hit is _MISSING:
            if len(memo) >= MAX_KEY_MEMO:
                memo.clear()
            hit = memo[key] = make()
        return hit

    @staticmethod
    def _key_done(st: tuple, cur: int | tuple) -> tuple:
        """`st` ends with the object frame whose key was just closed: `cur` names the property (a listed one's
        index, or another's value node and name where the object counts its keys)."""
        _, index, seen, _, _ = st[-1]
        return st[:-1] + (("o", index, seen, "colon", cur),)


def _language_byte(language, dstate, pending: bytes, text: str, c: int):
    """text_byte through a key language, the key's text kept: (dstate, pending, text), CLOSE or None."""
    read = text_byte(language, dstate, pending, c, True)
    if read is None or read == CLOSE:
        return read
    return read[0], read[1], text if read[1] else text + completed_char(pending, c)
