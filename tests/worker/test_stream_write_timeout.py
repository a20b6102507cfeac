"""--stream-write-timeout-s: a stream whose client stops reading (its send buffer stays full) is cut off
once the limit passes, as if the client had left: its sequences are aborted and its admission seats given
back, so clients that stop reading cannot hold the worker's or their tenant's seats. Real HTTP against the
tiny model; the full send buffer is made certain by holding the stream's second write."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest
from aiohttp import web

from lorafleet.worker.cli import config_from_args
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.worker.test_request_timeout import ADMIN, state

LIMIT_S = 0.2


def hold_second_write(monkeypatch, held_for) -> asyncio.Event:
    """The second write of the responses `held_for` picks waits for good, as for a client that stopped reading
    (its send buffer full); the event is set once it waits."""
    held, real_write, writes = asyncio.Event(), web.StreamResponse.write, [0]

    async def write(self, data: bytes) -> None:
        if held_for(self):
            writes[0] += 1
            if writes[0] == 2:  # this write waits for room that never comes
                held.set()
                await asyncio.Event().wait()
        await real_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    return held


async def test_a_stream_whose_client_stops_reading_is_cut_off_and_gives_its_seats_back(
        aiohttp_client, tiny_llama_dir, monkeypatch, caplog):
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", admin_token=ADMIN["Authorization"][7:],
                          stream_write_timeout_s=LIMIT_S)
    client = await aiohttp_client(create_app(config))
    held = hold_second_write(monkeypatch, lambda response: response.headers.get("Content-Type") == "text/event-stream")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker"):
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200 and (await resp.content.readline()).startswith(b"data: ")
        await asyncio.wait_for(held.wait(), 30)
        with contextlib.suppress(aiohttp.ClientError):
            await asyncio.wait_for(resp.content.read(), 30)  # cut off: the stream ends without [DONE]
        for _ in range(2000):
            s = await state(client)
            if s["requests"] == {"running": 0, "waiting": 0, "admitted": 0} and s["kv"]["num_used_pages"] == 0:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError(f"left behind: {s}")
    assert [r for r in caplog.records if "--stream-write-timeout-s" in r.getMessage()], caplog.text
    resp = await client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3})
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_the_write_limit_is_a_positive_number(value, capsys):
    assert config_from_args(WorkerConfig, [], env={}).stream_write_timeout_s == 60.0
    assert config_from_args(WorkerConfig, ["--stream-write-timeout-s", "5"], env={}).stream_write_timeout_s == 5.0
    with pytest.raises(SystemExit):
        config_from_args(WorkerConfig, ["--stream-write-timeout-s", value], env={})
    err = capsys.readouterr().err
    assert "--stream-write-timeout-s must be a finite number > 0" in err or "expected a finite number" in err, err


class Transport:
    """A send buffer that shrinks by `step` bytes each time it is looked at, down to `floor`; the write it
    belongs to ends once it has been looked at `checks` times."""

    def __init__(self, size: int, step: int, checks: int) -> None:
        self.size, self.step, self.checks, self.ended = size, step, checks, asyncio.Event()

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        size = self.size
        self.size = max(0, self.size - self.step)
        self.checks -= 1
        if self.checks < 0:
            self.ended.set()
        return size


async def test_a_client_that_keeps_taking_bytes_is_never_cut_off_however_long_the_write():
    """The limit is on a window without progress, not on one write: a slow reader's write waits for many
    windows, each seeing the buffer shrink, and completes."""
    from lorafleet.worker.stream_writes import written_in_time

    slow = Transport(100_000, 1_000, checks=5)  # five windows of progress, then the write ends
    assert await written_in_time(slow.ended.wait(), slow, 0.01)
    stuck = Transport(100_000, 0, checks=1_000)  # no byte taken: cut after one window
    write = asyncio.ensure_future(stuck.ended.wait())
    assert not await written_in_time(write, stuck, 0.01)
    await asyncio.sleep(0)
    assert write.cancelled()


async def test_a_whole_answer_whose_client_stops_reading_is_cut_off(aiohttp_client, tiny_llama_dir, monkeypatch):
    """A large answer that is not streamed (echo with logprobs, megabytes for big n) to a client that stopped
    reading: aiohttp would hold it in the send buffer for the life of the connection. It is written under the
    same limit and the connection cut; a small answer, and one read, are sent as before."""
    from lorafleet.worker import stream_writes

    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128),
                          served_model_name="tiny", stream_write_timeout_s=LIMIT_S)
    client = await aiohttp_client(create_app(config))
    real_write = web.StreamResponse.write
    # a whole answer sent in pieces
    held = hold_second_write(monkeypatch, lambda response: (response.content_length or 0) > stream_writes.LARGE_ANSWER_BYTES)
    body = {"model": "tiny", "prompt": "hi " * 30, "max_tokens": 2, "echo": True, "logprobs": 5, "n": 8,
            "temperature": 0}
    with pytest.raises(aiohttp.ClientError):
        resp = await client.post("/v1/completions", json=body)
        await asyncio.wait_for(resp.read(), 30)  # cut off: headers and no body, or nothing
    assert held.is_set()
    small = await client.post("/v1/completions", json={**body, "n": 1, "logprobs": None, "echo": False})
    assert small.status == 200 and (await small.json())["choices"]
    monkeypatch.setattr(web.StreamResponse, "write", real_write)
    whole = await client.post("/v1/completions", json=body)
    assert whole.status == 200 and len((await whole.json())["choices"]) == 8
    assert len(await whole.read()) > stream_writes.LARGE_ANSWER_BYTES


async def test_a_whole_answer_to_a_client_that_reads_slowly_is_sent_whole():
    """The client reads an 8 MiB answer steadily but slower than localhost's kernel buffers fill: the bytes it
    takes leave the kernel's send queue first, the transport's buffer only later. Progress counts both, so it is
    never taken for a client that stopped reading (it got 3.98 of 4 MiB, then the connection was cut)."""
    import socket
    import time

    from lorafleet.worker.stream_writes import sent_in_time

    body, outcome = b"x" * (8 << 20), []

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await sent_in_time(request, web.Response(body=body, content_type="application/json"), 1.0)
        except ConnectionResetError as exc:
            outcome.append(exc)
            raise

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    try:
        sock.connect(("127.0.0.1", site._server.sockets[0].getsockname()[1]))
        sock.setblocking(False)
        await loop.sock_sendall(sock, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        got, start = 0, time.monotonic()
        while got < len(body) and time.monotonic() - start < 30:
            data = await asyncio.wait_for(loop.sock_recv(sock, 64 * 1024), 10)
            if not data:
                break
            got += len(data)
            await asyncio.sleep(0.02)
    finally:
        sock.close()
        await runner.cleanup()
    assert not outcome and got >= len(body), (got, outcome)
