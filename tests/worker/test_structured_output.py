"""Structured output over HTTP (a worker on 127.0.0.1, the tiny model, the official `openai` client): a
`json_schema` response format on both endpoints, whole and streamed; the client's `parse` with a pydantic
model; tool_choice "required" and a named function held to the tools' parameters schemas; strict functions'
calls checked under "auto"; schemas that cannot be enforced answered 400. The byte tokenizer makes every
byte a token, so the grammar decides each byte of the output (the random model's choice among them)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tokenizers import Tokenizer

from lorafleet.worker.json_schema_grammar import schema_grammar
from lorafleet.worker.openai_fields import Fields
from lorafleet.worker.tool_calls import ToolCalls
from lorafleet.worker.tool_parser import tool_parser
from lorafleet.worker.tool_request import ToolRequest, parse_tool_request
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)
from tests.worker.conftest import EOS_ID
from tests.worker.test_openai_tools import USER, _api, _streamed, with_template

openai = pytest.importorskip("openai")

REPORT = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"},
                                           "unit": {"enum": ["C", "F"]}, "rain": {"type": ["boolean", "null"]}},
          "required": ["city", "temp", "unit"]}
# The tools' names only reach the prompt (TEMPLATE): the byte tokenizer makes each byte a token of a 512 context.
TEMPLATE = ("{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "strict": True, "parameters": {
    "type": "object", "properties": {"c": {"type": "string"}, "d": {"type": "integer"}}, "required": ["c", "d"],
    "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
SCHEMAS = {"weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}


@pytest.fixture
def tools_model(tiny_llama_dir, tmp_path):
    return with_template(tiny_llama_dir, tmp_path, TEMPLATE)


@pytest.fixture
async def api(aiohttp_client, tools_model):
    return await _api(aiohttp_client, tools_model)


@pytest.fixture
def bias(tools_model):
    """EOS as soon as the value is complete, and strings and numbers kept short: most choices end."""
    tok = Tokenizer.from_file(str(tools_model / "tokenizer.json"))
    return {str(EOS_ID): 100} | {str(tok.token_to_id(ch)): b for ch, b in (('"', 5), (",", 3), ("}", 3), ("]", 5))}


def _check(text: str, finish_reason: str, schema: dict) -> bool:
    """A finished output is a value the schema takes; one cut short is a prefix of one. -> finished."""
    grammar = schema_grammar(schema)
    state = grammar.advance(grammar.start, text.encode())
    assert state is not None, text
    if finish_reason == "length":
        assert not grammar.is_complete(state)
        return False
    assert finish_reason == "stop" and grammar.is_complete(state), (finish_reason, text)
    jsonschema.Draft202012Validator(schema).validate(json.loads(text))
    return True


async def test_a_json_schema_response_format_holds_both_endpoints_whole_and_streamed(api, bias):
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    body = {"model": "tiny", "n": 4, "seed": 2, "max_tokens": 96, "logit_bias": bias}
    chat = await api.chat.completions.create(messages=USER, response_format=fmt, **body)
    assert sum(_check(c.message.content, c.finish_reason, REPORT) for c in chat.choices) >= 2
    streamed = await _streamed(await api.chat.completions.create(messages=USER, response_format=fmt, stream=True, **body))
    assert [(s["content"], s["finish_reason"]) for s in streamed] == [(c.message.content, c.finish_reason)
                                                                      for c in chat.choices]
    lorax = {"type": "json_object", "schema": REPORT}  # LoRAX's form of the same request
    for form in (fmt, lorax):
        done = await api.completions.create(prompt="Report:", extra_body={"response_format": form}, **body)
        assert sum(_check(c.text, c.finish_reason, REPORT) for c in done.choices) >= 2
    again = await api.completions.create(prompt="Report:", extra_body={"response_format": lorax}, **body)
    assert [c.text for c in again.choices] == [c.text for c in done.choices]  # seeded


async def test_the_clients_parse_gets_a_pydantic_model(api, bias):
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        days: list[int]
        sunny: bool | None

    parsed = await _parsed(api, Forecast, bias, seeds=8, max_tokens=128)
    assert len(parsed) >= 3 and all(isinstance(p, Forecast) for p in parsed)


async def _parsed(api, model, bias, seeds: int, max_tokens: int) -> list:
    """The parsed answers of `parse(response_format=model)` over several seeds (those cut short skipped)."""
    parsed = []
    for seed in range(seeds):
        try:
            resp = await api.chat.completions.parse(model="tiny", messages=USER, response_format=model, seed=seed,
                                                    max_tokens=max_tokens, logit_bias=bias)
        except openai.LengthFinishReasonError:
            continue
        parsed.append(resp.choices[0].message.parsed)
    return parsed


async def test_the_clients_parse_holds_a_models_bounds_and_lengths(api, bias):
    """Field(ge, le, gt, lt, min_length, max_length): every answer parses (the grammar holds them while sampling)."""
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Rating(BaseModel):
        stars: Annotated[int, Field(ge=1, le=5)]
        share: Annotated[float, Field(gt=0, lt=1)]
        code: Annotated[str, Field(min_length=3, max_length=3)]

    parsed = await _parsed(api, Rating, bias, seeds=6, max_tokens=96)
    assert len(parsed) >= 3
    assert all(1 <= r.stars <= 5 and 0 < r.share < 1 and len(r.code) == 3 for r in parsed)


async def test_required_tool_choice_answers_calls_to_the_tools_whole_and_streamed(api, bias):
    body = {"model": "tiny", "messages": USER, "tools": [WEATHER, ADD], "tool_choice": "required", "n": 4, "seed": 3,
            "max_tokens": 128, "logit_bias": bias}
    resp = await api.chat.completions.create(**body)
    called = 0
    for choice in resp.choices:
        if choice.finish_reason == "length":  # cut short: the calls begun, or the array so far as content
            assert choice.message.tool_calls or choice.message.content.lstrip().startswith("[")
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            called += 1
    assert called >= 2
    streamed = await _streamed(await api.chat.completions.create(**body, stream=True))
    for got, choice in zip(streamed, resp.choices, strict=True):  # each call streams: itself, then its arguments
        # (in how many pieces depends on how far the engine ran ahead of this reader: test_tool_calls.py's)
        assert got["finish_reason"] == choice.finish_reason and got["content"] == (choice.message.content or "")
        calls: dict[int, list] = {}
        for delta in got["tool_calls"]:
            if delta["index"] not in calls:
                assert delta["id"].startswith("call_") and delta["type"] == "function"
                calls[delta["index"]] = [delta["function"]["name"], ""]
            else:
                assert delta["id"] is None and delta["function"]["name"] is None
            calls[delta["index"]][1] += delta["function"]["arguments"]
        assert list(calls) == list(range(len(calls)))
        assert [tuple(c) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                     for c in choice.message.tool_calls or []]
    one = await api.chat.completions.create(**body | {"parallel_tool_calls": False})
    assert all(len(c.message.tool_calls) == 1 for c in one.choices if c.finish_reason == "tool_calls")


async def test_a_named_functions_arguments_hold_its_schema(api, bias):
    body = {"model": "tiny", "messages": USER, "tools": [WEATHER, ADD], "n": 4, "seed": 4, "max_tokens": 96,
            "logit_bias": bias, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    resp = await api.chat.completions.create(**body)
    done = [c for c in resp.choices if c.finish_reason == "stop"]
    assert len(done) >= 2
    for choice in done:
        (call,) = choice.message.tool_calls
        assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])


def test_a_strict_functions_call_that_its_schema_refuses_stays_content():
    """tool_choice "auto" does not constrain sampling, so a strict function's calls are checked once parsed."""
    request = parse_tool_request(Fields({"tools": [WEATHER, ADD]}, "chat"))
    calls = ToolCalls(request, tool_parser("hermes", ""))
    fits = '<tool_call>{"name": "weather", "arguments": {"c": "Oslo", "d": 2}}</tool_call>'
    content, (call,), reason = calls.calls(fits, "stop")
    assert (content, call.name, json.loads(call.arguments), reason) == (None, "weather", {"c": "Oslo", "d": 2}, "tool_calls")
    for refused in ('{"c": "Oslo"}', '{"c": "Oslo", "d": 1.5}', '{"c": "Oslo", "d": 2, "x": 1}'):
        text = f'<tool_call>{{"name": "weather", "arguments": {refused}}}</tool_call>'
        assert calls.calls(text, "stop") == (text, [], "stop")
    loose = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'  # add is not strict
    assert calls.calls(loose, "stop")[1][0].name == "add"


