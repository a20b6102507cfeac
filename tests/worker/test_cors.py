"""CORS for browser clients: off by default; with --allowed-origins, preflights are answered before any key is
asked for and every response to a listed origin names it, streams and errors included."""

from __future__ import annotations

import pytest

from lorafleet.worker.cors import parse_origins
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

APP = "https://chat.example.com"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


async def worker(aiohttp_client, tiny_llama_dir, origins: str):
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", allowed_origins=origins)
    return await aiohttp_client(create_app(config))


async def test_without_allowed_origins_browsers_get_no_cors_headers(aiohttp_client, tiny_llama_dir):
    client = await worker(aiohttp_client, tiny_llama_dir, "")
    resp = await client.options("/v1/completions", headers=PREFLIGHT)
    assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await client.post("/v1/completions", json=BODY, headers={"Origin": APP})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_a_listed_origin_gets_preflights_answers_streams_and_errors(aiohttp_client, tiny_llama_dir):
    client = await worker(aiohttp_client, tiny_llama_dir, f"{APP}/, https://other.example:8443")
    resp = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert resp.status == 204 and resp.headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "Access-Control-Allow-Credentials" not in resp.headers  # keys are headers, never cookies
    assert (await client.options("/nowhere", headers=PREFLIGHT)).status == 404
    for body in (BODY, BODY | {"stream": True}, BODY | {"model": "nowhere"}):
        resp = await client.post("/v1/completions", json=body, headers={"Origin": APP})
        await resp.read()
        assert resp.headers["Access-Control-Allow-Origin"] == APP, body
        assert "X-Lorafleet-Adapter" in resp.headers["Access-Control-Expose-Headers"]
        assert "Origin" in resp.headers.getall("Vary")
    # Another origin: answered as ever, without the header its browser needs to read the answer.
    resp = await client.options("/v1/completions", headers=PREFLIGHT | {"Origin": "https://evil.example"})
    assert resp.status == 204 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await client.post("/v1/completions", json=BODY, headers={"Origin": "https://evil.example"})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_any_origin(aiohttp_client, tiny_llama_dir):
    assert parse_origins('["*"]') == parse_origins("*") == {"*"}  # vLLM's form of the flag, a JSON list
    client = await worker(aiohttp_client, tiny_llama_dir, "*")
    resp = await client.post("/v1/completions", json=BODY, headers={"Origin": "https://anywhere.example"})
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"


@pytest.mark.parametrize("value", ["chat.example.com", "ftp://chat.example.com", "https://chat.example.com/app",
                                   '["https://a.example", 5]', '["https://a.example"'])
def test_an_entry_that_is_no_origin_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="is not an origin|is not a JSON list"):
        parse_origins(value)
