"""ToolParser: hermes and llama3_json calls read out of whole outputs, malformed ones left as content, and what a
stream may send before the output ends (hold_from)."""

from __future__ import annotations

import json
import re

import pytest

from lorafleet.worker.tool_parser import HermesParser, Llama3JsonParser, new_call_id, tool_parser

NAMES = {"get_weather", "add"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": [2, {"c": null}]}}'


def _calls(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (f"<tool_call>{WEATHER}</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n", None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f"Let me check.\n\n<tool_call>{WEATHER}</tool_call>", "Let me check.", [("get_weather", {"city": "Paris",
                                                                                             "unit": "c"})]),
    (f"  \n<tool_call>{ADD}</tool_call>", None, [("add", {"a": 1, "b": [2, {"c": None}]})]),
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{ADD}</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": [2, {"c": None}]})]),
    (f"<tool_call>{WEATHER}</tool_call><tool_call>{ADD}", None,  # the last one unclosed (a stop string)
     [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": [2, {"c": None}]})]),
    ('<tool_call>{"name": "add"}</tool_call>', None, [("add", {})]),  # no arguments: none
    ('<tool_call>{"name": "add", "arguments": {"s": "</tool>é"}}</tool_call>', None, [("add", {"s": "</tool>é"})]),
])
def test_hermes_calls(text, content, calls):
    assert _calls(HermesParser().parse(text, NAMES)) == (content, calls)


@pytest.mark.parametrize("text", [
    "just an answer",
    "",
    "<tool_call>",
    "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": ",  # cut short
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the request's tools
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as a string
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>',
    '<tool_call>["add", {}]</tool_call>',
    f"<tool_call>{WEATHER}</tool_call><tool_call>oops</tool_call>",  # one good, one bad: all content
    f"<tool_call>{WEATHER}",  # fine: unclosed, its JSON whole (checked below)
    "<tool_call>" + "[" * 100000 + "]" * 100000 + "</tool_call>",  # deeper than the JSON parser recurses
    '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>',  # Python's json reads it; JSON has no NaN
    '<tool_call>{"name": "add", "arguments": {"a": [-Infinity]}}',
])
def test_hermes_malformed_calls_stay_content(text):
    parsed = HermesParser().parse(text, NAMES)
    if text == f"<tool_call>{WEATHER}":
        assert _calls(parsed) == (None, [("get_weather", {"city": "Paris", "unit": "c"})])
    else:
        assert parsed is None


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    (' \n{"name": "add", "arguments": {"a": 1}}\n', [("add", {"a": 1})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', [("add", {"a": 1})]),
    ('{"type": "function", "name": "add", "parameters": {}}', [("add", {})]),
    ('{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
     [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),
    ('{"name": "add", "parameters": {"a": 1}};', [("add", {"a": 1})]),
])
def test_llama3_json_calls(text, calls):
    assert _calls(Llama3JsonParser().parse(text, NAMES)) == (None, calls)


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"name": "Bob", "age": 3}',  # a JSON answer, no call
    '{"name": "add", "parameters": {"a": 1}, "age": 3}',
    '{"name": "add", "parameters": {"a": 1}, "arguments": {"a": 2}}',
    '{"name": "add", "parameters": 5}',
    '{"name": "add", "parameters": {"a": 1}',  # cut short
    '{"name": "add", "parameters": {}} and more',
    '{"name": "add", "parameters": {}}; oops',
    '{"name": "unknown", "parameters": {}}',
    '{"type": "other", "name": "add", "parameters": {}}',
    'Sure: {"name": "add", "parameters": {}}',  # not the whole output
    "<|python_tag|>print(1)",  # a code call, not JSON
    '{"name": "add", "parameters": {"a": Infinity}}',  # not JSON
    '{"name": "add", "parameters": {}}; {"name": "add", "parameters": {"b": NaN}}',
    "",
])
def test_llama3_json_malformed_calls_stay_content(text):
    assert Llama3JsonParser().parse(text, NAMES) is None


@pytest.mark.parametrize("text, held", [
    ("Hello", ""),
    ("Hello ", " "),  # whitespace before a block is not content: held until text follows
    ("Hello <", " <"),
    ("Hello\n<tool_", "\n<tool_"),
    ("Hello <tool_call>{\"na", " <tool_call>{\"na"),
    ("Hello <tool_call>{} </tool_call> more", " <tool_call>{} </tool_call> more"),
    ("a<b", ""),  # "<b" cannot begin "<tool_call>"
    ("<tool_cal", "<tool_cal"),
    ("   ", "   "),
])
def test_hermes_holds_back_what_may_begin_a_call(text, held):
    cut = HermesParser().hold_from(text)
    assert text[cut:] == held


@pytest.mark.parametrize("text, is_held", [
    ("", True), ("  \n", True), ("{", True), (' {"name"', True), ("<|py", True), ("<|python_tag|>{", True),
    ("Hi", False), (" Hi {", False), ("<|pz", False), ("[1]", False),
])
def test_llama3_json_holds_the_output_while_it_may_be_a_call(text, is_held):
    assert Llama3JsonParser().hold_from(text) == (0 if is_held else len(text))


def test_call_ids_and_shape():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    _, (call,) = HermesParser().parse(f"<tool_call>{ADD}</tool_call>", NAMES)
    assert call.openai() == {"id": call.id, "type": "function",
                             "function": {"name": "add", "arguments": '{"a": 1, "b": [2, {"c": null}]}'}}


def test_auto_picks_the_parser_from_the_chat_template():
    assert tool_parser("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert tool_parser("auto", "{{ tools | tojson }}").name == "llama3_json"
    assert tool_parser("auto", None).name == "llama3_json"
    assert tool_parser("hermes", "{{ tools }}").name == "hermes"
    assert tool_parser("llama3_json", "<tool_call>").name == "llama3_json"


@pytest.mark.parametrize("text, content", [
    (f"<tool_call>{WEATHER}</tool_call> and then some text", None),
    (f"Sure. \n<tool_call>{WEATHER}</tool_call>\nI will check.\n", "Sure."),
    (f"<tool_call>{WEATHER}</tool_call> between <tool_call>{WEATHER}</tool_call>", None),
    (f"  lead <tool_call>{WEATHER}</tool_call>\n\n<tool_call>{WEATHER}", "  lead"),
    (f"<tool_call>{WEATHER}</tool_call><tool_response>{{\"temp\": 21}}</tool_response>It is 21 degrees.", None),
])
def test_hermes_text_between_or_after_the_calls_is_dropped(text, content):
    """A model that writes a sentence (or a tool result it made up) after its call still calls: the content is the
    text before the blocks, the rest is dropped, as vLLM's parser does. It used to make the whole output content."""
    parsed = HermesParser().parse(text, NAMES)
    assert parsed is not None and parsed[0] == content
    assert all(c.name == "get_weather" for c in parsed[1]) and len(parsed[1]) == text.count("<tool_call>")
