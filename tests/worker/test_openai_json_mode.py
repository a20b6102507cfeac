"""`response_format` over HTTP (a worker on 127.0.0.1, tiny model, the official `openai` client): JSON mode
on /v1/chat/completions and /v1/completions, `text` accepted, malformed values refused with a 400 that names
the field (structured output, `json_schema`: test_structured_output.py)."""

from __future__ import annotations

import json

import pytest

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.json_constraint import START, advance, is_complete
from lorafleet.worker.openai_fields import APIError
from lorafleet.worker.openai_protocol import parse_chat_request, parse_completion_request
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)
from tests.worker.conftest import EOS_ID

openai = pytest.importorskip("openai")  # installed with the test extras; absent on a bare GPU machine

JSON_MODE = {"type": "json_object"}
MESSAGES = [{"role": "user", "content": "Reply in JSON."}]


@pytest.fixture
async def api(aiohttp_client, tiny_llama_dir):
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny")
    client = await aiohttp_client(create_app(config))
    return openai_client(str(client.make_url("/v1")), "sk-test")


def _assert_json(text: str, finish_reason: str) -> None:
    state = advance(START, text.encode())
    assert state is not None, text
    if finish_reason == "stop":
        assert is_complete(state) and isinstance(json.loads(text), dict), text
    else:
        assert finish_reason == "length" and not is_complete(state)


async def test_chat_json_mode_gives_json_objects(api):
    finished = 0
    for eager in (False, True):  # EOS biased: the choices end as soon as their object is complete
        body = {"model": "tiny", "messages": MESSAGES, "response_format": JSON_MODE, "n": 3, "seed": 11,
                "max_tokens": 48, "logprobs": True, "top_logprobs": 2}
        if eager:
            body["logit_bias"] = {str(EOS_ID): 100}
        resp = await api.chat.completions.create(**body)
        for choice in resp.choices:
            _assert_json(choice.message.content, choice.finish_reason)
            assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
            finished += choice.finish_reason == "stop"
        again = await api.chat.completions.create(**body)  # seeded: the same choices
        assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]
    assert finished


async def test_completions_json_mode_plain_and_streamed(api):
    body = {"model": "tiny", "prompt": "JSON:", "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 2,
            "logit_bias": {str(EOS_ID): 100}}
    plain = await api.completions.create(**body, extra_body={"response_format": JSON_MODE})
    for choice in plain.choices:
        _assert_json(choice.text, choice.finish_reason)
    stream = await api.completions.create(**body, stream=True, extra_body={"response_format": JSON_MODE})
    texts, reasons = ["", ""], [None, None]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in plain.choices] and reasons == [c.finish_reason for c in plain.choices]
    text = await api.completions.create(**body, extra_body={"response_format": {"type": "text"}})
    free = await api.completions.create(**body)
    assert [c.text for c in text.choices] == [c.text for c in free.choices]


@pytest.mark.parametrize("value, code", [
    ({"type": "json_schema", "json_schema": {}}, "invalid_type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": "yes"}}, "invalid_type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "format": "x"}}, "invalid_value"),
    ({"type": "json_schema", "schema": {"type": "object"}}, "invalid_value"),
    ({"type": "yaml"}, "invalid_value"),
    ({"type": "text", "schema": {"type": "object"}}, "invalid_value"),
    ({"type": "json_object", "schema": {"type": "integer"}}, "invalid_value"),
    ({"type": "json_object", "schema": {"type": "string", "pattern": "(?=a)"}}, "invalid_value"),
    ({}, "invalid_type"),
    ("json_object", "invalid_type"),
    ({"type": 1}, "invalid_type"),
])
@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
def test_bad_response_formats_are_refused(value, code, parse):
    body = {"model": "m", "messages": MESSAGES, "prompt": "x", "response_format": value}
    body.pop("prompt" if parse is parse_chat_request else "messages")
    with pytest.raises(APIError) as err:
        parse(body)
    assert err.value.status == 400 and err.value.param == "response_format" and err.value.code == code


@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
def test_text_and_json_object_are_accepted(parse):
    body = {"model": "m", "messages": MESSAGES} if parse is parse_chat_request else {"model": "m", "prompt": "x"}
    assert not parse(body).options.json_object
    assert not parse(body | {"response_format": {"type": "text"}}).options.json_object
    assert parse(body | {"response_format": JSON_MODE}).options.json_object


async def test_a_failed_json_table_build_is_an_error_that_says_so(aiohttp_client, tiny_llama_dir):
    """The table is built outside the engine's thread: its failure ends the JSON-mode request, not the worker."""
    from lorafleet.worker.app_keys import ENGINE

    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny")
    client = await aiohttp_client(create_app(config))

    def broken():
        raise RuntimeError("tokenizer broke")

    client.app[ENGINE].engine.sampler.json_guide._build_vocab = broken
    body = {"model": "tiny", "prompt": "JSON:", "max_tokens": 4}
    for stream in (False, True):
        resp = await client.post("/v1/completions", json=body | {"response_format": JSON_MODE, "stream": stream})
        error = (await resp.json())["error"]
        assert resp.status == 500 and "JSON mode is unavailable" in error["message"], error
        assert "tokenizer broke" in error["message"]
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200 and client.app[ENGINE].is_running


async def test_a_schema_whose_alternatives_stay_alike_too_long_is_the_request_s_400(api):
    """100 alternatives that read alike until their key's name: past the grammar's bound on readings at once the
    request fails, as its schema's fault (400, as at parse time), not the worker's (500 counted against the
    adapter, its canary and the worker's error rate)."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]}
                        for i in range(100)]}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(**body, stream=stream)
        assert err.value.status_code == 400 and "readings of the output fit the schema" in err.value.message
        assert err.value.param == "response_format"
