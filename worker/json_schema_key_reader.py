"""KeyReader: how the structured-output grammar (json_schema_grammar.py) reads an object's keys, byte by byte: a
listed property's name ("k" frames, matched against the sorted names), another key of any text ("K"), or one
held to the object's key language ("R": patternProperties and propertyNames, json_schema_keys.py). A key is
decided at its closing quote: a listed name however escaped is that property, written once; another key's
name picks its value's schema. Where the object counts its keys (minProperties, maxProperties) each other key
is written once too, and a key held to a language takes a character only where a key not written yet can
still follow, so no key begun is a dead end.
"""

from __future__ import annotations

import json
from functools import lru_cache

from lorafleet.worker.json_constraint import string_byte, string_mode
from lorafleet.worker.json_schema_bounds import encode
from lorafleet.worker.json_schema_keys import count_texts, value_of
from lorafleet.worker.json_schema_lookup import counts, has_room, unwritten_with_prefix
from lorafleet.worker.regex_grammar import CLOSE, completed_char, text_byte


class KeyReader:
    """The key frames of SchemaGrammar (its `nodes`, a compiled schema's)."""

    nodes: list

    def rescanned_bytes(self, state) -> set[int]:
        """Where regex_reading takes a key of an object that counts its keys: the first bytes of the tokens whose
        text may begin a key written already, so that the grammar reads them (_unwritten_after), not the trie."""
        st = next(iter(state))
        if st[-1][0] != "R" or not counts(node := self.nodes[st[-2][1]]):
            return set()
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
        if counts(node) and not read[1] and not _unwritten_after(node, obj[2], read[0], read[2]):
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


def _unwritten_after(node, seen: frozenset, dstate, text: str) -> bool:
    """Whether a key the object has not written yet (listed or not) can still follow `text`, where the key
    language is in `dstate`: more of its texts start so than written keys do (a written key begun again could
    otherwise only end as itself, refused)."""
    prefix = encode(text)[1:-1]
    written = sum(1 for w in seen if isinstance(w, bytes) and w.startswith(prefix)
                  or isinstance(w, int) and node.props[w][0].startswith(prefix) and _in_language(node, w))
    if not written:
        return True
    more = _texts_after(node.language, written + 1, dstate)
    return more is None or more > written  # None: too many to count, and so more than were written


@lru_cache(maxsize=4096)
def _texts_after(language, limit: int, dstate) -> int | None:
    """count_texts from a key language's state, memoized: a mask's scan asks again for each token."""
    return count_texts(language, limit, dstate)


def _in_language(node, listed: int) -> bool:
    """Whether a listed property's name is a text of the object's key language (one of its keys begun there)."""
    return node.language.matches(json.loads(b'"' + node.props[listed][0] + b'"'))
