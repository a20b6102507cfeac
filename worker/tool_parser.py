"""ToolParser: tool calls read out of a model's text, in the formats of vLLM's `hermes` and `llama3_json` parsers.

hermes (Hermes 2 Pro, Qwen 2.5/3 and most templates that write `<tool_call>`): after optional text, one or more
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the last one may be left unclosed (a stop
string or EOS right after its JSON). The text before the first block is the message's content (its trailing
whitespace dropped; none left: null). Text between or after the blocks (a model's "I will check the weather."
after its call, or a tool result it made up) is dropped, as vLLM's parser drops it: it used to turn the calls into
plain content.

llama3_json (Llama 3.1/3.2's JSON tool calls): the whole output is one JSON object `{"name": ...,
"parameters": {...}}` ("arguments" is taken too), or several separated by ';', optionally after
`<|python_tag|>`; the content is null.

An output that does not have that shape (a block whose JSON does not parse, NaN and Infinity included, a name
that is not one of the request's tools, arguments that are not an object; for llama3_json, other text between or
after the calls) is no call at all: all of it stays content, so a malformed call reaches the caller as the text it was, never as an error.

`hold_from` is the streaming side: how much of the text not sent yet can go out as content now, because no
later text can make it part of a call; `call_begins`: when a call has begun, so that the rest is held without
looking at it again. Running example (hermes): "Sure.\\n<tool_" holds "\\n<tool_" back (it may
begin a block; the whitespace before a block is not content) and sends "Sure."; llama3_json holds the whole
output while it starts with '{' (or the python tag).
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits, as vLLM's (and OpenAI's) call ids."""
    return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text of the arguments
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict[str, Any]:
        """The call as a message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_call(obj: Any, names: Collection[str], arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """`{"name": tool, <an arguments key>: {...}}` (arguments absent: none, `{}`) as a call; None otherwise.
    Other keys make it no call (a JSON answer that happens to hold a "name"), but Llama's `"type": "function"`."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    if set(obj) - {"name", "type", *arguments_keys} or obj.get("type", "function") != "function":
        return None
    given = [k for k in arguments_keys if k in obj]
    if len(given) > 1:
        return None
    arguments = obj[given[0]] if given else {}
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # Python's json reads NaN and Infinity; a caller's parser would not


def json_value(text: str) -> Any:
    """The JSON value `text` holds; None for text that is not JSON (NaN and Infinity included), or nested too
    deep for the parser."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return None


class ToolParser(ABC):
    name = ""

    @abstractmethod
    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]] | None:
        """(content, calls) of a whole output, or None when it holds no well-formed call of one of `names`."""

    @abstractmethod
    def hold_from(self, text: str, *, at_start: bool = True) -> int:
        """How many leading characters of `text` are content whatever follows. `text`: the output not sent yet
        (`at_start`: all of it; otherwise what follows the content sent)."""

    @abstractmethod
    def call_begins(self, text: str) -> bool:
        """Whether `text`, held back by hold_from, begins a call: it and all that follows is held to the end
        (a stream then stops asking hold_from, so each chunk costs its own length)."""


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]] | None:
        start = text.find(HERMES_START)
        if start < 0:
            return None
        calls, at = [], start
        while at >= 0:  # text[at:] starts with HERMES_START
            body_at = at + len(HERMES_START)
            end = text.find(HERMES_END, body_at)
            call = read_call(json_value(text[body_at:] if end < 0 else text[body_at:end]), names, ("arguments",))
            if call is None:
                return None
            calls.append(call)
            if end < 0:  # unclosed: its JSON ran to the end of the text
                break
            at = text.find(HERMES_START, end + len(HERMES_END))
        return text[:start].rstrip() or None, calls

    def hold_from(self, text: str, *, at_start: bool = True) -> int:  # the same wherever text starts
        cut = text.find(HERMES_START)
        if cut < 0:  # the longest end of the text that may begin HERMES_START
            cut = next((len(text) - k for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1)
                        if HERMES_START.startswith(text[-k:])), len(text))
        return len(text[:cut].rstrip())

    def call_begins(self, text: str) -> bool:
        return HERMES_START in text


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]] | None:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        decoder, calls, at = json.JSONDecoder(parse_constant=_not_json), [], 0
        while True:
            try:
                obj, end = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return None
            call = read_call(obj, names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            at = _skip_space(body, end)
            if at < len(body) and body[at] == ";":
                at = _skip_space(body, at + 1)
            elif at < len(body):
                return None
            if at == len(body):
                return None, calls

    def hold_from(self, text: str, *, at_start: bool = True) -> int:
        body = text.lstrip()
        may_call = at_start and (not body or body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body))
        return 0 if may_call else len(text)

    def call_begins(self, text: str) -> bool:
        return text.lstrip().startswith(("{", PYTHON_TAG))


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name` ("hermes", "llama3_json"), or for "auto" the one the chat template's text calls for:
    hermes when it writes `<tool_call>`, llama3_json otherwise."""
    if name == "auto":
        name = "hermes" if chat_template and HERMES_START in chat_template else "llama3_json"
    return PARSERS[name]()
