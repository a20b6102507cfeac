"""What the stager reports as applied (worker/stager_engine.py): only what it forwarded itself, from the moment
the engine may have applied it. A stager restarted between a push's two steps reports the engine's generation
as not applied (it may carry that push's first step only); a report read while the engine answers a forward
says it is applied; a stager that has forwarded nothing yet takes what the engine reports it holds as forwarded,
and answers the operator's push (`Prefer: respond-async`) once staged only if the engine cannot tell, so that
it is not pushed again every pass; a hung engine report does not hold up the next push. Against an engine
admin API stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import pytest
from aiohttp import web

from lorafleet.operator.reconcile import PoolSettings, _next_generation
from lorafleet.operator.reports import WorkerIndex, WorkerReport
from lorafleet.worker.directives import DesiredState, ReportedState
from lorafleet.worker.disk_cache import dir_bytes
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_http import STAGER, create_app
from tests.worker.engine_admin_stub import HANG_S, EngineAdminStub, split, until
from tests.worker.test_stager_bounds import TOKEN, FakeStore, config


class Engine(EngineAdminStub):
    """The engine's admin API: applies a push of a higher generation than its own (a lower one: 409), reports
    the last one's versions at tier cpu. While `gate` is clear, a push it applied is answered only once the test
    sets it; `applied` is set at every push applied."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0
        self.applied = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()

    def applied_generation(self) -> int:
        return self.generation

    async def put_state(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["generation"] < self.generation:
            return web.json_response({**self.report(), "error": "stale generation"}, status=409)
        if body["generation"] > self.generation:
            self.pushes.append(body)
            self.generation = body["generation"]
            self.applied.set()
        await self.gate.wait()
        return web.json_response(self.report())


def adapter(name: str, version: str, *, canary: str | None = None, weight: int = 0, warm: bool = False) -> dict:
    def ref(v: str) -> dict:
        return {"version": v, "uri": f"s3://adapters/team/{name}-{v}/"}

    return {"name": name, "tenant": "acme", "stable": ref(version), "warm": warm,
            **({"canary": ref(canary), "canary_weight": weight} if canary else {})}


def push(generation: int, *adapters: dict) -> DesiredState:
    return DesiredState.from_dict({"generation": generation, "adapters": list(adapters)})


def pushed_again(report: ReportedState, desired: DesiredState) -> bool:
    """Whether the operator's next pass pushes `desired` again to a worker that reports `report`."""
    x = WorkerIndex.of(WorkerReport("w0", report, last_pushed=desired))
    return _next_generation(x, desired.adapters, PoolSettings(), 0)[1]


def release_all(store: FakeStore) -> None:
    for call in store.calls:
        call[1].set()


async def test_a_stager_restarted_between_a_push_s_two_steps_reports_it_not_applied(aiohttp_server, tmp_path,
                                                                                  monkeypatch):
    """Push 2000 gives a a canary c2 (downloading) and turns b's canary to 0 %: the first step reaches the engine
    (a without its canary) under the push's own number; the sidecar restarts before c2 is in. The new stager has
    forwarded nothing: it reports the engine's generation as not applied, and the operator pushes again."""
    engine = Engine()
    stager_config = dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server))
    old = Stager(stager_config)
    store = FakeStore(old, monkeypatch)
    await asyncio.wait_for(old.apply(push(1000, adapter("a", "v1", warm=True),
                                          adapter("b", "v1", canary="v2", weight=30))), HANG_S)
    num_downloads = old.counts["downloads"]
    store.hold = True
    desired = push(2000, adapter("a", "v1", canary="c2", weight=20, warm=True),
                   adapter("b", "v1", canary="v2", weight=0))
    num_calls = len(store.calls)
    task, begun = old.start(desired)
    try:
        await asyncio.wait_for(begun.wait(), HANG_S)
        assert engine.generation == 2000 and split(engine.pushes[-1], "a") == ("v1", None, 0)
        assert split(engine.pushes[-1], "b") == ("v1", "v2", 0)
        assert (await old.state()).generation_applied == 2000 and not task.done()
        await until(lambda: len(store.calls) > num_calls)  # c2's download has begun (held)
        task.cancel()  # the old process ends: its push never forwards c2
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        release_all(store)
    await until(lambda: old.counts["downloads"] > num_downloads)  # c2's download (shielded) ends in its thread

    new = Stager(stager_config)
    FakeStore(new, monkeypatch)
    report = await new.state()
    assert engine.generation == 2000 and report.generation_applied == 0, report
    assert pushed_again(report, desired)


