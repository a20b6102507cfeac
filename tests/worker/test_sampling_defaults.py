"""The model's generation_config.json sampling defaults: read as vLLM reads them, applied only where a
request leaves the field unset, and served by the HTTP API."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.openai_protocol import parse_chat_request, parse_completion_request
from lorafleet.worker.sampling_defaults import SamplingDefaults, read_sampling_defaults
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig


@pytest.mark.parametrize(("config", "expected", "warned"), [
    ({"bos_token_id": 1, "eos_token_id": 2}, SamplingDefaults(), None),
    ({"temperature": 0.6, "top_p": 0.9, "do_sample": True}, SamplingDefaults(0.6, 0.9, 0), None),
    ({"top_k": 40.0, "temperature": 0}, SamplingDefaults(0.0, 1.0, 40), None),
    ({"temperature": 3.0, "top_p": 0, "top_k": True}, SamplingDefaults(), "outside what requests may ask for"),
    ({"temperature": 0.7, "repetition_penalty": 1.1, "min_p": 0.0}, SamplingDefaults(0.7, repetition_penalty=1.1),
     None),
    ({"repetition_penalty": 1.05, "min_p": 0.1}, SamplingDefaults(repetition_penalty=1.05, min_p=0.1), None),
    ({"min_p": 1.5, "top_p": 0.8}, SamplingDefaults(top_p=0.8), "outside what requests may ask for"),
    ({"min_p": "0.1"}, SamplingDefaults(), "outside what requests may ask for"),
    ({"repetition_penalty": 0, "top_k": 5}, SamplingDefaults(top_k=5), "outside what requests may ask for"),
    ({"repetition_penalty": "1.1"}, SamplingDefaults(), "outside what requests may ask for"),
    ([1, 2], SamplingDefaults(), "not a JSON object"),
    ({"max_new_tokens": 512, "max_length": 20}, SamplingDefaults(max_tokens=512), None),
    ({"max_new_tokens": 64.0, "top_k": 20}, SamplingDefaults(top_k=20, max_tokens=64), None),
    ({"max_new_tokens": 0}, SamplingDefaults(), "max_new_tokens=0 is not a whole number >= 1"),
    ({"max_new_tokens": True}, SamplingDefaults(), "max_new_tokens=True is not a whole number >= 1"),
    ({"max_new_tokens": "64"}, SamplingDefaults(), "max_new_tokens='64' is not a whole number >= 1"),
])
def test_only_the_keys_the_file_sets_and_the_engine_can_honour_count(tmp_path, caplog, config, expected, warned):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.sampling_defaults"):
        assert read_sampling_defaults(tmp_path) == expected
    assert (warned in caplog.text) if warned else not caplog.records


def test_no_file_or_a_broken_one_means_openais_defaults(tmp_path, caplog):
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.sampling_defaults"):
        assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    assert "cannot be read" in caplog.text


@pytest.mark.parametrize(("field", "value"), [("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0),
                                            ("top_p", 1.01), ("repetition_penalty", 0.0), ("min_p", -0.1),
                                            ("min_p", 1.1)])
def test_a_default_is_refused_where_a_request_would_be(tmp_path, caplog, field, value):
    """One range per field (sampling_defaults.RANGES) for the model's defaults and the requests' values."""
    from lorafleet.worker.openai_protocol import APIError

    (tmp_path / "generation_config.json").write_text(json.dumps({field: value}))
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.sampling_defaults"):
        assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    assert "outside what requests may ask for" in caplog.text
    with pytest.raises(ValueError, match="out of range"):
        SamplingDefaults(**{field: value})
    with pytest.raises(APIError, match=field):
        parse_completion_request(_request_body(parse_completion_request) | {field: value})
    edge = {"top_p": 1.0, "repetition_penalty": 1e-3}.get(field, 0.0 if value < 0 else 2.0 if field == "temperature"
                                                            else 1.0)
    assert getattr(parse_completion_request(_request_body(parse_completion_request) | {field: edge}).options,
                   field) == edge
    assert getattr(SamplingDefaults(**{field: edge}), field) == edge


def _request_body(parse) -> dict:
    """The smallest valid request for the endpoint `parse` reads."""
    if parse is parse_completion_request:
        return {"model": "m", "prompt": "x"}
    return {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
def test_a_request_keeps_what_it_sets_and_takes_the_defaults_for_the_rest(parse):
    body = _request_body(parse)
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=40)
    o = parse(body, defaults).options
    assert (o.temperature, o.top_p, o.top_k) == (0.6, 0.9, 40)
    o = parse(body | {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, defaults).options
    assert (o.temperature, o.top_p, o.top_k) == (1.0, 1.0, 0)
    o = parse(body).options  # no defaults given: OpenAI's
    assert (o.temperature, o.top_p, o.top_k) == (1.0, 1.0, 0)


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
@pytest.mark.parametrize(("field", "model", "asked", "openai"), [("repetition_penalty", 1.2, 1.0, 1.0),
                                                                 ("min_p", 0.05, 0.0, 0.0)])
def test_the_models_value_applies_when_a_request_leaves_the_field_unset(parse, field, model, asked, openai):
    body = _request_body(parse)
    defaults = SamplingDefaults(**{field: model})
    assert getattr(parse(body, defaults).options, field) == model
    assert getattr(parse(body | {field: asked}, defaults).options, field) == asked
    assert getattr(parse(body).options, field) == openai
    options = parse(body | {"presence_penalty": 0.5, "frequency_penalty": 0.25}, defaults).options
    assert (options.presence_penalty, options.frequency_penalty) == (0.5, 0.25)  # no model default for these


@pytest.mark.parametrize("use_file", [True, False])
async def test_a_model_whose_generation_config_says_greedy_is_served_greedy(aiohttp_client, tiny_llama_dir, tmp_path,
                                                                            use_file):
    """temperature 0 in generation_config.json: requests without a temperature decode greedily whatever their
    seed, as one that asks for temperature 0 does; with the option off they sample (OpenAI's temperature 1)."""
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": 2}))
    engine = EngineConfig(model=str(model), dtype="float32", max_model_len=128, generation_config=use_file)
    client = await aiohttp_client(create_app(WorkerConfig(engine=engine, served_model_name="tiny")))

    async def text(**extra) -> str:
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 12, "ignore_eos": True, **extra}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["text"]

    greedy = await text(temperature=0)
    unset = {await text(seed=seed) for seed in range(4)}
    assert (unset == {greedy}) == use_file