def test_a_function_whose_schema_cannot_be_enforced_is_held_to_an_object_unless_strict():
    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "object", "dependentRequired": {"a": ["b"]}}}}}}
    request = parse_tool_request(Fields({"tools": [loose], "tool_choice": "required"}, "chat"))
    assert request.grammars["f"] is None and request.output_grammar is not None
    grammar = request.output_grammar
    assert grammar.validates([{"name": "f", "parameters": {"anything": [1]}}])
    assert not grammar.validates([]) and not grammar.validates([{"name": "g", "parameters": {}}])
    named = parse_tool_request(Fields({"tools": [loose], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "chat"))
    assert named.output_grammar is None  # JSON mode: one JSON object
    assert isinstance(ToolRequest([loose]).grammars, dict)


async def test_schemas_that_cannot_be_enforced_are_400s_naming_why(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"code": {"type": "object", "dependentRequired": {"a": ["b"]}}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model="tiny", messages=USER, response_format=fmt)
    body = err.value.body
    assert (body["param"], body["code"]) == ("response_format", "invalid_value")
    assert "#.properties.code: dependentRequired cannot be enforced" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(model="tiny", prompt="x", extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "number"}}}})
    assert "top-level schema may describe a number" in err.value.body["message"]
    resp = await api.chat.completions.create(model="tiny", messages=USER, max_tokens=2)  # the worker serves on
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_required_keeps_data_that_looks_like_a_reference_and_refuses_a_union_too_big():
    """Each tool's schema moves under $defs with its own references rewritten, but a const holding a "$ref" key
    is data. Tools that each compile but together pass the schema bounds are a 400 naming 'tools'."""
    from lorafleet.worker.openai_fields import APIError

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "k": {"const": {"$ref": "#/x"}}, "t": {"$ref": "#/$defs/t"}}, "$defs": {"t": {"type": "boolean"}}}}}
    grammar = parse_tool_request(Fields({"tools": [tool], "tool_choice": "required"}, "chat")).output_grammar
    assert grammar.validates([{"name": "f", "parameters": {"k": {"$ref": "#/x"}, "t": True}}])
    assert not grammar.validates([{"name": "f", "parameters": {"k": {"$ref": "#/$defs/p0/x"}}}])
    assert not grammar.validates([{"name": "f", "parameters": {"t": 1}}])
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": "null"} for j in range(100)}}}} for i in range(50)]
    with pytest.raises(APIError) as err:
        parse_tool_request(Fields({"tools": many, "tool_choice": "required"}, "chat"))
    assert err.value.param == "tools" and "the schema has more than 2048 parts" in err.value.message


