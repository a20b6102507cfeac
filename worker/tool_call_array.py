"""CallArray: a tool_choice "required" output read as it is generated, so its calls stream as they are written.

The output is held (tool_request.required_calls_schema) to a JSON array of `{"name": <a tool>, "parameters":
{...}}` objects, either key first. A call is known once its name is read; its arguments are the parameters'
text as the model wrote it, so the pieces a stream sends add up, call by call, to the whole answer's
arguments. The reader only tracks what it needs: strings and their escapes, the nesting depth (the array is
depth 1, a call's object depth 2), the keys of a call and the parameters' value, whatever its kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from lorafleet.worker.tool_parser import ToolCall, new_call_id

_WS = frozenset(" \t\n\r")


@dataclass(slots=True)
class _Item:
    name: str | None = None
    arguments: list[str] = field(default_factory=list)  # the parameters' text, a character a piece
    id: str = field(default_factory=new_call_id)
    sent: int = -1  # characters of the arguments streamed (-1: the call itself not yet)


class CallArray:
    def __init__(self) -> None:
        self.items: list[_Item] = []
        self.done = False  # the array has closed
        self._depth = 0
        self._in_string = self._escape = False
        self._text: list[str] | None = None  # a string read at a call's level: a key, or a key's string value
        self._reading = ""  # what _text is: "key" | "value"
        self._key = ""  # the call's key whose value comes next
        self._value = False  # after that key's colon, before its value
        self._capture = ""  # the parameters' value being read: "" (none) | "nested" | "scalar"
        self._cdepth, self._cin_string, self._cescape = 0, False, False

    def feed(self, text: str) -> None:
        for c in text:
            if self._capture and self._capture_char(c):
                continue
            self._char(c)

    def calls(self) -> list[ToolCall]:
        """The calls whose names are read, with their arguments so far."""
        return [ToolCall(it.name, "".join(it.arguments), it.id) for it in self.items if it.name is not None]

    def deltas(self) -> list[dict]:
        """The `delta.tool_calls` entries for what was read since the last call: a call first with its index, id,
        type, name and arguments so far, then pieces of its arguments."""
        out = []
        for k, it in enumerate(self.items):
            if it.name is None:
                continue
            new = "".join(it.arguments[max(it.sent, 0):])
            if it.sent < 0:
                out.append({"index": k} | ToolCall(it.name, new, it.id).openai())
            elif new:
                out.append({"index": k, "function": {"arguments": new}})
            it.sent = len(it.arguments)
        return out

    def _capture_char(self, c: str) -> bool:
        """Read `c` as part of the parameters' value; False where a scalar value ended before it."""
        if self._capture == "scalar" and (c in _WS or c in ",}"):
            self._capture = ""
            return False
        self.items[-1].arguments.append(c)
        if self._cin_string:
            self._cescape, closed = _string_char(self._cescape, c)
            self._cin_string = not closed
        elif c == '"':
            self._cin_string = True
        elif c in "[{":
            self._cdepth += 1
        elif c in "]}":
            self._cdepth -= 1
        if self._capture == "nested" and not self._cin_string and self._cdepth == 0:
            self._capture = ""
        return True

    def _char(self, c: str) -> None:
        if self._in_string:
            self._escape, closed = _string_char(self._escape, c)
            if closed:
                self._in_string = False
                if self._text is not None:
                    self._read(json.loads('"' + "".join(self._text) + '"'))
                    self._text = None
                return
            if self._text is not None:
                self._text.append(c)
            return
        if c in _WS:
            return
        if self._depth == 2 and self._value:  # a value of the call begins
            self._value = False
            if self._key == "parameters":
                self._capture = "scalar" if c not in '[{"' else "nested"
                self._cdepth, self._cin_string, self._cescape = 0, False, False
                self._capture_char(c)
                return
            if c == '"':
                self._in_string, self._text, self._reading = True, [], "value"
                return
        if c == '"':
            self._in_string = True
            if self._depth == 2:
                self._text, self._reading = [], "key"
        elif c in "[{":
            self._depth += 1
            if self._depth == 2 and c == "{":
                self.items.append(_Item())
        elif c in "]}":
            self._depth -= 1
            self.done = self._depth == 0
        elif c == ":" and self._depth == 2:
            self._value = True

    def _read(self, text: str) -> None:
        if self._reading == "key":
            self._key = text
        elif self._key == "name" and self.items:
            self.items[-1].name = text


def _string_char(escape: bool, c: str) -> tuple[bool, bool]:
    """Character `c` inside a JSON string: (an escape pending after it, whether it closed the string)."""
    if escape:
        return False, False
    return c == "\\", c == '"'
