"""--request-timeout-s end to end: a worker on 127.0.0.1 (aiohttp's test server, real HTTP), the tiny model,
the official `openai` client and raw SSE. A request past the limit is answered 504 `deadline_exceeded` (a
stream whose headers went: an in-band error event, no [DONE]); its sequences are aborted, so their KV pages
and adapter reference come back, and the next request is served.

To make "past the limit" certain whatever the machine's speed, the engine thread is held (in its public
`on_step` hook, or by a `call`) once the request has its pages, until the deadline has passed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading

import pytest
from openai import APIError, AsyncOpenAI, InternalServerError

from lorafleet.worker.app_keys import ENGINE
from lorafleet.worker.cli import config_from_args
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.lora_factory import make_peft_adapter
from tests.openai_clients import close_openai_clients, openai_client  # noqa: F401 (the fixture closes them)

ADMIN = {"Authorization": "Bearer admin-token-for-tests"}
LIMIT_S = 3.0  # the first chunk of a stream comes within it (the tiny model's first step takes milliseconds), also
# on a loaded machine
LONG = {"max_tokens": 60, "temperature": 0}  # more steps than the held engine lets run
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, tmp_path):
    make_peft_adapter(tiny_llama_dir, tmp_path / "alpha", rank=4, seed=1, targets=["q_proj", "v_proj"])
    config = WorkerConfig(
        engine=EngineConfig(
            model=str(tiny_llama_dir), adapters=str(tmp_path), dtype="float32", max_model_len=128
        ),
        served_model_name="tiny",
        admin_token=ADMIN["Authorization"][7:],
        request_timeout_s=LIMIT_S,
    )
    client = await aiohttp_client(create_app(config))
    # A request within the limit is served as usual (and the first forward is behind us).
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 4})
    assert resp.status == 200, await resp.text()
    return client


def api_of(client) -> AsyncOpenAI:
    return openai_client(str(client.make_url("/v1")))


@contextlib.contextmanager
def engine_held_after(client, num_steps: int):
    """The engine thread stops after its `num_steps`-th step from now (its outputs not yet delivered) until the
    block ends: a request running then keeps its KV pages and adapter, and cannot finish."""
    engine = client.app[ENGINE]
    gate, steps, real = threading.Event(), [0], engine.on_step

    def on_step(e) -> None:
        real(e)
        steps[0] += 1
        if steps[0] == num_steps:
            gate.wait(60)

    engine.on_step = on_step
    try:
        yield
    finally:
        engine.on_step = real
        gate.set()


async def state(client) -> dict:
    resp = await client.get("/admin/v1/state", headers=ADMIN)
    assert resp.status == 200
    return await resp.json()


async def until_running(client, num_seqs: int) -> None:
    """Poll until `num_seqs` sequences run and hold KV pages and the adapter."""
    for _ in range(2000):
        s = await state(client)
        if (
            s["requests"]["running"] == num_seqs
            and s["kv"]["num_used_pages"] > 0
            and s["adapters"][0]["refcount"]
        ):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the request never ran: {s}")


async def assert_drained_and_serving(client) -> None:
    """Every KV page, adapter reference and admitted sequence is back (polled: the engine applies the abort at
    its next step), and a request within the limit is served."""
    for _ in range(2000):
        s = await state(client)
        if (
            s["kv"]["num_used_pages"] == 0
            and s["requests"] == {"running": 0, "waiting": 0, "admitted": 0}
            and all(a["refcount"] == 0 for a in s["adapters"])
        ):
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError(f"left behind: {s}")
    done = await api_of(client).completions.create(model="alpha", prompt="hi", max_tokens=3)
    assert done.choices[0].finish_reason in ("length", "stop")


def assert_deadline_error(error: dict) -> None:
    assert (error["type"], error["code"]) == ("timeout_error", "deadline_exceeded"), error
    assert f"within {LIMIT_S:g} s" in error["message"] and "--request-timeout-s" in error["message"], error


async def test_an_answer_past_the_limit_is_a_504_and_frees_every_choice(client, caplog):
    """n=2 on an adapter, not streamed: both sequences run (pages, the adapter held) when the engine stops; the
    deadline answers 504 with the OpenAI error shape, logs one line, counts in lorafleet_requests_total."""
    with engine_held_after(client, 2), caplog.at_level(logging.WARNING, "lorafleet.worker.job_outputs"):
        pending = asyncio.ensure_future(
            api_of(client).completions.create(
                model="alpha", prompt="hi", n=2, extra_body=IGNORE_EOS, **LONG
            )
        )
        await until_running(client, 2)
        with pytest.raises(InternalServerError) as exc:
            await asyncio.wait_for(pending, 30)
    assert exc.value.status_code == 504
    assert_deadline_error(exc.value.body)
    lines = [r.getMessage() for r in caplog.records if "--request-timeout-s" in r.getMessage()]
    assert len(lines) == 1 and "aborted its 2 sequence(s)" in lines[0], lines
    await assert_drained_and_serving(client)
    metrics = await (await client.get("/metrics")).text()
    assert 'lorafleet_requests_total{adapter="alpha"' in metrics
    assert any(
        'status="504"' in line and 'endpoint="completions"' in line and line.endswith(" 1.0")
        for line in metrics.splitlines()
        if line.startswith("lorafleet_requests_total{")
    ), metrics


async def test_a_chat_stream_past_the_limit_ends_with_an_error_the_openai_client_raises(client):
    """The headers and the first chunk went within the limit: the stream's error can only go in-band, and the
    official client raises it with its code."""
    chunks = []
    with engine_held_after(client, 2):
        stream = await api_of(client).chat.completions.create(
            model="alpha",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body=IGNORE_EOS,
            **LONG,
        )
        with pytest.raises(APIError) as exc:
            async for chunk in stream:
                chunks.append(chunk)
    assert chunks and chunks[0].choices[0].delta.role == "assistant"
    assert_deadline_error(exc.value.body)
    await assert_drained_and_serving(client)


async def test_a_raw_stream_past_the_limit_ends_with_one_error_event_and_no_done(client):
    body = {"model": "alpha", "prompt": "hi", "stream": True, "n": 2, **IGNORE_EOS, **LONG}
    with engine_held_after(client, 2):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        # The chunked body ends: no hang, no broken transfer.
        raw = await asyncio.wait_for(resp.content.read(), 30)
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert "[DONE]" not in events and len(events) >= 2, events
    assert all("choices" in json.loads(e) for e in events[:-1])
    assert_deadline_error(json.loads(events[-1])["error"])
    await assert_drained_and_serving(client)


async def test_a_stream_still_queued_at_the_limit_gets_a_504_status(client):
    """Nothing was sent yet (the engine never took the request): the 504 is the response's own status."""
    gate = threading.Event()
    client.app[ENGINE].call(lambda _engine: gate.wait(60))
    try:
        resp = await client.post(
            "/v1/completions", json={"model": "alpha", "prompt": "hi", "stream": True, **LONG}
        )
        assert resp.status == 504 and resp.headers["x-should-retry"] == "false"  # the openai clients do not retry
        assert_deadline_error((await resp.json())["error"])
    finally:
        gate.set()
    await assert_drained_and_serving(client)


def test_the_limit_is_a_flag_and_an_env_var_and_off_by_default():
    assert config_from_args(WorkerConfig, [], env={}).request_timeout_s == 0.0
    env = {"LORAFLEET_REQUEST_TIMEOUT_S": "2.5"}
    assert config_from_args(WorkerConfig, [], env=env).request_timeout_s == 2.5
    assert config_from_args(WorkerConfig, ["--request-timeout-s", "7"], env=env).request_timeout_s == 7.0
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="request_timeout_s must be a finite number >= 0"):
            WorkerConfig(request_timeout_s=bad)
