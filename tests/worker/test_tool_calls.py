"""ToolCalls: a choice's whole message and its streamed deltas say the same, however the text is cut into
chunks; text before a hermes block streams as content at once; named functions answer their arguments."""

from __future__ import annotations

import pytest

from lorafleet.worker.completion_job import CompletionJob
from lorafleet.worker.json_schema_grammar import schema_grammar
from lorafleet.worker.openai_sampling import SamplingOptions
from lorafleet.worker.request_output import RequestOutput
from lorafleet.worker.tenants import Tenant
from lorafleet.worker.tool_calls import ToolCalls
from lorafleet.worker.tool_parser import HermesParser, Llama3JsonParser
from lorafleet.worker.tool_request import ToolRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "add"}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'

OUTPUTS = [
    ("hermes", "plain answer, no call"),
    ("hermes", "trailing space \n"),
    ("hermes", f"Adding.\n{CALL}"),
    ("hermes", f"{CALL}\n{CALL}\n"),
    ("hermes", f"Before {CALL} after"),  # text after the call: dropped
    ("hermes", f"{CALL}\nI will add them.\n{CALL} done"),
    ("hermes", "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>"),
    ("hermes", "a <tool_cal"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("llama3_json", ' {"name": "Bob"}'),
    ("llama3_json", "  The answer is 3."),
]


def _tool_calls(parser: str, **request) -> ToolCalls:
    return ToolCalls(ToolRequest(TOOLS, **request), {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[parser]())


def _streamed(calls: ToolCalls, index: int, pieces: list[str], finish_reason: str) -> tuple[str, list, str]:
    content, tool_calls, reason = "", [], None
    for k, piece in enumerate(pieces):
        sent, delta_calls, reason = calls.delta(index, piece, finish_reason if k == len(pieces) - 1 else None)
        content += sent
        tool_calls += delta_calls
    return content, tool_calls, reason


def _without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if k not in ("id", "index")} for c in calls]


@pytest.mark.parametrize("parser, text", OUTPUTS)
def test_streamed_deltas_add_up_to_the_whole_message(parser, text):
    calls = _tool_calls(parser)
    message, reason = calls.message(text, "stop")
    for size in (1, 2, 5, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        content, tool_calls, streamed_reason = _streamed(calls, 0, pieces, "stop")
        assert content == (message["content"] or "")
        assert _without_ids(tool_calls) == _without_ids(message.get("tool_calls", []))
        assert [c["index"] for c in tool_calls] == list(range(len(tool_calls)))
        assert streamed_reason == reason == ("tool_calls" if tool_calls else "stop")


LONG = "y" * 60000
LONG_OUTPUTS = [
    ("hermes", f"{LONG} {CALL}"),
    ("hermes", f'Writing.\n<tool_call>{{"name": "add", "arguments": {{"s": "{LONG}"}}}}</tool_call>'),
    ("llama3_json", f'{{"name": "add", "parameters": {{"s": "{LONG}"}}}}'),
    ("llama3_json", f"No call: {LONG}"),
]


@pytest.mark.parametrize("parser, text", LONG_OUTPUTS)
def test_a_long_stream_costs_each_chunk_its_own_length(parser, text):
    """Thousands of 4-character chunks: the deltas add up to the whole message, and the parser is shown each
    character a bounded number of times (not the whole text again per chunk)."""
    base = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[parser]
    num_scanned = 0

    class Counting(base):
        def hold_from(self, text: str, **kwargs) -> int:
            nonlocal num_scanned
            num_scanned += len(text)
            return super().hold_from(text, **kwargs)

        def call_begins(self, text: str) -> bool:
            nonlocal num_scanned
            num_scanned += len(text)
            return super().call_begins(text)

    calls = ToolCalls(ToolRequest(TOOLS), Counting())
    message, reason = calls.message(text, "stop")
    content, tool_calls, streamed_reason = _streamed(calls, 0, [text[i:i + 4] for i in range(0, len(text), 4)], "stop")
    assert (content, _without_ids(tool_calls), streamed_reason) == \
        (message["content"] or "", _without_ids(message.get("tool_calls", [])), reason)
    assert num_scanned <= 10 * len(text)


def test_text_before_a_hermes_call_streams_at_once_and_choices_are_apart():
    calls = _tool_calls("hermes")
    assert calls.delta(0, "Let me ", None) == ("Let me", [], None)  # its space may precede a call: held
    assert calls.delta(1, '{"name"', None) == ('{"name"', [], None)  # choice 1: its own text
    assert calls.delta(0, "check.\n<tool_", None) == (" check.", [], None)
    content, tool_calls, reason = calls.delta(0, 'call>{"name": "add", "arguments": {}}</tool_call>', "stop")
    assert (content, reason) == ("", "tool_calls") and tool_calls[0]["function"] == {"name": "add", "arguments": "{}"}
    assert calls.delta(1, "}", "length") == ("}", [], "length")


def test_named_function_answers_its_arguments_with_the_engines_finish_reason():
    calls = _tool_calls("hermes", choice="named", function="get_weather")
    message, reason = calls.message('{"city": "Oslo"}', "stop")
    assert (message["content"], reason) == (None, "stop")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert _streamed(calls, 0, ['{"city"', ': "Oslo"}'], "stop")[0] == ""  # nothing goes out as content
    _, streamed, reason = _streamed(calls, 2, ['{"ci'], "length")
    assert reason == "length" and streamed[0]["function"]["arguments"] == '{"ci'  # cut short, as OpenAI's


def test_a_held_named_call_streams_its_arguments_piece_by_piece():
    """Held to its function's schema, a named call's first chunk is the call (id, name, arguments so far), each
    later one only its arguments' new text; a choice's next stream starts with the call again."""
    calls = _tool_calls("hermes", choice="named", function="get_weather",
                        output_grammar=schema_grammar({"type": "object"}))
    first = calls.delta(0, '{"ci', None)
    assert first[0] == "" and first[2] is None
    ((call,),) = first[1:2]
    assert (call["index"], call["type"], call["id"][:5], call["function"]) == (0, "function", "call_",
                                                                               {"name": "get_weather",
                                                                                "arguments": '{"ci'})
    assert calls.delta(1, "{", None)[1][0]["function"]["name"] == "get_weather"  # choice 1: its own call
    assert calls.delta(0, "", None) == ("", [], None)
    assert calls.delta(0, 'ty": "Oslo"}', "stop") == ("", [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}],
                                                      "stop")
    assert calls.delta(0, "{}", "stop")[1][0]["function"] == {"name": "get_weather", "arguments": "{}"}


