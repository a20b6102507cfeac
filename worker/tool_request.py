"""ToolRequest: a chat request's OpenAI tool fields (`tools`, `tool_choice`, `parallel_tool_calls`), validated,
and the tool calls of its history in the form chat templates take.

`tools` reaches the chat template as sent (transformers' `apply_chat_template(tools=...)` takes the same
`{"type": "function", "function": {"name", "description", "parameters"}}` entries). `tool_choice`:
"none" (the tools are still rendered, as vLLM does, but the output is never read as calls), "auto" (the
default with tools: the output is parsed for calls, tool_parser.py), one named function (the output is held
to that function's `parameters` schema, json_schema.py, and returned as its arguments), or "required" (the
output is held to a JSON array of calls, `[{"name": <a tool>, "parameters": {...}}, ...]`, one call at most
with `parallel_tool_calls: false`, each call's parameters to its tool's schema: vLLM's form of it).

A function's `parameters` schema is enforced where the schema compiles (json_schema.py: the keywords it
enforces); one that does not is held to "a JSON object" instead, unless the function says `strict: true`,
which then answers 400 naming what cannot be enforced. With tool_choice "auto" the model's calls are not
constrained while sampled: a call to a strict function whose arguments its schema refuses stays content,
as a malformed call does, so the calls a caller gets always fit their strict schemas.

An assistant message's `tool_calls` reach the template with `function.arguments` as an object, not the JSON
text the API carries: Llama 3.1's and Hermes' templates write `arguments | tojson` (a string would come out
quoted twice), Qwen's take either; vLLM converts them the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.json_schema import SchemaError
from lorafleet.worker.json_schema_grammar import SchemaGrammar, schema_grammar
from lorafleet.worker.openai_fields import Fields, bad_request, check_strings, check_text
from lorafleet.worker.tool_parser import json_value

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(slots=True)
class ToolRequest:
    tools: list[dict[str, Any]] = field(default_factory=list)  # as sent: what the chat template gets
    choice: str = "auto"  # "none" | "auto" | "required" | "named"
    function: str | None = None  # the named function of tool_choice {"type": "function", ...}
    parallel_tool_calls: bool = True  # false: at most one call (the first) per choice
    grammars: dict[str, SchemaGrammar | None] = field(default_factory=dict)  # name -> its parameters' (None: any object)
    strict: frozenset[str] = frozenset()  # the functions with `strict: true`
    # required / named: the grammar the output is held to (None for a named function whose schema did not compile:
    # any JSON object)
    output_grammar: SchemaGrammar | None = None

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
        if v == "auto" and not names:
            raise bad_request("'tool_choice' \"auto\" needs 'tools'", "tool_choice")
        return v, None
    fn = v.get("function") if isinstance(v, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(name, str) or set(v) != {"type", "function"}:
        shape = '{"type": "function", "function": {"name": ...}}'
        raise bad_request(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {shape} (got {json.dumps(v)})", "tool_choice",
                          "invalid_type")
    if name not in names:
        raise bad_request(f"'tool_choice' names the function {json.dumps(name)}, which is not in 'tools'"
                          + (f" ({', '.join(names)})" if names else ""), "tool_choice")
    return "named", name


def parse_tool_request(f: Fields) -> ToolRequest | None:
    """The request's tool fields; None when it sends no tools (nothing to render, nothing to parse)."""
    tools = _tools(f)
    choice, function = _tool_choice(f.get("tool_choice"), [t["function"]["name"] for t in tools])
    if choice == "required" and not tools:
        raise bad_request("'tool_choice' \"required\" needs 'tools'", "tool_choice")
    parallel = f.flag("parallel_tool_calls", True)
    if not tools:
        return None
    request = ToolRequest(tools, choice, function, parallel)
    for i, tool in enumerate(tools):
        fn = tool["function"]
        request.grammars[fn["name"]] = _parameters_grammar(fn, f"tools[{i}].function.parameters")
    request.strict = frozenset(t["function"]["name"] for t in tools if t["function"].get("strict"))
    if choice == "named":
        request.output_grammar = request.grammars[function]
    elif choice == "required":
        try:
            # Each call read name first: one reading from its name on, however many tools (json_schema_tag_reader.py).
            request.output_grammar = schema_grammar(required_calls_schema(tools, request.grammars, parallel),
                                                    tag=b"name")
        except SchemaError as exc:  # each tool compiled alone, but not all of them together (the bounds)
            raise bad_request(f"'tools' with tool_choice \"required\": {exc}", "tools") from None
    return request


def _parameters_grammar(fn: dict[str, Any], where: str) -> SchemaGrammar | None:
    """A function's parameters schema (none given: no arguments, `{}`) as a grammar; None where it cannot be
    enforced, or a 400 for a strict function."""
    try:
        grammar = schema_grammar(_parameters(fn))
        if not grammar.schema.takes_only_objects():
            raise SchemaError("#: the arguments of a function are an object; this schema also takes other values")
        return grammar
    except SchemaError as exc:
        if fn.get("strict"):
            raise bad_request(f"{where}: {exc} (the function says strict: true)", "tools") from None
        return None


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn["parameters"] if fn.get("parameters") is not None else {"type": "object", "properties": {}}


def required_calls_schema(tools: list[dict[str, Any]], grammars: dict[str, SchemaGrammar | None],
                          parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one call (or more with parallel calls), each a tool's name and
    parameters. Each tool's schema is placed under $defs, its own references (`#/...`) moved there."""
    defs, alternatives = {}, []
    for k, tool in enumerate(tools):
        fn = tool["function"]
        params = _parameters(fn) if grammars[fn["name"]] is not None else {"type": "object"}
        defs[f"p{k}"] = _moved_refs(params, f"#/$defs/p{k}")
        alternatives.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                              "parameters": {"$ref": f"#/$defs/p{k}"}},
                             "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": alternatives},
            "$defs": defs}


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # keywords whose values are {name: schema}
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keywords whose values are [schema, ...]
SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")  # keywords whose value is a schema


def _moved_refs(schema: Any, base: str) -> Any:
    """`schema` with its references inside itself (`#`, `#/...`) made relative to `base`, where it now lies.
    Only schema positions are walked: a `const`, `enum` or `default` value holding a "$ref" key is data."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _moved_refs(s, base) for name, s in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_moved_refs(s, base) for s in schema[key]]
    for key in SCHEMA_VALUES:
        if key in schema:
            out[key] = _moved_refs(schema[key], base)
    return out


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