def test_required_reads_each_call_name_first_so_any_number_of_tools_stays_one_reading():
    """The calls' union has one object per tool: read as any union, 65 tools were past the grammar's 64
    readings at a call's `{` (a 400 telling the caller to change a union it never wrote), and 17 tools whose
    parameters were each a union of 4 objects failed a request mid-way when the model wrote the parameters before
    the name. Each call is read name first: one reading from its name on. The same schema sent by a caller is
    still read in any key order."""
    from lorafleet.worker.json_schema_grammar import schema_grammar
    from lorafleet.worker.tool_request import required_calls_schema

    def tools(count: int, parameters: dict) -> list[dict]:
        return [{"type": "function", "function": {"name": f"f{i}", "parameters": parameters}} for i in range(count)]

    def walk(grammar, text: bytes):
        state, most = grammar.start, 1
        for i in range(len(text)):
            state = grammar.advance(state, text[i:i + 1])
            if state is None:
                return None, most
            most = max(most, 1 if grammar.is_complete(state) else len(state))
        return state, most

    many = parse_tool_request(Fields({"tools": tools(128, {"type": "object", "properties": {
        "x": {"type": "integer"}}}), "tool_choice": "required"}, "chat")).output_grammar
    for text in (b'[{"name":"f77","parameters":{"x":3}}]', b'[ {\n "name" : "f1" , "parameters": {} },{"name":"f10",'
                 b'"parameters":{"x":1}}]', b'[{"name":"f127","parameters":{}}]'):
        state, most = walk(many, text)
        assert many.is_complete(state) and most == 1, text
    for refused in (b'[{"parameters":', b'[{"name":"f128"', b'[{"name":"f1","name"', b'[{ "na me"', b'[{}'):
        assert walk(many, refused)[0] is None, refused

    union = {"anyOf": [{"type": "object", "properties": {"k": {"const": k}}, "required": ["k"]} for k in "abcd"]}
    ambiguous = tools(17, {"type": "object", "properties": {"a": union}})
    output = parse_tool_request(Fields({"tools": ambiguous, "tool_choice": "required"}, "chat")).output_grammar
    state, most = walk(output, b'[{"name":"f16","parameters":{"a":{"k":"c"}}}]')
    assert output.is_complete(state) and most <= 4
    schema = required_calls_schema(ambiguous, {f"f{i}": schema_grammar(ambiguous[i]["function"]["parameters"])
                                               for i in range(17)}, True)
    as_sent = schema_grammar(schema)  # a caller's own schema: any key order, each tool a reading
    assert as_sent.is_complete(walk(as_sent, b'[{"parameters":{},"name":"f3"}]')[0])
    assert output.key != as_sent.key  # their masks are cached apart

    # Only the calls are read name first: a union in a tool's own parameters keeps every key order, and a tag
    # that is an enum of several names (no one constant) is no tag.
    shape = {"anyOf": [{"type": "object", "properties": {"name": {"enum": ["circle", "disk"]}, "r": {"type": "integer"}},
                        "required": ["name", "r"]},
                       {"type": "object", "properties": {"name": {"const": "square"}, "side": {"type": "integer"}},
                        "required": ["name", "side"]}]}
    draw = [{"type": "function", "function": {"name": "draw", "parameters": {"type": "object", "properties": {
        "shape": shape}}}}, *tools(2, {"type": "object"})]
    output = parse_tool_request(Fields({"tools": draw, "tool_choice": "required"}, "chat")).output_grammar
    for text in (b'[{"name":"draw","parameters":{"shape":{"name":"circle","r":1}}}]',
                 b'[{"name":"draw","parameters":{"shape":{"r":1,"name":"disk"}}}]',
                 b'[{"name":"draw","parameters":{"shape":{"side":2,"name":"square"}}}]'):
        assert output.is_complete(walk(output, text)[0]), text


