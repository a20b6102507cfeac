"""The worker's lifecycle as a Kubernetes probe or a client sees it: health when the engine thread
dies, SIGTERM while the model loads, and a second SIGTERM while in-flight requests drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import lorafleet
from lorafleet.worker.app_keys import ENGINE
from lorafleet.worker.cli import config_from_args
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.worker.test_server import WorkerProcess


def config(tiny_llama_dir, engine: dict | None = None, **worker) -> WorkerConfig:
    return WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256,
                                            **(engine or {})), served_model_name="tiny", **worker)


async def test_a_dead_engine_thread_fails_liveness_and_ends_the_streams_in_flight(aiohttp_client, tiny_llama_dir):
    """A bug outside a step ends the engine thread: the stream in flight ends with an in-band error (it
    does not hang), and /healthz turns 503 so that the kubelet restarts the container (a pod that only
    turns unready would stay so for ever). vLLM's /health, which probes and routers set up for vLLM ask, too."""
    app = create_app(config(tiny_llama_dir))
    client = await aiohttp_client(app)
    for probe in (client.get("/healthz"), client.get("/health"), client.get("/ping"), client.post("/ping")):
        assert (await probe).status == 200  # /ping: SageMaker's, which vLLM answers too
    assert await (await client.get("/version")).json() == {"version": lorafleet.__version__}
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 200,
                                                      "ignore_eos": True, "stream": True})
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: {")

    def broken():
        raise RuntimeError("scheduler bug")

    app[ENGINE].engine.has_unfinished = broken
    rest = await asyncio.wait_for(resp.read(), timeout=60)  # the old engine thread left it hanging
    events = [line.removeprefix(b"data: ") for line in rest.splitlines() if line.startswith(b"data: ")]
    last = json.loads(events[-1])
    assert last["error"]["code"] == "engine_error" and "engine thread died" in last["error"]["message"], last
    health = await client.get("/healthz")
    assert health.status == 503 and "scheduler bug" in (await health.json())["error"]
    assert (await client.get("/health")).status == 503 and (await client.post("/ping")).status == 503
    assert (await client.get("/readyz")).status == 503
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 500 and "engine thread died" in (await resp.json())["error"]["message"]


async def test_forwards_failing_in_a_row_fail_liveness_and_fewer_do_not(aiohttp_client, tiny_llama_dir):
    """A broken device fails every forward: after --max-failed-forwards (3 here) in a row /healthz and
    /readyz turn 503, so that the kubelet restarts the container. Fewer in a row, with forwards that
    succeed between them (a bad adapter, one bad batch), fail only their requests: health stays green."""
    app = create_app(config(tiny_llama_dir, engine={"max_failed_forwards": 3}))
    client = await aiohttp_client(app)
    engine = app[ENGINE].engine
    run, failing = engine.runner.run, [False]

    def faulty_run(batch):
        if failing[0]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run(batch)

    engine.runner.run = faulty_run

    async def complete() -> int:  # one forward: the prefill samples the only token
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        return resp.status

    for fail in (True, True, False, True, True, False, True, True):
        failing[0] = fail
        assert await complete() == (500 if fail else 200)
        assert (await client.get("/healthz")).status == 200 and (await client.get("/readyz")).status == 200
    assert engine.forward_failures.in_a_row == 2
    assert await complete() == 500  # the third in a row
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while (health := await client.get("/healthz")).status == 200:  # the engine thread ends just after
        assert loop.time() < deadline, "healthz stayed 200"
        await asyncio.sleep(0.01)
    assert health.status == 503 and "3 forwards in a row failed" in (await health.json())["error"]
    assert (await client.get("/readyz")).status == 503
    assert config_from_args(WorkerConfig, [], env={}).engine.max_failed_forwards == 8
    assert config_from_args(WorkerConfig, [], env={"LORAFLEET_MAX_FAILED_FORWARDS": "2"}).engine.max_failed_forwards == 2
    assert config_from_args(WorkerConfig, ["--max-failed-forwards", "5"], env={}).engine.max_failed_forwards == 5


# ---- process: signals while loading and while draining -----------------------------------------------------
def _wait_for_log(worker, needle: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in worker.log_path.read_text():
        if worker.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {needle!r} in the worker's log:\n{worker.log_path.read_text()[-3000:]}")
        time.sleep(0.05)


_SLOW_LOAD = """
import sys, torch
from lorafleet.worker.engine import Engine
from lorafleet.worker.__main__ import main
def slow_load(self, *args, **kwargs):
    x = torch.randn(128, 128)
    print("model load started", flush=True)
    while True:  # a model that takes minutes to load, inside torch (GIL released) most of the time
        x @ x
Engine.__init__ = slow_load
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("sig", "codes"), [(signal.SIGTERM, {0}), (signal.SIGINT, {0, 130})], ids=["term", "int"])
def test_a_signal_while_the_model_loads_exits_at_once(tiny_llama_dir, tmp_path, sig, codes):
    """A pod deleted while its model loads stops at once (exit 0, saying so) instead of lingering until
    the load is done and the kubelet kills it, and never aborts (exit 134) on the load thread still
    inside torch when the interpreter shuts down."""
    log_path = tmp_path / "w.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD, "--model", str(tiny_llama_dir), "--port", "0",
                                 "--host", "127.0.0.1", "--dtype", "float32"], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            deadline = time.monotonic() + 120
            while "model load started" not in log_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.05)
            proc.send_signal(sig)
            assert proc.wait(60) in codes, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert "stopping while the model loads" in text and "terminate called" not in text, text[-3000:]


_TERM_BEFORE_LOGGING = """
import logging, os, signal, sys
import lorafleet.worker.__main__ as worker_main
configure = logging.basicConfig
def term_then_configure(*args, **kwargs):  # the flags are checked: torch and the server are imported next
    os.kill(os.getpid(), signal.SIGTERM)
    configure(*args, **kwargs)
logging.basicConfig = term_then_configure
sys.exit(worker_main.main(sys.argv[1:]))
"""


def test_a_sigterm_before_the_first_log_line_is_a_clean_stop(tiny_llama_dir):
    """A pod deleted in its first seconds (flags checked, torch importing, no handler of the server's yet)
    exits 0 as it does once serving: not 143, the kill of a process that ignores its stop signal."""
    done = subprocess.run([sys.executable, "-c", _TERM_BEFORE_LOGGING, "--model", str(tiny_llama_dir), "--port", "0",
                           "--host", "127.0.0.1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and "model" not in done.stdout, done.stderr[-3000:]


def test_a_second_sigterm_ends_the_grace_with_an_in_band_error_and_exits_0(tiny_llama_dir, tmp_path):
    """SIGTERM starts a long grace; a second SIGTERM ends the requests in flight at once as the grace's
    end would (a stream gets its error chunk, not a broken transfer) and the process still exits 0."""
    import urllib.request

    worker = WorkerProcess(["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512",
                            "--shutdown-grace-s", "300"], tmp_path / "w.log")
    try:
        url = worker.wait_ready()
        body = {"model": worker_model(url), "prompt": ["bye"] * 4, "n": 16, "max_tokens": 500, "ignore_eos": True,
                "stream": True}
        req = urllib.request.Request(f"{url}/v1/completions", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.readline().startswith(b"data: {")
            worker.proc.send_signal(signal.SIGTERM)
            _wait_for_log(worker, "shutting down: 1 requests in flight")
            worker.proc.send_signal(signal.SIGTERM)
            rest = r.read().decode()  # a broken transfer raises IncompleteRead here
        events = [line.removeprefix("data: ") for line in rest.splitlines() if line.startswith("data: ")]
        last = json.loads(events[-1])
        assert last["error"]["code"] == "shutting_down" and "stop at once" in last["error"]["message"], last
        assert worker.proc.wait(60) == 0, worker.log_path.read_text()[-3000:]
    finally:
        worker.stop()


def worker_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models") as r:
        return json.loads(r.read())["data"][0]["id"]
