"""CORS for browser clients: off by default; with --allowed-origins, preflights are answered before any key is
asked for and every response to a listed origin names it, streams and errors included."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafleet.worker.cors import parse_origins
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

APP = "https://chat.example.com"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


async def worker(aiohttp_client, tiny_llama_dir, origins: str, **options):
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", allowed_origins=origins, **options)
    return await aiohttp_client(create_app(config))


async def exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """`request` sent as it is on a connection of its own: the answer's status, headers (lower-case names; the
    last of a repeated one) and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        status_line, *lines = head.decode().strip().split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 30)
        return int(status_line.split()[1]), headers, body
    finally:
        writer.close()


def post_head(*headers: str) -> bytes:
    return "\r\n".join(["POST /v1/completions HTTP/1.1", "Host: 127.0.0.1", f"Origin: {APP}",
                         "Content-Type: application/json", *headers, "", ""]).encode()


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
        assert {"X-Lorafleet-Adapter", "X-Should-Retry"} <= set(resp.headers["Access-Control-Expose-Headers"].split(", "))
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


LARGE = json.dumps({"model": "tiny", "prompt": "x" * 4096}).encode()  # over --max-body-bytes 2048


@pytest.mark.parametrize("request_bytes", [
    post_head(f"Content-Length: {len(LARGE)}") + LARGE,
    post_head("Transfer-Encoding: chunked") + f"{len(LARGE):x}\r\n".encode() + LARGE + b"\r\n0\r\n\r\n",
], ids=["content_length", "chunked"])
async def test_a_body_over_the_limit_is_a_413_a_browser_can_read(aiohttp_client, tiny_llama_dir, request_bytes):
    """aiohttp refuses a body over client_max_size (--max-body-bytes) while a handler reads it: the 413 passes
    through the app, so it carries the CORS headers (and the OpenAI error shape), whatever the body's framing."""
    client = await worker(aiohttp_client, tiny_llama_dir, APP, max_body_bytes=2048)
    status, headers, body = await exchange(client.server.port, request_bytes)
    assert status == 413 and headers["access-control-allow-origin"] == APP, headers
    assert "X-Lorafleet-Adapter" in headers["access-control-expose-headers"]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and "--max-body-bytes" in error["message"], error


async def test_an_expectation_aiohttp_refuses_is_a_417_a_browser_can_read(aiohttp_client, tiny_llama_dir):
    """aiohttp answers an unknown Expect before the middlewares run, but inside the app: the CORS headers
    are there."""
    client = await worker(aiohttp_client, tiny_llama_dir, APP)
    status, headers, _ = await exchange(client.server.port, post_head("Expect: bogus", "Content-Length: 2") + b"{}")
    assert status == 417 and headers["access-control-allow-origin"] == APP, headers


@pytest.mark.parametrize("request_bytes", [
    post_head("Bad Header: x", "Content-Length: 2") + b"{}",
    post_head("X-Large: " + "a" * 9000, "Content-Length: 2") + b"{}",
    b"GET /v1/models HTTP/1.1 extra\r\nHost: 127.0.0.1\r\nOrigin: " + APP.encode() + b"\r\n\r\n",
], ids=["bad_header", "header_over_8190_bytes", "bad_request_line"])
async def test_a_request_aiohttp_cannot_parse_is_a_400_without_cors_headers(aiohttp_client, tiny_llama_dir,
                                                                           request_bytes):
    """The one answer without them: aiohttp's protocol answers it for a request it never parsed (its Origin
    unread), outside the app (worker/cors.py says why). The worker serves the next request as ever."""
    client = await worker(aiohttp_client, tiny_llama_dir, APP)
    status, headers, _ = await exchange(client.server.port, request_bytes)
    assert status == 400 and "access-control-allow-origin" not in headers, headers
    resp = await client.post("/v1/completions", json=BODY, headers={"Origin": APP})
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == APP