def test_a_model_path_that_is_a_file_logs_no_generation_config_warning(tmp_path, caplog):
    """--model pointing at a weights file is refused by the model's own check, with its own message; the
    sampling defaults must not first warn about a generation_config.json that cannot be read."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with caplog.at_level("WARNING"):
        assert read_sampling_defaults(weights) == SamplingDefaults()
    assert not caplog.records


def test_max_new_tokens_is_the_max_tokens_of_a_chat_that_sets_none():
    """vLLM's get_max_tokens: the model's default for chat's unset max_tokens (the context still bounds it, in
    completion_job.py); a max_tokens sent is kept; completions keep their 16."""
    defaults = SamplingDefaults(max_tokens=5)
    chat = parse_chat_request(_request_body(parse_chat_request), defaults).options
    assert (chat.max_tokens, chat.default_max_tokens) == (None, 5)  # unset: still lowered to fit (kv_room.py)
    assert parse_chat_request(_request_body(parse_chat_request) | {"max_tokens": 9}, defaults).options.max_tokens == 9
    completion = parse_completion_request(_request_body(parse_completion_request), defaults).options
    assert (completion.max_tokens, completion.default_max_tokens) == (16, None)
    with pytest.raises(ValueError, match="out of range"):
        SamplingDefaults(max_tokens=0)


async def test_a_chat_without_max_tokens_generates_max_new_tokens(aiohttp_client, tiny_llama_dir, tmp_path):
    """max_new_tokens 3: a chat without max_tokens ends after 3 tokens (finish_reason length), one with
    max_tokens or min_tokens more generates those, one whose prompt leaves less context gets what it leaves."""
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "eos_token_id": 2}))
    engine = EngineConfig(model=str(model), dtype="float32", max_model_len=64)
    client = await aiohttp_client(create_app(WorkerConfig(engine=engine, served_model_name="tiny")))

    async def generated(content: str = "hi", **extra) -> tuple[int, str]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "ignore_eos": True, **extra}
        resp = await client.post("/v1/chat/completions", json=body)
        data = await resp.json()
        assert resp.status == 200, data
        return data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]

    assert await generated() == (3, "length")
    assert await generated(max_tokens=6) == (6, "length")
    assert await generated(min_tokens=5) == (5, "length")
    prompt = "x" * 40  # 40 bytes and the template's 22: 62 of the 64 tokens, 2 left
    assert await generated(prompt) == (2, "length")
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "ignore_eos": True})
    assert (await resp.json())["usage"]["completion_tokens"] == 16
