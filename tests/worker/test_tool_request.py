"""A chat request's tool fields: `tools`, `tool_choice` and `parallel_tool_calls` validated (400s naming the
field), and a history's tool calls as the chat template takes them."""

from __future__ import annotations

import pytest

from lorafleet.worker.openai_fields import APIError
from lorafleet.worker.openai_protocol import parse_chat_request

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ADD = {"type": "function", "function": {"name": "add"}}


def _parse(**fields):
    return parse_chat_request({"model": "m", "messages": USER} | fields)


def test_tools_and_tool_choice_are_taken():
    r = _parse(tools=[WEATHER, ADD])
    assert (r.tools.tools, r.tools.choice, r.tools.function, r.tools.names) == ([WEATHER, ADD], "auto", None,
                                                                                 ["get_weather", "add"])
    assert r.tools.parses_calls and not r.options.json_object
    r = _parse(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False)
    assert (r.tools.choice, r.tools.parallel_tool_calls, r.tools.parses_calls) == ("none", False, False)
    named = _parse(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    assert (named.tools.choice, named.tools.function) == ("named", "add")
    assert named.options.json_object  # the arguments: one JSON object
    assert _parse(tools=[], tool_choice="none").tools is None  # nothing to render
    assert _parse(tool_choice="none").tools is None
    strict_off = {"type": "function", "function": {"name": "x-y_1", "strict": False, "parameters": {}}}
    assert _parse(tools=[strict_off]).tools.names == ["x-y_1"]


@pytest.mark.parametrize("fields, skip", [
    ({}, True),
    ({"tools": [WEATHER]}, False),  # vLLM's: <tool_call> may be a special token, the parser must see it
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, False),
    ({"tools": [WEATHER], "tool_choice": "none"}, True),  # the output is not read for calls
    ({"tools": [WEATHER], "skip_special_tokens": True}, True),  # the caller's own choice is kept
    ({"tools": [WEATHER], "skip_special_tokens": None}, False),
    ({"skip_special_tokens": False}, False),
])
def test_tools_keep_special_tokens_in_the_text_unless_the_caller_says(fields, skip):
    assert _parse(**fields).options.skip_special_tokens is skip


@pytest.mark.parametrize("fields, param, code, needle", [
    ({"tools": {"name": "f"}}, "tools", "invalid_type", "must be a list"),
    ({"tools": [{"type": "function"}]}, "tools", "invalid_type", "tools[0] must be an object like"),
    ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools", "invalid_type", "tools[0]"),
    ({"tools": [WEATHER, {"type": "function", "function": {}}]}, "tools", "invalid_value", "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "invalid_value", "1 to 64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "invalid_value", "1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools", "invalid_type",
     "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools", "invalid_type",
     "description must be a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^x("}}}}}]}, "tools", "invalid_value",
     "tools[0].function.parameters: #.properties.a.pattern: a missing ')'"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object"}}}}, "response_format", "invalid_value", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "exec": "x"}}]}, "tools", "invalid_value",
     "takes only"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools", "invalid_value", "takes only"),
    ({"tools": [ADD, ADD]}, "tools", "invalid_value", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools",
     "invalid_unicode", "unpaired surrogate"),
    ({"tools": [ADD], "tool_choice": "always"}, "tool_choice", "invalid_value", "must be one of"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value", "needs 'tools'"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice",
     "invalid_value", "not in 'tools' (add)"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "add"}}, "tool_choice", "invalid_type",
     "must be"),
    ({"tools": [ADD], "tool_choice": 1}, "tool_choice", "invalid_type", "must be"),
    ({"tool_choice": "auto"}, "tool_choice", "invalid_value", "needs 'tools'"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice", "invalid_value",
     "not in 'tools'"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type", "true or false"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter", "send 'tools'"),
    ({"function_call": "auto"}, "function_call", "unsupported_parameter", "send 'tool_choice'"),
])
def test_bad_tool_fields_are_400_naming_the_field(fields, param, code, needle):
    with pytest.raises(APIError) as exc:
        _parse(**fields)
    err = exc.value
    assert (err.status, err.param, err.code) == (400, param, code) and needle in err.message, err.message


def test_history_tool_calls_reach_the_template_with_arguments_as_objects():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = parse_chat_request({"model": "m", "messages": messages, "tools": [WEATHER]})
    assert r.template_messages() == [
        {"role": "user", "content": USER[0]["content"]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]


@pytest.mark.parametrize("message, needle", [
    ({"role": "assistant", "tool_calls": {"id": "c"}}, "must be a list"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}, "tool_calls[0] must be"),
    ({"role": "assistant", "tool_calls": [{"id": 1, "function": {"name": "f", "arguments": "{}"}}]}, "must be"),
    ({"role": "assistant", "tool_calls": [{"type": "x", "function": {"name": "f", "arguments": "{}"}}]}, "must be"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, "JSON text of an object"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "JSON text of an object"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100000 + "]" * 100000}}]},
     "JSON text of an object"),  # nested past the parser's recursion limit
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": NaN}'}}]},
     "JSON text of an object"),  # Python's json reads it; JSON has no NaN
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}, "JSON text"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "only an assistant message"),
    ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, "legacy form"),
])
def test_bad_history_tool_calls_are_400(message, needle):
    with pytest.raises(APIError) as exc:
        parse_chat_request({"model": "m", "messages": [*USER, message]})
    assert (exc.value.status, exc.value.param) == (400, "messages") and needle in exc.value.message
    assert "messages[1]" in exc.value.message
