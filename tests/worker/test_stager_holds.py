"""worker/stager_holds.py: a version a push replaced keeps its copy in the disk cache while the engine still
reports it (the fallback the engine keeps until the new stable version has loaded, and reads from disk again
if it was evicted from memory meanwhile); once the engine no longer does, the copy may go. Against an engine
admin API stand-in on a local port; the object store is replaced by tests/worker/test_stager_bounds.py's."""

from __future__ import annotations

import dataclasses

import pytest
from aiohttp import web

from lorafleet.worker.directives import DesiredState
from lorafleet.worker.disk_cache import dir_bytes
from lorafleet.worker.stager import Stager
from tests.worker.test_stager_bounds import FakeStore, config


async def stand_in_engine(aiohttp_server, reported: list[tuple[str, str]]):
    """An engine admin API that takes every push and reports the (name, version) pairs in `reported`."""
    applied = [0]

    def report() -> web.Response:
        return web.json_response({"generation_applied": applied[0], "adapters": [
            {"name": n, "version": v, "tier": "cpu"} for n, v in reported]})

    async def put_state(request: web.Request) -> web.Response:
        applied[0] = (await request.json())["generation"]
        return report()

    async def get_state(request: web.Request) -> web.Response:
        return report()

    app = web.Application()
    app.add_routes([web.put("/admin/v1/state", put_state), web.get("/admin/v1/state", get_state)])
    return await aiohttp_server(app)


def push(generation: int, **stable: str) -> DesiredState:
    return DesiredState.from_dict({"generation": generation, "adapters": [
        {"name": name, "tenant": "t", "stable": {"version": version, "uri": f"s3://adapters/team/{name}-{version}/"}}
        for name, version in stable.items()]})


async def v1_served(aiohttp_server, tmp_path, monkeypatch):
    """(the engine's reported versions, its URL, a stager that pushed sql@v1, v1's copy)."""
    reported = [("sql", "v1")]
    engine = await stand_in_engine(aiohttp_server, reported)
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=str(engine.make_url(""))))
    FakeStore(stager, monkeypatch)
    await stager.apply(push(1, sql="v1"))
    return reported, str(engine.make_url("")), stager, stager.staged[("sql", "v1")].path


async def test_a_replaced_version_the_engine_still_reports_keeps_its_copy(aiohttp_server, tmp_path, monkeypatch):
    reported, _, stager, v1 = await v1_served(aiohttp_server, tmp_path, monkeypatch)
    stager.cache.budget_bytes = int(1.5 * dir_bytes(v1))  # one copy fits

    reported.append(("sql", "v2"))  # v2 registered; the engine serves v1 until v2 has loaded
    await stager.apply(push(2, sql="v2"))
    assert v1.is_dir() and stager.holds.replaced == {("sql", "v1")}
    report = await stager.apply(push(3, sql="v2", chat="c1"))  # a download, and its trim, meanwhile
    assert v1.is_dir() and report.find("sql", "v1") is not None

    reported.remove(("sql", "v1"))  # v2 has loaded: the engine retired v1
    await stager.apply(push(4, sql="v2", chat="c1", extra="e1"))
    assert not v1.is_dir() and stager.holds.replaced == set()
    assert all(s.path.is_dir() for s in stager.staged.values())


async def test_a_sidecar_restarted_during_a_switch_keeps_holding_the_fallback(aiohttp_server, tmp_path, monkeypatch):
    """The sidecar restarts while the engine still serves v1 as v2's fallback: what it adopts from the engine is
    the last push (v2 only), so v1's copy was held by nothing and the next download's trim could evict it."""
    reported, url, first, v1 = await v1_served(aiohttp_server, tmp_path, monkeypatch)
    reported.append(("sql", "v2"))
    await first.apply(push(2, sql="v2"))
    assert first.holds.replaced == {("sql", "v1")}

    second = Stager(dataclasses.replace(config(tmp_path), engine_url=url))  # restarted
    FakeStore(second, monkeypatch)
    second.cache.budget_bytes = int(1.5 * dir_bytes(v1))  # one copy fits
    assert second.holds.replaced == {("sql", "v1")} and v1.name in second.protected()
    await second.apply(push(3, sql="v2", chat="c1"))  # a download, and its trim
    assert v1.is_dir()
    reported.remove(("sql", "v1"))  # v2 has loaded: the engine retired v1
    await second.apply(push(4, sql="v2", chat="c1", extra="e1"))
    assert second.holds.replaced == set() and not v1.is_dir()