@pytest.mark.parametrize("engine_ahead", [False, True])
async def test_a_report_read_while_the_engine_answers_a_forward_says_it_is_applied(aiohttp_server, tmp_path,
                                                                                  monkeypatch, engine_ahead):
    """The engine applied push 2 (a made warm: forwarded at once) and its answer is not back yet: a report read
    then says push 2 is applied, as it will once the answer is in. `engine_ahead`: the engine applied a higher
    generation meanwhile (forwarded by a stager before this one), so the stager's first PUT gets 409 and the
    push goes above it."""
    engine = Engine()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server)))
    FakeStore(stager, monkeypatch)
    await asyncio.wait_for(stager.apply(push(1, adapter("a", "v1"))), HANG_S)
    if engine_ahead:
        engine.generation = 9000
    engine.applied.clear()
    engine.gate.clear()
    applying = asyncio.ensure_future(stager.apply(push(2, adapter("a", "v1", warm=True))))
    try:
        await asyncio.wait_for(engine.applied.wait(), HANG_S)
        assert engine.pushes[-1]["adapters"][0]["warm"] and engine.generation == (9001 if engine_ahead else 2)
        report = await stager.state()
        assert report.generation_applied == 2 and not applying.done(), report
        assert not pushed_again(report, push(2, adapter("a", "v1", warm=True)))
    finally:
        engine.gate.set()
    await asyncio.wait_for(applying, HANG_S)
    assert (await stager.state()).generation_applied == 2


async def operator_push(client, desired: DesiredState) -> asyncio.Future:
    return asyncio.ensure_future(client.put("/v1/directives", json=desired.to_dict(), headers={
        "Authorization": f"Bearer {TOKEN}", "Prefer": "respond-async"}))


async def test_a_fresh_stager_beside_an_engine_that_cannot_tell_answers_the_first_push_once_staged(
        aiohttp_server, aiohttp_client, tmp_path, monkeypatch):
    """A new stager whose engine serves adapters no push gave it (start-up `--adapters`) does not know what it
    holds, so it leaves out a push's first step: answered at once, the push would be reported as not applied
    until its downloads are in, and the operator would push it again every pass. It answers once the push
    reached the engine."""
    engine = Engine()
    engine.unpushed = ["startup"]
    client = await aiohttp_client(create_app(dataclasses.replace(config(tmp_path),
                                                                 engine_url=await engine.serve(aiohttp_server))))
    store = FakeStore(client.app[STAGER], monkeypatch, hold=True)
    desired = push(1000, adapter("a", "v1"), adapter("b", "v1"))
    answer = await operator_push(client, desired)
    try:
        assert await asyncio.to_thread(store.started.acquire, True, HANG_S)  # a's download, held
        assert engine.pushes == []
    finally:
        store.hold = False
        release_all(store)
    resp = await asyncio.wait_for(answer, HANG_S)
    body = await resp.json()
    assert resp.status == 200 and body["generation_applied"] == 1000, body
    assert not any(s.get("staging") for s in body["adapters"]), body
    assert [sorted(a["name"] for a in p["adapters"]) for p in engine.pushes] == [["a", "b"]]
    assert not pushed_again(ReportedState.from_dict(body), desired)