def test_parameters_that_take_more_than_objects_are_held_to_an_object_unless_strict():
    from lorafleet.worker.openai_fields import APIError

    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": ["object", "null"]}}}
    request = parse_tool_request(Fields({"tools": [loose], "tool_choice": "required"}, "chat"))
    assert request.grammars["f"] is None and not request.output_grammar.validates([{"name": "f", "parameters": None}])
    with pytest.raises(APIError) as err:
        parse_tool_request(Fields({"tools": [loose | {"function": loose["function"] | {"strict": True}}]}, "chat"))
    assert err.value.param == "tools" and "the arguments of a function are an object" in err.value.message


def test_a_named_function_held_to_its_schema_answers_the_output_as_is():
    """Unwrapping {"name", "arguments"} is for outputs held to "a JSON object" only: a schema whose own
    properties are name and arguments gets them back untouched."""
    fn = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {
        "name": {"type": "string"}, "arguments": {"type": "object"}}, "required": ["name", "arguments"],
        "additionalProperties": False}}}
    request = parse_tool_request(Fields({"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "f"}}},
                                        "chat"))
    text = '{"name": "f", "arguments": {"x": 1}}'
    _, (call,), _ = ToolCalls(request, tool_parser("hermes", "")).calls(text, "stop")
    assert call.arguments == text


def test_only_the_calls_answered_are_checked_against_strict_schemas():
    """With parallel_tool_calls false only the first call is answered: a second one its schema refuses does not
    turn the first into content."""
    request = parse_tool_request(Fields({"tools": [WEATHER, ADD], "parallel_tool_calls": False}, "chat"))
    text = ('<tool_call>{"name": "weather", "arguments": {"c": "Oslo", "d": 2}}</tool_call>'
            '<tool_call>{"name": "weather", "arguments": {"c": "Oslo"}}</tool_call>')
    content, calls, reason = ToolCalls(request, tool_parser("hermes", "")).calls(text, "stop")
    assert [c.name for c in calls] == ["weather"] and reason == "tool_calls"


CHOICES = ["sunny", "rain", "snow storm", "é"]


async def test_vllms_guided_fields_hold_the_output(api, bias):
    """guided_regex / structured_outputs.regex and guided_grammar / structured_outputs.grammar (GBNF): the whole
    text matches (a stop token may end a match that could go on); guided_choice / structured_outputs.choice: the text is one of the choices; guided_json (a schema or its
    text) and structured_outputs.json: as response_format json_schema."""
    body = {"model": "tiny", "n": 4, "seed": 6, "max_tokens": 96, "logit_bias": bias}
    for pattern, extra in ((r"[0-9]{3}-[a-c]{2}", "guided_regex"), (r"(sun|rain)( again)?", "structured_outputs")):
        extra = {extra: pattern if extra == "guided_regex" else {"regex": pattern}}
        resp = await api.completions.create(prompt="Code:", extra_body=extra, **body)
        assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in resp.choices), resp.choices
        chat = await api.chat.completions.create(messages=USER, extra_body=extra, stream=True, **body)
        assert all(re.fullmatch(pattern, s["content"]) for s in await _streamed(chat))
    from lorafleet.worker.gbnf import GrammarMachine

    sql = 'root ::= "SELECT " col (", " col){0,2} " FROM " table\ncol ::= "id" | "name" | "*"\ntable ::= [a-z]{1,8}'
    for extra in ({"guided_grammar": sql}, {"structured_outputs": {"grammar": sql}}):
        resp = await api.completions.create(prompt="Query:", extra_body=extra, **body)
        assert all(GrammarMachine(sql).matches(c.text) and c.finish_reason == "stop" for c in resp.choices)
        chat = await api.chat.completions.create(messages=USER, extra_body=extra, stream=True, **body)
        assert all(GrammarMachine(sql).matches(s["content"]) for s in await _streamed(chat))
    for extra in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
        resp = await api.completions.create(prompt="Weather:", extra_body=extra, **body)
        assert all(c.text in CHOICES and c.finish_reason == "stop" for c in resp.choices)
        chat = await api.chat.completions.create(messages=USER, extra_body=extra, **body)
        assert all(c.message.content in CHOICES for c in chat.choices)
    for extra in ({"guided_json": REPORT}, {"guided_json": json.dumps(REPORT)}, {"structured_outputs": {"json": REPORT}}):
        resp = await api.completions.create(prompt="Report:", extra_body=extra, **body)
        assert sum(_check(c.text, c.finish_reason, REPORT) for c in resp.choices) >= 2
    resp = await api.completions.create(prompt="x", extra_body={"structured_outputs": {"json_object": True},
                                                                "guided_decoding_backend": "xgrammar"}, **body)
    assert all(c.text.lstrip().startswith("{") for c in resp.choices)