async def test_without_an_engine_nothing_replaced_is_held(tmp_path, monkeypatch):
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    await stager.apply(push(1, sql="v1"))
    v1 = stager.staged[("sql", "v1")].path
    stager.cache.budget_bytes = int(1.5 * dir_bytes(v1))
    await stager.apply(push(2, sql="v2"))
    assert not v1.is_dir() and stager.holds.replaced == set()


async def test_an_engine_away_is_reported_with_the_pool_size_it_last_said(aiohttp_server, tmp_path):
    """The operator places warm copies by each worker's reported pool bytes and slots; an engine that did
    not answer (restarting) was reported with neither, so placement counted its room as unbounded."""
    async def get_state(request: web.Request) -> web.Response:
        return web.json_response({"generation_applied": 0, "adapters": [], "pool_bytes": 1 << 30, "pool_slots": 8})

    app = web.Application()
    app.add_routes([web.get("/admin/v1/state", get_state)])
    engine = await aiohttp_server(app)
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=str(engine.make_url(""))))
    report = await stager.state()
    assert report.error is None and (report.pool_bytes, report.pool_slots) == (1 << 30, 8)
    await engine.close()
    report = await stager.state()
    assert report.error.startswith("engine unreachable") and (report.pool_bytes, report.pool_slots) == (1 << 30, 8)


def test_expired_leases_are_dropped_and_never_protect(monkeypatch, tmp_path):
    """/v1/stage's leases: held for lease_s, then not protected; the expired ones are dropped now and then
    (not at every lease: a push leases each of its versions), so their number stays within twice the live."""
    from lorafleet.worker import stager_holds
    from lorafleet.worker.stager_holds import CacheHolds

    now = [0.0]
    monkeypatch.setattr(stager_holds.time, "monotonic", lambda: now[0])
    holds = CacheHolds(tmp_path, lease_s=10.0)
    for i in range(1000):
        holds.lease(f"old-{i}")
    assert holds.protected({}) == {f"old-{i}" for i in range(1000)}
    now[0] = 20.0
    for i in range(300):
        holds.lease(f"new-{i}")
    assert holds.protected({}) == {f"new-{i}" for i in range(300)}
    assert len(holds._leases) <= 2 * 300


async def test_past_the_cache_limit_a_download_is_its_version_s_error_not_a_full_volume(tmp_path, monkeypatch):
    """Every version of a push stays whatever the budget: a pool whose adapters outgrow the volume filled it (an
    emptyDir past its sizeLimit: the kubelet evicts the pod, and its successor downloads the same set). With
    --stager-cache-limit-bytes, a download that would go past it is refused before its bytes arrive: that
    version's error (507 cache_limit, named), the others served, the cache within the limit."""
    probe = Stager(config(tmp_path / "probe"))
    FakeStore(probe, monkeypatch)
    await probe.apply(push(1, a="v1"))
    entry = dir_bytes(probe.staged[("a", "v1")].path)
    limit = 2 * entry + entry // 2  # room for two copies
    stager = Stager(dataclasses.replace(config(tmp_path), stager_cache_bytes=entry, stager_cache_limit_bytes=limit))
    FakeStore(stager, monkeypatch)
    report = await stager.apply(push(1, a="v1", b="v1", c="v1", d="v1"))
    served = sorted(name for (name, _), s in stager.staged.items() if s.path.is_dir())
    assert len(served) == 2 and stager.cache.used_bytes <= limit, (served, stager.cache.used_bytes)
    for name in {"a", "b", "c", "d"} - set(served):
        error = report.find(name, "v1").error
        assert "do not fit beside" in error and f"limit of {limit} bytes" in error, error
    assert stager.store.down_since is None  # the node's limit, not the object store's outage
    with pytest.raises(ValueError, match="must be at least"):
        dataclasses.replace(config(tmp_path), stager_cache_bytes=limit + 1, stager_cache_limit_bytes=limit)
