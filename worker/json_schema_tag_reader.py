"""TagReader: a union of objects told apart by one property's constant (a tag), read with the tag first.

tool_choice "required" holds the output to an array of calls, each `{"name": <a tool's>, "parameters": {...}}`:
a union with one object per tool. Read as any union, every tool is a reading from the call's `{` on (65 tools
were past MAX_READINGS at the first byte), and a call that writes its parameters before its name keeps every
tool whose parameters still fit as a reading through the whole of them (17 tools whose parameters were each
a union of 4 objects failed a request after 30 s of decoding). With the tag first, the name picks its tool
before any other byte of the call: one reading from there on, for any number of tools. The grammar takes the
calls only in that order (CallArray reads them in any), which is how a model writes a call.

A "t" frame, ("t", union node, bytes so far): the object's `{` read, then whitespace as JSON allows, the tag's
key, a colon and the tag's value, written as the schema writes it (its compact encoding); once that value is
whole, the object of its alternative goes on after the tag (an "o" frame, the tag written).
"""

from __future__ import annotations

from bisect import bisect_left

from lorafleet.worker.json_constraint import _WS


class TagReader:
    """The tag-first frames of SchemaGrammar (its `nodes`, `schema` and `tag`: the tag property's name as written
    between its quotes; None: unions are read as any other)."""

    nodes: list
    tag: bytes | None
    _tag_unions: dict[int, tuple[tuple[bytes, ...], dict[bytes, tuple[int, int]]] | None]

    def _tagged_begin(self, below: tuple, index: int, c: int) -> list[tuple] | None:
        """With a tag: the stacks after `{` begins a value of union `index` read tag first; None where it is not
        such a union (or `c` is no `{`): read as any other. Only the items of the top-level array are (the calls): a union
        inside them (a tool's own parameters) keeps every key order its schema takes."""
        if c != 0x7B or index != self.nodes[self.schema.root].items:
            return None
        return None if self._tag_union(index) is None else [below + (("t", index, b""),)]

    def _tag_union(self, index: int) -> tuple[tuple[bytes, ...], dict[bytes, tuple[int, int]]] | None:
        """(the texts that may follow `{` up to the tag's whole value, sorted; text -> (its alternative, the tag's
        index among that one's properties)) of a union whose alternatives are each an object only that requires
        the tag, its value one string of its own; None for any other node (memoized)."""
        if index in self._tag_unions:
            return self._tag_unions[index]
        alternatives = self.schema.alternatives(index)
        targets: dict[bytes, tuple[int, int]] = {}
        for a in alternatives if len(alternatives) > 1 else ():
            node = self.nodes[a]
            k = node.names.get(self.tag)
            if node.types != frozenset({"object"}) or node.enum is not None or k not in node.required:
                targets = {}
                break
            values = self.nodes[node.props[k][1]].enum
            if values is None or len(values) != 1 or not values[0].startswith(b'"'):  # one string, or no tag
                targets = {}
                break
            text = b'"' + self.tag + b'":' + values[0]
            if text in targets:
                targets = {}
                break
            targets[text] = (a, k)
        found = (tuple(sorted(targets)), targets) if targets else None
        self._tag_unions[index] = found
        return found

    def _tag_byte(self, st: tuple, top: tuple, c: int) -> list[tuple]:
        _, index, buf = top
        texts, targets = self._tag_union(index)
        key = b'"' + self.tag + b'"'
        if c in _WS:  # before the key, around the colon; in the key or the value it is refused
            return self._ws(st) if buf in (b"", key, key + b":") else []
        longer = buf + bytes((c,))
        whole = targets.get(longer)
        if whole is not None:  # string encodings end at their quote: no other text goes on from a whole one
            alternative, k = whole
            return [st[:-1] + (("o", alternative, frozenset({k}), "after", -1),)]
        at = bisect_left(texts, longer)
        return [st[:-1] + (("t", index, longer),)] if at < len(texts) and texts[at].startswith(longer) else []