@pytest.mark.parametrize("engine_holds", ["nothing", "an earlier stager's push"])
async def test_a_fresh_stager_answers_the_operator_s_first_push_before_its_downloads(
        aiohttp_server, aiohttp_client, tmp_path, monkeypatch, engine_holds):
    """A new pod's engine (it serves nothing) or one an earlier stager pushed to (the sidecar restarted): the new
    stager asks it what it holds, so the operator's first push is answered 202 at once, reported as applied
    with its downloads staging (not pushed again), and the pool's next edit is not held up behind them; the
    engine keeps what it serves meanwhile, and gets the downloaded versions once in. Before, the push was
    answered only once every download was in."""
    engine = Engine()
    url = await engine.serve(aiohttp_server)
    if engine_holds != "nothing":
        earlier = Stager(dataclasses.replace(config(tmp_path), engine_url=url))
        FakeStore(earlier, monkeypatch)
        await asyncio.wait_for(earlier.apply(push(1000, adapter("a", "v1"))), HANG_S)
    served = list(engine.pushes)
    client = await aiohttp_client(create_app(dataclasses.replace(config(tmp_path), engine_url=url)))
    store = FakeStore(client.app[STAGER], monkeypatch, hold=True)
    desired = push(2000, adapter("a", "v1"), adapter("b", "v1"))
    try:
        resp = await asyncio.wait_for(await operator_push(client, desired), HANG_S)  # b's download is held
        body = await resp.json()
        assert resp.status == 202 and body["generation_applied"] == 2000, body
        report = ReportedState.from_dict(body)
        assert report.find("b", "v1").staging and not pushed_again(report, desired), body
        assert engine.pushes == served  # what it holds is what the push asks for at once (a's copy is cached)
    finally:
        release_all(store)
        store.hold = False
    await until(lambda: len(engine.pushes) > len(served))
    assert sorted(a["name"] for a in engine.pushes[-1]["adapters"]) == ["a", "b"]
    assert len(store.calls) == (2 if engine_holds == "nothing" else 1)  # a's earlier copy serves: not downloaded
    assert (await client.app[STAGER].state()).generation_applied == 2000


