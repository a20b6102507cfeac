"""ToolRequest: a chat request's OpenAI tool fields (`tools`, `tool_choice`, `parallel_tool_calls`), validated,
and the tool calls of its history in the form chat templates take.

`tools` reaches the chat template as sent (transformers' `apply_chat_template(tools=...)` takes the same
`{"type": "function", "function": {"name", "description", "parameters"}}` entries). `tool_choice`:
"none" (the tools are still rendered, as vLLM does, but the output is never read as calls), "auto" (the
default with tools: the output is parsed for calls, tool_parser.py), or one named function (the output is
constrained to one JSON object, the JSON mode of json_guide.py, and returned as that function's
arguments). "required" is refused: the JSON constraint cannot express "an object naming one of these
tools", and answering plain text to a caller who required a call would be wrong.

An assistant message's `tool_calls` reach the template with `function.arguments` as an object, not the JSON
text the API carries: Llama 3.1's and Hermes' templates write `arguments | tojson` (a string would come out
quoted twice), Qwen's take either; vLLM converts them the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.openai_fields import Fields, bad_request, check_strings, check_text
from lorafleet.worker.tool_parser import json_value

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(slots=True)
class ToolRequest:
    tools: list[dict[str, Any]] = field(default_factory=list)  # as sent: what the chat template gets
    choice: str = "auto"  # "none" | "auto" | "named"
    function: str | None = None  # the named function of tool_choice {"type": "function", ...}
    parallel_tool_calls: bool = True  # false: at most one call (the first) per choice

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for tool calls (auto), rather than left as text or forced (named)."""
        return self.choice == "auto"


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be an object like {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                          "tools", "invalid_type")
    if set(tool) - {"type", "function"}:
        raise bad_request(f"{where} takes only 'type' and 'function' (got {', '.join(sorted(set(tool) - {'type', 'function'}))})",
                          "tools")
    fn = tool["function"]
    if unknown := sorted(set(fn) - FUNCTION_KEYS):
        raise bad_request(f"{where}.function takes only {', '.join(sorted(FUNCTION_KEYS))} (got {', '.join(unknown)})",
                          "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-' (got {json.dumps(name)})",
                          "tools")
    if not isinstance(fn.get("description"), str | None):
        raise bad_request(f"{where}.function.description must be a string", "tools", "invalid_type")
    if not isinstance(fn.get("parameters"), dict | None):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools", "invalid_type")
    if not isinstance(fn.get("strict"), bool | None):
        raise bad_request(f"{where}.function.strict must be true or false", "tools", "invalid_type")
    if fn.get("strict"):  # the arguments can be held to "a JSON object", not to a schema
        raise bad_request(f"{where}.function.strict: true is not supported by this server (the arguments are not "
                          "held to the schema); leave it out or send false", "tools", "unsupported_parameter")
    return fn


def _tools(f: Fields) -> list[dict[str, Any]]:
    v = f.get("tools")
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad_request("'tools' must be a list of function tools", "tools", "invalid_type")
    names: set[str] = set()
    for i, tool in enumerate(v):
        name = _function(tool, f"tools[{i}]")["name"]
        if name in names:
            raise bad_request(f"tools[{i}]: the function name {json.dumps(name)} is given twice; tool names must be "
                              "unique", "tools")
        names.add(name)
    check_strings(v, "tools")
    return v


def _tool_choice(v: Any, names: list[str]) -> tuple[str, str | None]:
    """`tool_choice` -> (choice, named function)."""
    if v is None:
        return ("auto" if names else "none"), None
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise bad_request(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}} (got {json.dumps(v)})", "tool_choice")
        if v == "required":
            raise bad_request("'tool_choice': \"required\" is not supported by this server yet (the output cannot be "
                              "constrained to a call of one of several tools); name the function with "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}, or send \"auto\"",
                              "tool_choice", "unsupported_parameter")
        if v == "auto" and not names:
            raise bad_request("'tool_choice' \"auto\" needs 'tools'", "tool_choice")
        return v, None
    fn = v.get("function") if isinstance(v, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(name, str) or set(v) != {"type", "function"}:
        shape = '{"type": "function", "function": {"name": ...}}'
        raise bad_request(f"'tool_choice' must be \"none\", \"auto\" or {shape} (got {json.dumps(v)})", "tool_choice",
                          "invalid_type")
    if name not in names:
        raise bad_request(f"'tool_choice' names the function {json.dumps(name)}, which is not in 'tools'"
                          + (f" ({', '.join(names)})" if names else ""), "tool_choice")
    return "named", name


def parse_tool_request(f: Fields) -> ToolRequest | None:
    """The request's tool fields; None when it sends no tools (nothing to render, nothing to parse)."""
    tools = _tools(f)
    choice, function = _tool_choice(f.get("tool_choice"), [t["function"]["name"] for t in tools])
    parallel = f.flag("parallel_tool_calls", True)
    return ToolRequest(tools, choice, function, parallel) if tools else None


def message_tool_calls(m: dict, where: str) -> list[dict[str, Any]] | None:
    """An assistant message's `tool_calls` as the chat template takes them (arguments as an object); None
    when it has none. A `function_call` (the legacy field) is refused."""
    if m.get("function_call"):
        raise bad_request(f"{where}.function_call is not supported (the legacy form of tool calls); send "
                          "'tool_calls'", "messages", "unsupported_parameter")
    calls = m.get("tool_calls")
    if not calls:  # an empty list: what a response without calls carries back into the history
        return None
    if m.get("role") != "assistant":
        raise bad_request(f"{where}.tool_calls: only an assistant message carries tool calls", "messages")
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list of calls", "messages", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" or \
                not isinstance(fn.get("name"), str) or not isinstance(call.get("id", ""), str):
            raise bad_request(f"{at} must be an object like {{\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}", "messages", "invalid_type")
        arguments = fn.get("arguments")
        parsed = json_value(arguments) if isinstance(arguments, str) else None
        if not isinstance(parsed, dict):
            raise bad_request(f"{at}.function.arguments must be the JSON text of an object (got "
                              f"{json.dumps(arguments)[:80]})", "messages")
        check_strings(parsed, "messages")
        out.append({"id": check_text(call.get("id", ""), "messages"), "type": "function",
                    "function": {"name": check_text(fn["name"], "messages"), "arguments": parsed}})
    return out