def test_a_held_named_calls_arguments_begin_at_their_first_character_not_whitespace():
    """The JSON grammar lets whitespace come before the object: streamed, the first argument pieces were "\n",
    "\n", and the openai SDK's `chat.completions.stream()` helper failed parsing them (EOF while parsing a value)
    for a strict tool. They are left out, streamed and whole, as OpenAI's arguments begin at the '{'."""
    calls = _tool_calls("hermes", choice="named", function="get_weather",
                        output_grammar=schema_grammar({"type": "object"}))
    pieces = ["\n", " \n", '\t{"ci', 'ty": ', '"Oslo"}']
    _, streamed, _ = _streamed(calls, 0, pieces, "stop")
    assert [c["function"]["arguments"] for c in streamed] == ["", '{"ci', 'ty": ', '"Oslo"}']
    message, _ = calls.message("".join(pieces), "stop")
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    _, streamed, _ = _streamed(calls, 1, ["\n", "\n"], "length")  # cut short before it began
    assert [c["function"]["arguments"] for c in streamed] == [""]


@pytest.mark.parametrize("text, arguments", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', '{"city": "Oslo"}'),  # the Hermes/Qwen wrapper
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', '{"city": "Oslo"}'),  # Llama's
    ('{"name": "get_weather", "arguments": {}}', "{}"),
    ('{"name": "add", "arguments": {"city": "Oslo"}}', None),  # another function's name: the arguments as written
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}, "x": 1}', None),
    ('{"name": "get_weather", "arguments": "Oslo"}', None),
    ('{"name": "get_weather", "arguments": {"a": 1}, "parameters": {}}', None),
    ('{"name": "get_weather", "arguments": {"city": "Os', None),  # cut short
])
def test_a_named_functions_call_written_whole_answers_its_arguments(text, arguments):
    calls = _tool_calls("hermes", choice="named", function="get_weather")
    message, _ = calls.message(text, "stop")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments or text}
    _, streamed, _ = _streamed(calls, 0, [text[:9], text[9:]], "stop")
    assert streamed[0]["function"]["arguments"] == (arguments or text)


