"""Intake before admission: a full worker refuses without reading the body, the requests being read,
parsed and tokenized at once are bounded, and large bodies are parsed off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
import weakref

import pytest
from aiohttp import web

from lorafleet.worker import intake, parse_turns
from lorafleet.worker.app_keys import ADMISSION, ENGINE, INTAKE_WAITS, METRICS
from lorafleet.worker.cli import config_from_args
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.metrics import UNRESOLVED_LABEL
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()


def config(tiny_llama_dir, max_num_seqs: int = 64, **worker) -> WorkerConfig:
    return WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256,
                                            max_num_seqs=max_num_seqs), served_model_name="tiny", **worker)


async def send_head(port: int, length: int, first: bytes = b"", key: str | None = None, path: str = "/v1/completions",
                    expect: bool = False):
    """A POST to `path` whose headers announce `length` body bytes, of which only `first` is sent (so far);
    `expect`: with `Expect: 100-continue`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    auth += "Expect: 100-continue\r\n" if expect else ""
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
                 f"Content-Length: {length}\r\n\r\n".encode() + first)
    await writer.drain()
    return reader, writer


async def read_answer(reader: asyncio.StreamReader, timeout: float = 60.0) -> tuple[int, dict[str, str], dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    status_line, *lines = head.decode().strip().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
    return int(status_line.split()[1]), headers, json.loads(body)


async def wait_until(predicate, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_full_worker_refuses_before_reading_the_body(aiohttp_client, tiny_llama_dir):
    """Capacity 1, held by a request whose forward waits: the next request gets 429 queue_full with
    Retry-After from its headers alone (its 4 MB body is never sent); once the first is done, requests
    are served again."""
    app = create_app(config(tiny_llama_dir, max_num_seqs=1, max_queued_requests=0))
    client = await aiohttp_client(app)
    engine = app[ENGINE].engine
    gate, run = threading.Event(), engine.runner.run

    def held_run(batch):
        gate.wait(60)
        return run(batch)

    engine.runner.run = held_run
    writer = None
    try:
        first = asyncio.create_task(client.post("/v1/completions", data=BODY))
        await wait_until(lambda: app[ADMISSION].num_admitted == 1)
        reader, writer = await send_head(client.server.port, 4_000_000)
        status, headers, body = await read_answer(reader, timeout=10)
        assert status == 429 and int(headers["retry-after"]) >= 1, body
        assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
        assert app[ADMISSION].num_in_intake == 0
        # A client that waits for 100 Continue (curl) gets the 429 instead, and so never sends the body.
        writer.close()
        counted = app[METRICS].requests.labels(UNRESOLVED_LABEL, "", "completions", "429")
        before = counted._value.get()
        reader, writer = await send_head(client.server.port, 4_000_000, expect=True)
        status, headers, body = await read_answer(reader, timeout=10)
        assert status == 429 and body["error"]["code"] == "queue_full" and int(headers["retry-after"]) >= 1
        assert counted._value.get() == before + 1  # counted as the handler counts its refusals
    finally:
        gate.set()
        if writer is not None:
            writer.close()
    assert (await first).status == 200
    await wait_until(lambda: app[ADMISSION].num_admitted == 0)
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200 and (await resp.json())["choices"][0]["finish_reason"] == "length"
    reader, writer = await send_head(client.server.port, len(BODY), expect=True)  # room now: 100 Continue
    try:
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(BODY)
        status, _, body = await read_answer(reader)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    finally:
        writer.close()


@pytest.mark.parametrize("wait_s", [0.0, 30.0])
async def test_requests_in_intake_are_bounded(aiohttp_client, tiny_llama_dir, wait_s):
    """Two bodies half sent fill an intake of 2. With --intake-wait-s 0 a third request is refused with 429
    intake_full before its body is read; else it waits, its body unread, and is served once a place frees (a
    burst of more connections than places was refused whole but for the first ones). The two are served once
    their bodies arrive, and intake is open again."""
    app = create_app(config(tiny_llama_dir, max_intake_requests=2, intake_wait_s=wait_s))
    client = await aiohttp_client(app)
    port, writers = client.server.port, []
    try:
        held = [await send_head(port, len(BODY), BODY[:10]) for _ in range(2)]
        writers += [w for _, w in held]
        await wait_until(lambda: app[ADMISSION].num_in_intake == 2)
        reader, writer = await send_head(port, len(BODY), BODY)
        writers.append(writer)
        if wait_s:
            await wait_until(lambda: app[INTAKE_WAITS].num_waiting == 1)
            held[0][1].write(BODY[10:])  # the first body arrives: its place goes to the waiting request
            for answer in (held.pop(0)[0], reader):
                status, _, body = await read_answer(answer)
                assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        else:
            status, headers, body = await read_answer(reader, timeout=10)
            assert status == 429 and int(headers["retry-after"]) >= 1, body
            assert body["error"]["code"] == "intake_full" and "--max-intake-requests" in body["error"]["message"]
        for held_reader, held_writer in held:
            held_writer.write(BODY[10:])
            await held_writer.drain()
            status, _, body = await read_answer(held_reader)
            assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    finally:
        for w in writers:
            w.close()
    assert app[ADMISSION].num_in_intake == 0
    assert (await client.post("/v1/completions", data=BODY)).status == 200


async def test_one_tenant_sending_bodies_slowly_cannot_hold_every_intake_place(aiohttp_client, tiny_llama_dir,
                                                                               tmp_path):
    """acme holds as many half-sent bodies as --max-sequences-per-tenant (2): its next request is refused with
    429 tenant_queue_full before its body is read, and globex, in the same intake of 8, is served."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"acme": {"keys": ["sk-acme"]}, "globex": {"keys": ["sk-globex"]}}}))
    app = create_app(config(tiny_llama_dir, max_intake_requests=8, max_sequences_per_tenant=2,
                            api_keys_file=str(keys)))
    client = await aiohttp_client(app)
    port, writers = client.server.port, []
    try:
        for _ in range(2):
            writers.append((await send_head(port, len(BODY), BODY[:10], key="sk-acme"))[1])
        await wait_until(lambda: app[ADMISSION].num_in_intake == 2)
        reader, writer = await send_head(port, len(BODY), BODY[:10], key="sk-acme")
        writers.append(writer)
        status, _, body = await read_answer(reader, timeout=10)
        assert status == 429 and body["error"]["code"] == "tenant_queue_full", body
        assert "2 requests being read" in body["error"]["message"]
        served = await client.post("/v1/completions", data=BODY, headers={"Authorization": "Bearer sk-globex"})
        assert served.status == 200, await served.text()
    finally:
        for w in writers:
            w.close()
    await wait_until(lambda: app[ADMISSION].num_in_intake == 0)


async def test_a_client_leaving_before_its_body_arrived_counts_499_and_logs_no_error(aiohttp_client, tiny_llama_dir,
                                                                                  caplog):
    """A connection closed halfway through its body is the client's doing: counted as 499 (as a client leaving
    after admission), no 500 in the metrics, no error traceback in the log; its intake place is free."""
    import logging

    app = create_app(config(tiny_llama_dir))
    client = await aiohttp_client(app)
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        _, writer = await send_head(client.server.port, len(BODY), BODY[:10])
        await wait_until(lambda: app[ADMISSION].num_in_intake == 1)
        writer.close()
        await wait_until(lambda: app[ADMISSION].num_in_intake == 0)
    metrics = await (await client.get("/metrics")).text()
    counted = [line for line in metrics.splitlines() if line.startswith("lorafleet_requests_total{")]
    assert any('status="499"' in line and line.endswith(" 3.0") for line in counted), counted
    assert not any('status="500"' in line for line in counted), counted
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
async def test_a_client_leaving_during_its_tokenization_keeps_its_intake_place_until_it_ends(
        aiohttp_client, tiny_llama_dir, monkeypatch, path):
    """Intake of 1, a tokenization that waits: the client leaves (its handler is cancelled), but the
    tokenization still runs in the executor, so the place stays held (the next request gets 429 intake_full)
    until it ends. Freed at the cancellation, clients hanging up could pile unbounded work into the executor."""
    from lorafleet.worker.tokenizer import Tokenizer

    gate, started, encode = threading.Event(), threading.Event(), Tokenizer.encode

    def waiting(self, *args, **kwargs):
        started.set()
        gate.wait(30)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", waiting)
    app, ended = create_app(config(tiny_llama_dir, max_intake_requests=1, intake_wait_s=0)), asyncio.Event()

    @web.middleware
    async def innermost(request, handler):  # ends after the handler, its intake place's `with` included
        try:
            return await handler(request)
        finally:
            ended.set()

    app.middlewares.append(innermost)
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    admission, body = app[ADMISSION], BODY if path == "/v1/completions" else b'{"model": "tiny", "prompt": "hi"}'
    try:
        _, writer = await send_head(client.server.port, len(body), body, path=path)
        await wait_until(started.is_set)
        writer.close()

        await asyncio.wait_for(ended.wait(), 30)  # its handler was cancelled: its intake place's `with` is over
        assert admission.num_in_intake == 1
        refused = await client.post(path, data=body)
        assert refused.status == 429 and (await refused.json())["error"]["code"] == "intake_full"
    finally:
        gate.set()
    await wait_until(lambda: admission.num_in_intake == 0)
    assert (await client.post(path, data=body)).status == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decompress_is_the_clients_400(aiohttp_client, tiny_llama_dir, caplog, encoding):
    """A compressed body that is not what its Content-Encoding says is the client's error: a 400, no error
    traceback in the log; a body that decompresses is served."""
    import gzip
    import logging
    import zlib

    client = await aiohttp_client(create_app(config(tiny_llama_dir)))
    caplog.set_level(logging.WARNING)
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    resp = await client.post("/v1/completions", data=b"not compressed at all", headers=headers)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "invalid_body" and encoding in error["message"], error
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    packed = gzip.compress(BODY) if encoding == "gzip" else zlib.compress(BODY)
    assert (await client.post("/v1/completions", data=packed, headers=headers)).status == 200


async def test_a_body_that_stalls_is_answered_408_and_frees_its_intake_place(aiohttp_client, tiny_llama_dir):
    """A client sends its headers and part of its body, then stalls (slowloris): with one intake place it
    holds that place only until --request-read-timeout-s, then it gets 408 request_timeout (counted in the
    rejected metric, its connection closed), the place is free and the next request is served."""
    app = create_app(config(tiny_llama_dir, max_intake_requests=1, request_read_timeout_s=0.5))
    client = await aiohttp_client(app)
    reader, writer = await send_head(client.server.port, len(BODY), BODY[:10])
    try:
        await wait_until(lambda: app[ADMISSION].num_in_intake == 1)
        status, headers, body = await read_answer(reader)
        assert status == 408 and headers["connection"].lower() == "close", (headers, body)
        assert body["error"]["code"] == "request_timeout" and "--request-read-timeout-s" in body["error"]["message"]
    finally:
        writer.close()
    assert app[ADMISSION].num_in_intake == 0
    resp = await client.post("/v1/completions", data=BODY)
    assert resp.status == 200 and (await resp.json())["choices"][0]["finish_reason"] == "length"
    metrics = await (await client.get("/metrics")).text()
    assert 'lorafleet_requests_rejected_total{reason="request_timeout"} 1.0' in metrics


async def test_healthz_answers_while_large_bodies_are_parsed_one_at_a_time(aiohttp_client, tiny_llama_dir,
                                                                          monkeypatch):
    """Four bodies over 64 KiB: the first one's parse is held until released, and /healthz still answers (the
    parse is off the event loop); the other three wait their turn (one parse at a time: each holds the
    interpreter lock), and all four are served afterwards."""
    app = create_app(config(tiny_llama_dir, max_intake_requests=8))
    client = await aiohttp_client(app)
    gate, entered, released, parse_json = threading.Event(), [], [], parse_turns.parse_json

    def held_parse(raw):  # on the event loop, the first would block it until its wait times out
        entered.append(len(raw))
        released.append(gate.wait(10))
        return parse_json(raw)

    monkeypatch.setattr(parse_turns, "parse_json", held_parse)
    large = BODY[:-1] + b" " * (100 * 1024) + b"}"  # valid JSON, padded over LARGE_BODY_BYTES
    assert len(large) > intake.LARGE_BODY_BYTES
    posts = [asyncio.create_task(client.post("/v1/completions", data=large)) for _ in range(4)]
    try:
        await wait_until(lambda: len(entered) == 1 and app[ADMISSION].num_in_intake == 4, timeout=5)
        health = await asyncio.wait_for(client.get("/healthz"), timeout=5)
        assert health.status == 200 and not gate.is_set()
        assert not any(p.done() for p in posts) and len(entered) == 1
    finally:
        gate.set()
    assert [r.status for r in await asyncio.gather(*posts)] == [200] * 4
    assert released == [True] * 4 and len(entered) == 4


async def test_large_parses_rest_after_each_and_tenants_take_turns(monkeypatch):
    """A parse that held the interpreter lock for t seconds is followed by 3t seconds with none (at most about a
    quarter of the interpreter goes to parsing, however many bodies a tenant sends); the next parse is of the tenant served
    longest ago; a body whose caller left while it waited is not parsed."""
    runs = []

    def busy_parse(raw: bytes):  # 50 ms of this thread's CPU time, as a costly body's parse
        start, began = time.thread_time(), time.monotonic()
        while time.thread_time() - start < 0.05:
            pass
        runs.append((raw.decode(), began, time.monotonic()))
        return raw.decode()

    monkeypatch.setattr(parse_turns, "parse_json", busy_parse)
    turns = parse_turns.ParseTurns()
    try:
        jobs = [asyncio.create_task(turns.parse(name.encode(), tenant))
                for name, tenant in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("c1", "c"))]
        await asyncio.sleep(0)
        jobs[4].cancel()  # c1's caller leaves while it waits
        assert await asyncio.wait_for(asyncio.gather(*jobs[:4]), 30) == ["a1", "a2", "a3", "b1"]
        assert [name for name, _, _ in runs] == ["a1", "b1", "a2", "a3"]
        for (_, _, ended), (_, next_began, _) in itertools.pairwise(runs):
            assert next_began - ended >= parse_turns.REST_PER_PARSE * 0.05 * 0.9, runs  # rested after the parse before
    finally:
        turns.shutdown()


@pytest.mark.parametrize("junk", ['{"": []}', "[[]]", "not json", "messages"])
async def test_a_refused_large_body_is_freed_at_once_not_by_a_collection(aiohttp_client, tiny_llama_dir, junk):
    """A large body refused with a 400 (an unknown field, no JSON, or a chat past the context, refused as it is
    tokenized): its parsed objects are freed as the answer goes, by reference counts. The work's future, its
    error and the handler's frame held one another in a cycle, and a flood of such bodies, each of a million
    small objects, held gigabytes until a collection came."""
    import gc

    client = await aiohttp_client(create_app(config(tiny_llama_dir)))
    body = ('{"model": "tiny", "prompt": "x", "max_tokens": 1, "junk": [' + ",".join([junk] * 50_000) + "]}").encode()
    if junk == "messages":
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 50_000}).encode()

    async def refused() -> None:
        path = "/v1/chat/completions" if junk == "messages" else "/v1/completions"
        resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
        assert resp.status == 400, await resp.text()
        if junk == "messages":
            assert (await resp.json())["error"]["code"] == "context_length_exceeded"

    await refused()  # what a first request makes once (imports, caches) is not counted
    gc.collect()
    gc.disable()  # no collection may free what a cycle holds: only reference counts
    try:
        before = len(gc.get_objects())
        for _ in range(3):
            await refused()
        # The answer may reach the client before the handler's frames let go: waited for, never forever (each
        # body is 50,000 objects at least: one kept in a cycle would stay with collections off)
        with contextlib.suppress(AssertionError):
            await wait_until(lambda: len(gc.get_objects()) - before < 20_000, timeout=5)
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert grown < 20_000, grown


async def test_a_client_leaving_during_a_large_parse_keeps_its_place_only_while_the_parse_runs(
        aiohttp_client, tiny_llama_dir, monkeypatch):
    """Two large bodies whose clients leave: the one being parsed keeps its intake place until its parse ends
    (intake places bound the bodies in memory, whoever disconnects); the one waiting its turn is dropped at
    once, its place freed and its body with it, and never parsed."""
    from lorafleet.worker.app_keys import PARSE_TURNS

    app = create_app(config(tiny_llama_dir, max_intake_requests=2))
    client = await aiohttp_client(app)
    gate, entered, parse_json = threading.Event(), [], parse_turns.parse_json

    def held_parse(raw):
        entered.append(len(raw))
        gate.wait(30)
        return parse_json(raw)

    monkeypatch.setattr(parse_turns, "parse_json", held_parse)
    large = BODY[:-1] + b" " * (256 * 1024) + b"}"
    writers = []
    try:
        for _ in range(2):
            _, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(large)}\r\n\r\n".encode() + large)
            await writer.drain()
            writers.append(writer)
        await wait_until(lambda: len(entered) == 1 and app[ADMISSION].num_in_intake == 2, timeout=10)
        for writer in writers:
            writer.close()
        await wait_until(lambda: app[ADMISSION].num_in_intake == 1 and app[PARSE_TURNS]._thread.queued() == 0,
                         timeout=10)
    finally:
        gate.set()
    await wait_until(lambda: app[ADMISSION].num_in_intake == 0, timeout=10)
    assert len(entered) == 1  # the body that waited was never parsed


def test_a_job_cancelled_while_queued_leaves_its_queue_at_once():
    from lorafleet.worker.fair_executor import FairExecutor

    threads, gate = FairExecutor(1), threading.Event()
    try:
        running = threads.submit("a", lambda: gate.wait(10))
        queued = [threads.submit(group, lambda: None) for group in ("a", "b", "b")]
        assert threads.queued() == 3
        class Body:  # what a queued job holds (a request's body)
            pass

        body = Body()
        kept = weakref.ref(body)
        holding = threads.submit("c", lambda held=body: held)
        del body
        assert holding.cancel() and kept() is None  # let go of at once, not when its turn comes
        assert queued[1].cancel() and queued[0].cancel()
        assert threads.queued() == 1
        gate.set()
        assert running.result(10) is True and queued[2].result(10) is None
    finally:
        gate.set()
        threads.shutdown()


async def test_a_body_whose_client_left_while_its_parse_rested_is_not_parsed(monkeypatch):
    parsed = []

    def busy_parse(raw: bytes):
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass
        parsed.append(raw)
        return raw

    monkeypatch.setattr(parse_turns, "parse_json", busy_parse)
    monkeypatch.setattr(parse_turns, "REST_PER_PARSE", 20.0)  # a rest of a second: the cancellation comes within it
    turns = parse_turns.ParseTurns()
    try:
        first = asyncio.create_task(turns.parse(b"first", "a"))
        second = asyncio.create_task(turns.parse(b"second", "a"))
        assert await asyncio.wait_for(first, 30) == b"first"
        second.cancel()  # its job runs now, resting 20 times the first parse's 50 ms before it parses
        await wait_until(lambda: turns._thread._running == 0, timeout=10)  # the job has ended
        assert parsed == [b"first"]
    finally:
        turns.shutdown()


def test_collections_stay_paused_until_the_last_overlapping_pause_ends():
    import gc

    from lorafleet.worker.gc_pause import collections_paused

    assert gc.isenabled()
    first, second = collections_paused(), collections_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second parse still runs
    second.__exit__(None, None, None)
    assert gc.isenabled()


def test_the_intake_bound_is_a_flag_and_an_environment_variable():
    assert config_from_args(WorkerConfig, [], env={}).max_intake_requests == 0  # default: from CPUs, body size
    assert config_from_args(WorkerConfig, [], env={}).intake_limit >= 64  # 256 MiB of 4 MiB bodies at least
    env = {"LORAFLEET_MAX_INTAKE_REQUESTS": "5"}
    assert config_from_args(WorkerConfig, [], env=env).intake_limit == 5
    assert config_from_args(WorkerConfig, ["--max-intake-requests", "3"], env=env).intake_limit == 3
    with pytest.raises(ValueError, match="max_intake_requests must be >= 0"):
        WorkerConfig(max_intake_requests=-1)


def test_the_body_read_deadline_is_a_flag_and_an_environment_variable():
    assert config_from_args(WorkerConfig, [], env={}).request_read_timeout_s == 30.0
    env = {"LORAFLEET_REQUEST_READ_TIMEOUT_S": "2.5"}
    assert config_from_args(WorkerConfig, [], env=env).request_read_timeout_s == 2.5
    assert config_from_args(WorkerConfig, ["--request-read-timeout-s", "7"], env=env).request_read_timeout_s == 7.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="request_read_timeout_s must be a finite number > 0"):
            WorkerConfig(request_read_timeout_s=bad)
