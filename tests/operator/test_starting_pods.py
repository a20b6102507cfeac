"""A new worker pod is told its pool's adapters while its model loads (controller.py, reconcile.py ``starting``):
its real stager sidecar stages them meanwhile, reaches the engine once it is up, and only then lets the pod
become ready, so that the Service never sends it a request for an adapter it does not know. Against a real
stager app, an engine admin API that answers as a starting engine does, and a ready pod's fake sidecar."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from aiohttp import web

from lorafleet.operator.controller import PoolController
from lorafleet.operator.workers import QUICK_READ_S, StagerClient, Worker
from lorafleet.worker.stager_http import STAGER, create_app
from tests.worker.engine_admin_stub import HANG_S, until
from tests.worker.test_stager_bounds import TOKEN, FakeStore, config
from tests.worker.test_stager_readiness import StartingEngine

from .fake_stager import FakeStager
from .test_finalizers import not_ready
from .test_handlers import POOL, adapter_body, pod_body

KEY = (POOL["metadata"]["namespace"], "main")
SIDECAR_TOKEN = TOKEN


def _worker(pod: dict) -> Worker:
    return Worker(pod["metadata"]["name"], f"http://127.0.0.1:{pod['spec']['containers'][1]['ports'][0]['containerPort']}",
                  pod["metadata"].get("uid", ""))


@pytest.fixture()
async def ready_stager():
    async with FakeStager(SIDECAR_TOKEN) as s:
        yield s


async def _starting_pod(aiohttp_server, tmp_path, monkeypatch):
    engine = StartingEngine()
    engine_url = str((await aiohttp_server(engine.app())).make_url(""))
    app = create_app(dataclasses.replace(config(tmp_path), engine_url=engine_url, ready_after_push=True,
                                         s3_allow=["adapters/"]))
    server = await aiohttp_server(app)
    return engine, app, FakeStore(app[STAGER], monkeypatch), server.port


async def _delete_chat(controller: PoolController, pods: list[dict]):
    """A pass with sql and chat, then one with chat being deleted: (that plan, chat's body), the starting pod
    told sql alone."""
    await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql"), adapter_body("chat")], pods=pods)
    deleting = adapter_body("chat")
    deleting["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql"), deleting], pods=pods)
    assert [a.name for a in plan.pushes["worker-1"].adapters] == ["sql"]
    return plan, deleting


async def _ready(port: int) -> int:
    import aiohttp
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/readyz") as resp:
        return resp.status


async def test_a_starting_pod_is_told_the_pool_s_adapters_and_becomes_ready_with_them(
        ready_stager, aiohttp_server, tmp_path, monkeypatch):
    engine, app, store, port = await _starting_pod(aiohttp_server, tmp_path, monkeypatch)
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=2.0), push_wait=0.2)
    adapters = [adapter_body("sql", warm=2), adapter_body("chat", warm=0)]
    pods = [pod_body("worker-0", ready_stager.port), not_ready(pod_body("worker-1", port))]
    try:
        plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
        told = plan.pushes["worker-1"]
        # Every adapter registered, none warm: GPU placement waits until it is ready; it counts in no status.
        assert sorted(a.name for a in told.adapters) == ["chat", "sql"] and not any(a.warm for a in told.adapters)
        assert plan.placement["sql"] == ["worker-0"] and "/1 workers" in plan.adapter_statuses["sql"]["message"]
        await until(lambda: len(store.calls) == 2)  # downloaded while the model loads
        assert engine.pushes == [] and await _ready(port) == 503

        # Accepted at once (its engine applies nothing yet): the next passes leave its push staging alone.
        sidecar = app[STAGER]
        await until(lambda: controller.push_records[KEY].last(_worker(pods[1])) is not None)
        for _ in range(3):
            plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
            assert "worker-1" not in plan.pushes and engine.pushes == []
        assert sidecar.generation == told.generation
        engine.started.set()
        await until(lambda: engine.pushes and app[STAGER].delivered)
        assert sorted(a["name"] for a in engine.pushes[-1]["adapters"]) == ["chat", "sql"]
        assert await _ready(port) == 200

        # Ready now: a worker like any other; sql's second warm copy goes to it, no download needed.
        pods[1]["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        async with asyncio.timeout(HANG_S):
            while True:
                plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
                if sorted(plan.placement["sql"]) == ["worker-0", "worker-1"] and not plan.pushes:
                    break
                await asyncio.sleep(0.05)
        await until(lambda: any(a["warm"] for a in engine.pushes[-1]["adapters"] if a["name"] == "sql"))
        assert len(store.calls) == 2
    finally:
        engine.started.set()
        await controller.flights.close()


async def test_a_pod_that_was_ready_is_not_told_a_new_set_while_not_ready(ready_stager, aiohttp_server, tmp_path,
                                                                          monkeypatch):
    """A pod whose sidecar delivered a push and whose readiness then fails (under load, say) keeps what it holds:
    it is told nothing but the unloading of a deleted adapter, as before."""
    engine, app, _, port = await _starting_pod(aiohttp_server, tmp_path, monkeypatch)
    engine.started.set()
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=2.0), push_wait=5.0)
    pods = [pod_body("worker-0", ready_stager.port), pod_body("worker-1", port)]
    adapters = [adapter_body("sql", warm=2)]
    try:
        await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
        await until(lambda: app[STAGER].delivered)
        pods[1] = not_ready(pods[1])
        plan = await controller.run(KEY, pools=[POOL], adapters=[*adapters, adapter_body("chat")], pods=pods)
        assert "worker-1" not in plan.pushes and "worker-1" not in plan.desired
    finally:
        await controller.flights.close()


async def test_a_starting_pod_whose_engine_never_starts_lets_a_deleted_adapter_go(
        ready_stager, aiohttp_server, tmp_path, monkeypatch):
    """Its engine crash-loops: the push without the deleted adapter replaces the one staging at once, and the
    pod no longer holds up the finalizer."""
    _, _, _, port = await _starting_pod(aiohttp_server, tmp_path, monkeypatch)
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=2.0), push_wait=2.0)
    pods = [pod_body("worker-0", ready_stager.port), not_ready(pod_body("worker-1", port))]
    try:
        plan, deleting = await _delete_chat(controller, pods)
        plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql"), deleting], pods=pods)
        assert "worker-1" not in plan.unloading["chat"] and "worker-1" not in plan.pushes
    finally:
        await controller.flights.close()


async def test_a_serving_pod_whose_sidecar_restarts_keeps_its_warm_copies(ready_stager, aiohttp_server, tmp_path,
                                                                          monkeypatch):
    """A pod given warm copies was ready: a restarted sidecar that cannot tell what its engine holds (so it
    awaits a push) while the pod is not ready is told that push's set again, pinned copies and all, not the
    starting set, which would un-pin them; once it reached the engine the pod is ready again."""
    engine, app, _, port = await _starting_pod(aiohttp_server, tmp_path, monkeypatch)
    engine.started.set()
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=2.0), push_wait=5.0)
    pods = [pod_body("worker-0", ready_stager.port), pod_body("worker-1", port)]
    adapters = [adapter_body("sql", warm=2, pinned=True)]
    try:
        plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
        assert plan.pushes["worker-1"].adapters[0].pinned
        await until(lambda: app[STAGER].delivered)
        sidecar = app[STAGER]
        sidecar.delivered, sidecar.generation = False, 0  # as a restarted sidecar that could not read its engine
        pods[1] = not_ready(pods[1])
        adapters.append(adapter_body("chat", warm=0))  # added since: told too, as the pool holds it now
        plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
        told = {a.name: (a.warm, a.pinned) for a in plan.pushes["worker-1"].adapters}
        assert told == {"sql": (True, True), "chat": (False, False)}
        await until(lambda: sidecar.delivered)
        assert [a["pinned"] for a in engine.pushes[-1]["adapters"] if a["name"] == "sql"] == [True]
        plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
        assert "worker-1" not in plan.pushes  # delivered: no longer starting, and not ready yet: left as it is
    finally:
        await controller.flights.close()


async def test_a_restarting_pod_s_warm_copy_that_a_ready_pod_took_over_is_not_pinned_twice(
        ready_stager, aiohttp_server, tmp_path, monkeypatch):
    """warm: 1, pinned: the copy was on worker-1; it restarts and placement moves the copy to worker-0, which is
    ready: worker-1 is told the adapter registered only, not a second pinned copy the spec does not ask for."""
    engine, app, _, port = await _starting_pod(aiohttp_server, tmp_path, monkeypatch)
    engine.started.set()
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=2.0), push_wait=5.0)
    adapters = [adapter_body("sql", warm=1, pinned=True)]
    try:
        plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=[pod_body("worker-1", port)])
        assert plan.pushes["worker-1"].adapters[0].pinned
        await until(lambda: app[STAGER].delivered)
        app[STAGER].delivered, app[STAGER].generation = False, 0  # restarted
        pods = [pod_body("worker-0", ready_stager.port), not_ready(pod_body("worker-1", port))]
        plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
        assert plan.placement["sql"] == ["worker-0"] and plan.pushes["worker-0"].adapters[0].pinned
        again = plan.pushes["worker-1"].adapters[0]
        assert (again.warm, again.pinned) == (False, False)
    finally:
        await controller.flights.close()


async def test_an_older_sidecar_that_does_not_say_which_push_it_holds_is_not_pushed_every_pass(
        ready_stager, aiohttp_server, tmp_path, monkeypatch):
    """A sidecar from before `pushed_generation` (an operator upgraded first): the versions it lists say that
    it holds its push, so the passes leave the push staging alone."""
    engine, app, _, port = await _starting_pod(aiohttp_server, tmp_path, monkeypatch)
    state = app[STAGER].state

    async def older_state():
        report = await state()
        report.pushed_generation = None
        return report

    monkeypatch.setattr(app[STAGER], "state", older_state)
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=2.0), push_wait=2.0)
    pods = [pod_body("worker-0", ready_stager.port), not_ready(pod_body("worker-1", port))]
    try:
        plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
        assert "worker-1" in plan.pushes
        for _ in range(3):
            plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
            assert "worker-1" not in plan.pushes
    finally:
        engine.started.set()
        await controller.flights.close()


async def test_a_hung_sidecar_of_a_pod_not_ready_costs_a_pass_little(ready_stager, aiohttp_server, tmp_path):
    """A pod on a node that is down stays Running and not ready with an address that does not answer: its read
    is cut short (QUICK_READ_S), where a ready pod's may take the whole request timeout."""
    hang = asyncio.Event()

    async def hung(request):
        await hang.wait()

    app = web.Application()
    app.router.add_get("/v1/state", hung)
    port = (await aiohttp_server(app)).port
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=4 * QUICK_READ_S), push_wait=0.1)
    pods = [pod_body("worker-0", ready_stager.port), not_ready(pod_body("worker-1", port))]
    try:
        started = time.monotonic()
        plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
        assert time.monotonic() - started < 3 * QUICK_READ_S and "worker-1" not in plan.desired
    finally:
        hang.set()
        await controller.flights.close()


async def test_a_starting_pod_holds_up_a_deleted_adapter_s_finalizer_until_it_is_told(
        ready_stager, aiohttp_server, tmp_path, monkeypatch):
    """Its push in flight names the adapter: delivered once the engine is up, it would serve it. Until a push
    without it is answered, it counts in the adapter's unloading."""
    engine, app, _, port = await _starting_pod(aiohttp_server, tmp_path, monkeypatch)
    controller = PoolController(StagerClient(token=SIDECAR_TOKEN, timeout=2.0), push_wait=0.2)
    pods = [pod_body("worker-0", ready_stager.port), not_ready(pod_body("worker-1", port))]
    try:
        plan, deleting = await _delete_chat(controller, pods)
        assert "worker-1" in plan.unloading["chat"]
        engine.started.set()
        async with asyncio.timeout(HANG_S):
            while "worker-1" in plan.unloading["chat"]:
                await asyncio.sleep(0.05)
                plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql"), deleting], pods=pods)
        assert [a["name"] for a in engine.pushes[-1]["adapters"]] == ["sql"]
    finally:
        engine.started.set()
        await controller.flights.close()