REQUIRED = [  # (output, finish reason, calls (name, arguments as written), answered finish reason)
    ('[{"name": "add", "parameters": {"a": 1, "s": "x}\\"]{"}}, {"parameters": {"b": [1, {"c": 2}]}, "name": '
     '"get_weather"}]', "stop", [("add", '{"a": 1, "s": "x}\\"]{"}'), ("get_weather", '{"b": [1, {"c": 2}]}')],
     "tool_calls"),
    ('[ {\n "name" : "add" ,\n "parameters" : { } } ]', "stop", [("add", "{ }")], "tool_calls"),
    ('[{"name":"a\\u0064d","parameters":null}]', "stop", [("add", "null")], "tool_calls"),
    ('[{"name": "add", "parameters": {"a": [1, "', "length", [("add", '{"a": [1, "')], "length"),  # cut short
    ('[{"name": "get_weather", "parameters": {}}, {"param', "length", [("get_weather", "{}")], "length"),
    ('[{"parameters": {"a": 1}, "na', "length", [], "length"),  # no name yet: content
]


def _merged(deltas: list[dict]) -> list[tuple[str, str]]:
    """Streamed `tool_calls` entries put together by index: each call's name and its arguments' pieces."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["id"].startswith("call_") and d["type"] == "function"
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        calls[d["index"]][1] += d["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("text, engine_reason, expect, reason", REQUIRED)
def test_required_calls_stream_as_they_are_written_and_add_up_to_the_whole_answer(text, engine_reason, expect,
                                                                                 reason):
    calls = _tool_calls("hermes", choice="required")
    message, answered = calls.message(text, engine_reason)
    assert answered == reason
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == expect
    assert message["content"] == (None if expect else text)
    for size in (1, 3, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        content, deltas, streamed_reason = _streamed(calls, 0, pieces, engine_reason)
        assert (content, _merged(deltas), streamed_reason) == (message["content"] or "", expect, reason)
        if size == 1 and expect:  # a call goes out once its name is read, its arguments as they come
            assert len(deltas) > len(expect)


def test_a_required_call_goes_out_before_the_array_ends():
    calls = _tool_calls("hermes", choice="required")
    assert calls.delta(0, '[{"name": "ad', None) == ("", [], None)
    _, (first,), _ = calls.delta(0, 'd", "parameters": {"a"', None)
    assert first["function"] == {"name": "add", "arguments": '{"a"'} and first["index"] == 0
    assert calls.delta(0, ": 1}}", None)[1] == [{"index": 0, "function": {"arguments": ": 1}"}}]
    _, (second,), _ = calls.delta(0, ', {"name": "get_weather", "parameters": {}}]', "stop")
    assert second["index"] == 1 and second["function"] == {"name": "get_weather", "arguments": "{}"}
    assert second["id"] != first["id"]


def test_parallel_tool_calls_false_keeps_the_first_call():
    message, reason = _tool_calls("hermes", parallel_tool_calls=False).message(f"{CALL}{CALL}", "stop")
    assert len(message["tool_calls"]) == 1 and reason == "tool_calls"


def test_a_chat_jobs_answer_carries_the_calls_whole_and_streamed():
    """The job's response and chunks: choice 0 called a tool, choice 1 answered text; usage counts every token."""
    job = CompletionJob("chat", "chatcmpl-1", "m", None, [[1, 2, 3]], SamplingOptions(n=2), tenant=Tenant("t"),
                        tool_calls=_tool_calls("hermes"))
    job.add_choices(64)
    texts = [f"Sure.\n{CALL}", "No call."]
    final = {i: RequestOutput("r", [1, 2, 3], [], "", None, [7] * len(t), t, finished=True, finish_reason="stop")
             for i, t in enumerate(texts)}
    body = job.response(None, final)
    called, plain = (c["message"] for c in body["choices"])
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "stop"]
    assert called["content"] == "Sure." and called["tool_calls"][0]["function"] == {"name": "add",
                                                                                     "arguments": '{"a": 1}'}
    assert plain == {"role": "assistant", "content": "No call."}
    assert body["usage"]["completion_tokens"] == sum(map(len, texts))
    first = job.choice(None, 0, "Sure.\n<tool", None, None, delta=True, first=True)
    assert first["delta"] == {"role": "assistant", "content": "Sure."} and first["finish_reason"] is None
    last = job.choice(None, 0, texts[0][len("Sure.\n<tool"):], None, "stop", delta=True)
    assert (last["finish_reason"], set(last["delta"])) == ("tool_calls", {"tool_calls"})
    assert last["delta"]["tool_calls"][0]["index"] == 0
    whole = job.choice(None, 1, CALL, None, "stop", delta=True, first=True)  # the first chunk is the last too
    assert whole["delta"]["content"] is None and whole["delta"]["role"] == "assistant"
    assert whole["finish_reason"] == "tool_calls" and whole["delta"]["tool_calls"][0]["index"] == 0