@pytest.mark.parametrize("extra, param, needle", [
    ({"guided_regex": "(a"}, "guided_regex", "a missing ')'"),
    ({"guided_regex": 5}, "guided_regex", "must be a regular expression"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "the rule 'x' is used but not defined"),
    ({"guided_grammar": "start: \"a\""}, "guided_grammar", "a Lark rule"),
    ({"guided_grammar": "root ::= root \"a\" | \"b\""}, "guided_grammar", "left-recursive (root -> root"),
    ({"structured_outputs": {"regex": "(a)\\1"}}, "structured_outputs", "the escape '\\1' is not supported"),
    ({"structured_outputs": {"grammar": 5}}, "structured_outputs", "must be a GBNF grammar"),
    ({"structured_outputs": {"grammar": "root ::= [a-z]+", "regex": "a"}}, "structured_outputs", "takes one of"),
    ({"guided_choice": ["yes", "yes!"]}, "guided_choice", '"yes" is the start of "yes!"'),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["a"], "guided_json": {"type": "object"}}, "guided_choice", "send one of"),
    ({"guided_json": "{not json"}, "guided_json", "must be a JSON schema"),
    ({"guided_json": {"type": "integer"}}, "guided_json", "top-level schema may describe a number"),
    ({"guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern", "not supported"),
])
async def test_vllms_guided_fields_that_cannot_be_held_are_400s(api, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body


def test_a_choice_grammar_and_its_masks():
    from lorafleet.worker.choice_grammar import DONE, ChoiceGrammar
    from lorafleet.worker.json_vocab import JsonVocab

    grammar = ChoiceGrammar(CHOICES)
    assert grammar.advance(grammar.start, b"snow storm") == DONE and grammar.advance(grammar.start, b"snow") == b"snow"
    assert grammar.advance(grammar.start, b"snowy") is None and grammar.advance(DONE, b" ") is None
    assert grammar.advance(grammar.start, "é".encode()) == DONE and grammar.advance(grammar.start, b"\xc3") == b"\xc3"
    pieces = [b"s", b"sn", b"ow", b" ", b" storm", b"\tstorm", b"rain", b"r", b"ain", b"\xc3", b"\xa9", b"sunny", b"x"]
    vocab = JsonVocab(pieces)
    for prefix in (b"", b"s", b"snow", b"snow ", b"r", b"\xc3"):
        state = grammar.advance(grammar.start, prefix)
        invalid, _ = vocab.mask(state, True, grammar)
        assert (~invalid).tolist() == [vocab.accepts(state, t, True, grammar) for t in range(len(pieces))], prefix


@pytest.mark.parametrize("extra, param, needle", [
    ({"guided_choice": ["sunny", "rain"], "min_tokens": 4}, "guided_choice", "cannot be combined with 'ignore_eos' or "
                                                                            "'min_tokens'"),
    ({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "structured_outputs", "nothing may pad"),
    ({"guided_json": "[" * 100_000}, "guided_json", "nested too deeply"),
    ({"structured_outputs": {"json_object": "false"}}, "structured_outputs", "must be true or false"),
])
async def test_more_guided_fields_that_cannot_be_held_are_400s(api, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param and needle in err.value.body["message"], err.value.body


@pytest.mark.parametrize("field", ["guided_choice", "guided_json", "response_format"])
def test_a_guided_field_beside_a_forced_tool_call_is_named_in_the_400(field):
    """A schema or choices beside a forced call is a 400 naming it; JSON mode (compact or not) is replaced by
    the call's schema, as it always was."""
    from lorafleet.worker.openai_fields import APIError
    from lorafleet.worker.openai_protocol import parse_chat_request

    value = {"guided_choice": ["a"], "guided_json": {"type": "object"},
             "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}}[field]
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        with pytest.raises(APIError) as err:
            parse_chat_request({"model": "m", "messages": USER, "tools": [ADD], "tool_choice": choice, field: value})
        assert err.value.param == field and f"'{field}' cannot be combined with 'tool_choice'" in err.value.message
        for mode in ({"json_object": True}, {"json_object": True, "disable_any_whitespace": True}):
            request = parse_chat_request({"model": "m", "messages": USER, "tools": [ADD], "tool_choice": choice,
                                          "structured_outputs": mode})
            assert request.options.grammar is request.tools.output_grammar


def test_a_choice_is_never_padded_and_text_stop_ids_do_not_hide_the_end():
    """The JSON grammars may pad a complete value with whitespace (ignore_eos, min_tokens); a choice is its text
    exactly. With min_tokens, a row whose only other tokens are text stop ids still ends its choice."""
    from lorafleet.worker.choice_grammar import ChoiceGrammar
    from lorafleet.worker.json_guide import JsonGuide
    from lorafleet.worker.json_vocab import JsonVocab
    from lorafleet.worker.sampling_params import SamplingParams
    from lorafleet.worker.sequence import Sequence

    pieces = ["y", "e", "ye", " ", "\n"]
    eos = len(pieces)
    guide = JsonGuide(lambda: JsonVocab([p.encode() for p in pieces] + [None]), eos_token_ids=[eos])
    grammar = ChoiceGrammar(["ye"])
    seq = Sequence("r", [1], SamplingParams(max_tokens=8, min_tokens=3, grammar=grammar, stop_token_ids=[0]))
    assert (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist() == [2]  # "ye", though min_tokens is not met
    seq.output_token_ids.append(2)
    assert (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist() == [0, eos]  # its stops: no whitespace
    assert not guide.accepts(seq, 3) and guide.accepts(seq, eos)


async def test_disable_any_whitespace_writes_json_compactly(api, bias):
    """vLLM's structured_outputs.disable_any_whitespace: no whitespace between JSON's tokens (small models can
    loop on it), whitespace inside strings as ever; for a schema and for JSON mode."""
    body = {"model": "tiny", "n": 4, "seed": 8, "max_tokens": 96, "logit_bias": bias}
    older = {"guided_json": REPORT, "guided_decoding_backend": "xgrammar:disable-any-whitespace"}  # older clients
    for extra in ({"structured_outputs": {"json": REPORT, "disable_any_whitespace": True}},
                  {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}, older):
        resp = await api.completions.create(prompt="Report:", extra_body=extra, **body)
        done = [c.text for c in resp.choices if c.finish_reason == "stop"]
        assert done
        for text in done:
            assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text
    loose = await api.completions.create(prompt="Report:", extra_body={"structured_outputs": {"json": REPORT}}, **body)
    assert any(json.dumps(json.loads(c.text), separators=(",", ":"), ensure_ascii=False) != c.text
               for c in loose.choices if c.finish_reason == "stop")  # without it this model writes whitespace
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(prompt="x", extra_body={"structured_outputs": {
            "json": REPORT, "disable_any_whitespace": "yes"}}, **body)
    assert err.value.body["param"] == "structured_outputs" and "true or false" in err.value.body["message"]


def test_compact_grammars_refuse_whitespace_between_tokens_only():
    from lorafleet.worker.json_constraint import COMPACT_JSON_OBJECT
    from lorafleet.worker.json_vocab import JsonVocab

    schema = schema_grammar(REPORT, compact=True)
    assert schema.key != schema_grammar(REPORT).key and schema is schema_grammar(REPORT, compact=True)
    for grammar in (schema, COMPACT_JSON_OBJECT):
        assert grammar.advance(grammar.start, b'{"city":"New York","temp":3,"unit":"C"}') is not None
        for spaced in (b' {"city":"x"', b'{ "city":"x"', b'{"city" :"x"', b'{"city": "x"', b'{"city":"x" ,'):
            assert grammar.advance(grammar.start, spaced) is None, (grammar.key, spaced)
    pieces = [b" ", b"\n", b'{"', b'city', b'":"', b"a b", b" c", b'"', b'","', b"temp", b'":', b"1", b"}", b", "]
    vocab = JsonVocab(pieces)
    for grammar in (schema, COMPACT_JSON_OBJECT):
        for prefix in (b"", b'{"', b'{"city":"', b'{"city":"a', b'{"city":"a b"', b'{"city":"a b","temp":1'):
            state = grammar.advance(grammar.start, prefix)
            invalid, _ = vocab.mask(state, True, grammar)
            assert (~invalid).tolist() == [vocab.accepts(state, t, True, grammar) for t in range(len(pieces))], prefix


def test_a_choice_the_vocabulary_cannot_spell_is_found_before_the_request_runs():
    """With a token for every byte any choice is written; without, a row could take a prefix and find no way
    on midway. The check (the AsyncEngine's, before the request joins the batch) finds such a choice."""
    from lorafleet.worker.choice_grammar import ChoiceGrammar
    from lorafleet.worker.json_vocab import JsonVocab

    grammar = ChoiceGrammar(["yes", "yez", "no"])
    words = JsonVocab([b"y", b"ye", b"es", b"s", b"no", b" "])
    assert grammar.unspellable(*words.spellings) == "yez"
    assert ChoiceGrammar(["yes", "no"]).unspellable(*words.spellings) is None
    every_byte = JsonVocab([bytes((b,)) for b in range(256)])
    assert grammar.unspellable(*every_byte.spellings) is None
    # Worked out once per vocabulary: the n rows of a request share the grammar (64 KB of choices took 0.3 s
    # each on a 49k vocabulary, n times over, on the event loop).
    calls = []
    real = grammar._unspellable
    grammar._unspellable = lambda *a: calls.append(1) or real(*a)
    assert [grammar.unspellable(*words.spellings) for _ in range(4)] == ["yez"] * 4 and len(calls) == 1


async def test_guided_choice_over_http_checks_the_vocabulary(api):
    """The tiny model's byte vocabulary spells anything: the check passes and the request is served."""
    resp = await api.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body={"guided_choice": ["é!"]})
    assert resp.choices[0].text == "é!"


async def test_guided_choice_a_vocabulary_cannot_spell_is_a_400(aiohttp_client, tiny_llama_dir):
    from lorafleet.worker.app_keys import ENGINE
    from lorafleet.worker.engine_config import EngineConfig
    from lorafleet.worker.server import create_app
    from lorafleet.worker.worker_config import WorkerConfig

    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny")
    client = await aiohttp_client(create_app(config))
    guide = client.app[ENGINE].engine.sampler.json_guide
    guide.prepare().result()
    guide.vocab.__dict__["spellings"] = ({b"y", b"e", b"s", b"n", b"o"}, 1)  # as if no other byte had a token
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    resp = await client.post("/v1/completions", json=body | {"guided_choice": ["yes", "nope"]})
    error = (await resp.json())["error"]
    assert resp.status == 400 and "cannot write the choice 'nope'" in error["message"], error
    resp = await client.post("/v1/completions", json=body | {"guided_choice": ["yes", "no"]})
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(a|b)*a(a|b){140}"}, "guided_regex"),  # each 'a' written opens a position
    ({"guided_grammar": 'root ::= "a" root "b" | "c"'}, "guided_grammar"),  # each 'a' nests a rule deeper
])
async def test_a_pattern_that_fails_while_it_runs_is_the_requests_400(api, tools_model, extra, param):
    """A pattern or grammar within its parse-time bounds that the output takes past its run-time bounds (a
    `logit_bias` on 'a' here) fails its request as a 400 naming the field, whole and streamed (in the stream),
    not as a server error the clients would retry; the worker serves on."""
    (a_id,) = Tokenizer.from_file(str(tools_model / "tokenizer.json")).encode("a", add_special_tokens=False).ids
    body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "logit_bias": {str(a_id): 100},
            "extra_body": extra}
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(**body)
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error", err.value.body
    with pytest.raises(openai.APIError) as err:
        async for _ in await api.completions.create(**body, stream=True):
            pass
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error", err.value.body
    resp = await api.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert resp.choices[0].finish_reason == "length"


async def test_stop_token_ids_that_are_the_only_way_on_are_the_request_s_error_not_the_engine_s(api):
    """A stop token ends the output without writing its text. Where the request's stop_token_ids are all that
    continues its structured output, the request fails as its own fault, a 400 saying so, not a 500."""
    closing = {"structured_outputs": {"json": {"type": "object", "properties": {}, "additionalProperties": False},
                                      "disable_any_whitespace": True}}
    for extra in (closing, {"guided_choice": ["yes", "no"]}, {"guided_regex": "ab"}):
        text = {"structured_outputs": "}", "guided_choice": "yn", "guided_regex": "b"}[next(iter(extra))]
        ids = [_token_id(ch) for ch in text]
        with pytest.raises(openai.BadRequestError) as err:
            await api.completions.create(model="tiny", prompt="x", max_tokens=8,
                                         extra_body={**extra, "stop_token_ids": ids})
        assert "are the only tokens that continue the structured output" in err.value.body["message"]
        assert err.value.body["param"] == "stop_token_ids"
    resp = await api.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body={"guided_regex": "ab"})
    assert resp.choices[0].text == "ab"


def _token_id(ch: str) -> int:
    """The tiny byte-level vocabulary's id of one printable ASCII character (sorted by code point)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet(), key=ord).index(ch)


def test_a_dead_end_is_blamed_on_the_stop_tokens_only_when_they_were_the_way_on():
    """A row no token continues, with an unrelated text stop token: not the stop tokens' fault."""
    from lorafleet.worker.json_guide import JsonGuide, JsonModeError, StopTokensInTheWay
    from lorafleet.worker.json_vocab import JsonVocab
    from lorafleet.worker.regex_grammar import RegexGrammar
    from lorafleet.worker.sampling_params import SamplingParams
    from lorafleet.worker.sequence import Sequence

    vocab = JsonVocab([b"a", b"b", b"x", None])  # no token writes "c"
    guide = JsonGuide(lambda: vocab, eos_token_ids=[3])
    for pattern, stops, error in (("ac", [2], JsonModeError), ("ab", [1], StopTokensInTheWay)):
        seq = Sequence("r", [1], SamplingParams(max_tokens=8, grammar=RegexGrammar(pattern), stop_token_ids=stops))
        seq.output_token_ids.append(0)  # "a"
        with pytest.raises(error) as err:
            guide.invalid(seq, "cpu")
        assert (err.type is StopTokensInTheWay) == (error is StopTokensInTheWay)