class RefusingEngine(Engine):
    """Answers the next `refuse` pushes 500 without applying them (an engine restarting, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = 0

    async def put_state(self, request: web.Request) -> web.Response:
        if self.refuse:
            self.refuse -= 1
            return web.json_response({"error": {"message": "the engine is starting"}}, status=500)
        return await super().put_state(request)


async def test_a_push_the_engine_refused_is_applied_when_sent_again_with_its_generation(aiohttp_server, tmp_path,
                                                                                      monkeypatch):
    """The engine refused push 2 (a made warm, forwarded at once): the stager recorded push 2 as applied all the
    same, so the same push sent again was a no-op answered 200, and the engine never got it."""
    engine = RefusingEngine()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server)))
    FakeStore(stager, monkeypatch)
    await asyncio.wait_for(stager.apply(push(1, adapter("a", "v1"))), HANG_S)
    engine.refuse = 1
    with pytest.raises(Exception):  # noqa: B017 - whatever the forward raises, the push is not applied
        await asyncio.wait_for(stager.apply(push(2, adapter("a", "v1", warm=True))), HANG_S)
    assert engine.generation == 1
    report = await asyncio.wait_for(stager.apply(push(2, adapter("a", "v1", warm=True))), HANG_S)
    assert engine.generation == 2 and engine.pushes[-1]["adapters"][0]["warm"]
    assert report.generation_applied == 2


@pytest.mark.parametrize("since", ["a vLLM load", "a vLLM unload"])
async def test_a_fresh_stager_numbers_its_first_forward_above_what_the_engine_applied(aiohttp_server, tmp_path,
                                                                                     monkeypatch, since):
    """An earlier stager forwarded push 2000 in two steps, as engine generations 2000 and 2001, and the engine
    then took a vLLM load (what it holds is not known) or unload (it holds nothing). The new stager's push 2001
    used to be forwarded as 2001, which the engine answers 200 and ignores (it applied that generation): it
    never got the push, reported as applied all the same."""
    engine = Engine()
    stager_config = dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server))
    engine.generation, engine.unpushed = 2001, ["loaded"] if since == "a vLLM load" else []
    stager = Stager(stager_config)
    FakeStore(stager, monkeypatch)
    report = await asyncio.wait_for(stager.apply(push(2001, adapter("a", "v1"), adapter("b", "v1"))), HANG_S)
    assert engine.generation == 2002 and [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a", "b"]
    assert report.generation_applied == 2001


class HangingReports(Engine):
    """Its state report hangs while `reports_hang` is clear and `hang_reports` is set (a hung engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.hang_reports, self.reports_hang, self.report_hung = False, asyncio.Event(), asyncio.Event()

    async def get_state(self, request: web.Request) -> web.Response:
        if self.hang_reports:
            self.report_hung.set()
            await self.reports_hang.wait()
        return await super().get_state(request)


async def test_a_hung_engine_report_after_a_push_does_not_hold_up_the_next_one(aiohttp_server, tmp_path, monkeypatch):
    """Push 2's download is in and forwarded; the report that ends the push hangs (a hung engine). Push 3, which
    only makes a warm, waited behind it: the report was read holding the lock a push's first step takes."""
    engine = HangingReports()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server)))
    FakeStore(stager, monkeypatch)
    await asyncio.wait_for(stager.apply(push(1, adapter("a", "v1"))), HANG_S)
    engine.hang_reports = True
    second = asyncio.ensure_future(stager.apply(push(2, adapter("a", "v1"), adapter("b", "v1"))))
    try:
        await asyncio.wait_for(engine.report_hung.wait(), HANG_S)  # b forwarded, then the report hangs
        assert [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a", "b"]
        third, begun = stager.start(push(3, adapter("a", "v1", warm=True), adapter("b", "v1")))
        await asyncio.wait_for(begun.wait(), HANG_S)
        assert engine.pushes[-1]["adapters"][0]["warm"] and not second.done()
    finally:
        engine.reports_hang.set()
    await asyncio.wait_for(second, HANG_S)
    await asyncio.wait_for(third, HANG_S)  # left running, it would hold the engine's server open at teardown


class EngineWithoutDirectives(Engine):
    """An engine older than the stager: no GET /admin/v1/directives, so what it holds cannot be adopted."""

    async def get_directives(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Not Found"}}, status=404)


async def test_a_stager_that_cannot_adopt_numbers_its_forward_above_what_the_engine_applied(
        aiohttp_server, tmp_path, monkeypatch):
    """An earlier stager forwarded push 2000's first step (b only) as engine generation 2000, then restarted.
    The new one cannot adopt it: its forward of a+b must not reuse 2000, which the engine would answer 200
    and ignore, while the stager reported 2000 applied."""
    engine = EngineWithoutDirectives()
    url = await engine.serve(aiohttp_server)
    engine.generation = 2000
    engine.pushes.append({"generation": 2000, "adapters": [adapter("b", "v1") | {"canary": None}]})
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=url))
    FakeStore(stager, monkeypatch)
    report = await asyncio.wait_for(stager.apply(push(2000, adapter("a", "v1"), adapter("b", "v1"))), HANG_S)
    assert engine.generation == 2001 and [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a", "b"]
    assert report.generation_applied == 2000


async def test_a_restarted_stager_holds_the_engine_s_copies_before_its_first_push(
        aiohttp_server, aiohttp_client, tmp_path, monkeypatch):
    """The sidecar restarts beside a running engine, its cache too small for one more copy: a stage request
    before the operator's first push (the engine reloading a cold adapter, or the seed) must not evict the
    copies the engine serves, which it loads again from them after a host eviction. The new stager asks the
    engine what it holds as it starts, not only at the first push."""
    engine = Engine()
    url = await engine.serve(aiohttp_server)
    earlier = Stager(dataclasses.replace(config(tmp_path), engine_url=url))
    FakeStore(earlier, monkeypatch)
    await asyncio.wait_for(earlier.apply(push(1000, adapter("a", "v1"), adapter("b", "v1"))), HANG_S)
    served = [Path(a["stable"]["uri"]) for a in engine.pushes[-1]["adapters"]]
    assert len(served) == 2 and all(p.parent == earlier.cache.root for p in served)
    budget = sum(dir_bytes(p) for p in served) + dir_bytes(served[0]) // 2  # no room for a third copy
    client = await aiohttp_client(create_app(dataclasses.replace(config(tmp_path), engine_url=url,
                                                                 stager_cache_bytes=budget)))
    stager = client.app[STAGER]
    FakeStore(stager, monkeypatch)
    assert stager.engine.known and stager.desired is None
    resp = await client.post("/v1/stage", json={"uri": "s3://adapters/team/c-v1/"},
                             headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status == 200, await resp.text()
    assert all(p.is_dir() for p in served), sorted(stager.cache.entries())
    resp = await client.post("/v1/stage", json={"uri": "s3://adapters/team/d-v1/"},
                             headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status == 200 and all(p.is_dir() for p in served)  # c's copy, held by no one, made room
