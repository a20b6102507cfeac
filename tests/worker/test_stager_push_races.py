"""A push against what runs beside it (worker/stager_push.py): a newer push does not wait behind a download
that only the push it took over from wanted (that download still completes, shielded), and a cached copy
forwarded at once is protected from a download thread's trim before it is looked up. Against an engine
admin API stand-in and a stand-in object store."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import lorafleet.worker.stager_push as stager_push
from lorafleet.worker.sources import adapter_digest
from lorafleet.worker.staged_copy import DIGEST_FILE, ORIGINS_FILE
from lorafleet.worker.stager import Stager
from tests.worker.engine_admin_stub import HANG_S, split, until
from tests.worker.test_stager_bounds import FakeStore, config, fake_adapter
from tests.worker.test_stager_engine import Engine, adapter, push, release_all


class HeldStore(FakeStore):
    """FakeStore whose held downloads wait for the test to let them go (the hang detector's time, twice)."""

    def download(self, uri: str, dest: Path, *, progress=None, deadline=None, etags=None) -> Path:
        release = threading.Event()
        self.calls.append((dest.name, release, uri))
        if progress is not None:
            progress(1, 2)
        self.started.release()
        if self.hold:
            assert release.wait(2 * HANG_S)
        return fake_adapter(dest)


async def a_v1_served_then_held(aiohttp_server, tmp_path, monkeypatch) -> tuple[Engine, Stager, HeldStore]:
    """A stager and its engine stand-in, push 1 (a at v1) applied; the store holds the downloads after it."""
    engine = Engine()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server)))
    store = HeldStore(stager, monkeypatch)
    await asyncio.wait_for(stager.apply(push(1, adapter("a", "v1"))), HANG_S)
    assert store.started.acquire(blocking=False)  # a's download at v1
    store.hold = True
    return engine, stager, store


async def test_a_superseded_push_stops_waiting_for_a_download_the_newer_one_does_not_want(aiohttp_server, tmp_path,
                                                                                         monkeypatch):
    """Push 2 downloads a's v2 (a big version on a slow link); push 3 rolls a back to v1 and adds b: b's download
    starts, and push 3 reaches the engine, while v2's is still going on; push 2 ends at once. v2's download
    completes all the same, into the cache."""
    engine, stager, store = await a_v1_served_then_held(aiohttp_server, tmp_path, monkeypatch)
    older = asyncio.ensure_future(stager.apply(push(2, adapter("a", "v2"))))
    try:
        assert await asyncio.to_thread(store.started.acquire, True, HANG_S)  # v2's download, held
        newer = asyncio.ensure_future(stager.apply(push(3, adapter("a", "v1"), adapter("b", "v1"))))
        assert await asyncio.to_thread(store.started.acquire, True, HANG_S), "b waits behind a's v2"
        assert (await asyncio.wait_for(older, HANG_S)).generation_applied == 3
        store.calls[-1][1].set()  # b's download ends; v2's is held still
        await asyncio.wait_for(newer, HANG_S)
        assert split(engine.pushes[-1], "a") == ("v1", None, 0) and split(engine.pushes[-1], "b") == ("v1", None, 0)
        assert not stager.pending and stager.disk_stats()["downloading"], "v2's download goes on"
    finally:
        release_all(store)
    assert all(a["stable"]["version"] != "v2" for p in engine.pushes for a in p["adapters"])
    await until(lambda: stager.counts["downloads"] >= 3)  # v2's, shielded, ends in its thread
    assert stager.last_copy("s3://adapters/team/a-v2/") in stager.cache.entries()


def b_copy_in_cache(stager: Stager, tmp_path: Path, origin: str) -> str:
    """Put a copy of b's bytes in the stager's cache, as downloaded from `origin` by an earlier stage; its digest."""
    source = fake_adapter(tmp_path / "src" / "b-v1", weights=b"b" * 4096)
    sha = adapter_digest(source)

    def fill(tmp: Path) -> None:
        for f in source.iterdir():
            (tmp / f.name).write_bytes(f.read_bytes())
        (tmp / DIGEST_FILE).write_text(sha + "\n")
        (tmp / ORIGINS_FILE).write_text(origin + "\n")

    stager.cache.put(sha, fill, protect=stager.protected)
    return sha


async def test_a_push_naming_another_uris_digest_is_not_handed_its_cached_copy(aiohttp_server, tmp_path,
                                                                              monkeypatch):
    """The cache holds b's bytes, downloaded from b's URI. A push names their sha256 for m's version under a URI of
    m's own, which holds other files: the copy is not forwarded at the push's first step; m's URI is downloaded,
    refused by its digest, and never reaches the engine."""
    engine = Engine()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server)))
    store = FakeStore(stager, monkeypatch)  # every URI holds fake_adapter's files, not b's
    m = adapter("m", "v1")
    m["stable"]["sha256"] = b_copy_in_cache(stager, tmp_path, adapter("b", "v1")["stable"]["uri"])
    await asyncio.wait_for(stager.apply(push(1, m)), HANG_S)
    assert len(store.calls) == 1 and "sha256 mismatch" in stager.errors[("m", "v1")]
    assert not any(a["name"] == "m" for p in engine.pushes for a in p["adapters"])


async def test_a_cached_copy_forwarded_at_once_is_protected_before_it_is_looked_up(aiohttp_server, tmp_path,
                                                                                  monkeypatch):
    """b's version names a sha256 the cache holds (left by an earlier stage, its lease over) in a cache over its
    budget: a download thread's trim that runs between the lookup and the copy joining the served ones (here,
    just before the push's first step is built) must not evict the path the engine is sent."""
    engine = Engine()
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=await engine.serve(aiohttp_server),
                                        stager_cache_bytes=1))
    FakeStore(stager, monkeypatch)
    await asyncio.wait_for(stager.apply(push(1, adapter("a", "v1"))), HANG_S)  # forwarded: the first step runs
    b = adapter("b", "v1")
    sha = b_copy_in_cache(stager, tmp_path, b["stable"]["uri"])
    forwardable = stager_push.forwardable

    def after_a_concurrent_trim(*args, **kwargs):
        stager.cache.trim(stager.protected)  # a download thread's put, at this moment
        return forwardable(*args, **kwargs)

    monkeypatch.setattr(stager_push, "forwardable", after_a_concurrent_trim)
    b["stable"]["sha256"] = sha
    before = len(engine.pushes)
    await asyncio.wait_for(stager.apply(push(2, adapter("a", "v1"), b)), HANG_S)
    first = next(p for p in engine.pushes if any(a["name"] == "b" for a in p["adapters"]))
    path = Path(next(a for a in first["adapters"] if a["name"] == "b")["stable"]["uri"])
    assert first is engine.pushes[before] and path.name == sha and path.is_dir()  # push 2's first step
    assert adapter_digest(path) == sha


async def test_a_version_staged_early_reaches_the_engine_while_a_later_download_goes_on(aiohttp_server, tmp_path,
                                                                                        monkeypatch):
    """Push 2 adds b, then c, whose download is slow (a big adapter on a slow link): b reaches the engine
    while c's download goes on (within FORWARD_EVERY_S of its staging), not once the whole push is staged;
    c follows once it is in."""
    monkeypatch.setattr(stager_push, "FORWARD_EVERY_S", 0.05, raising=False)
    engine, stager, store = await a_v1_served_then_held(aiohttp_server, tmp_path, monkeypatch)
    staging = asyncio.ensure_future(stager.apply(push(2, adapter("a", "v1"), adapter("b", "v1"), adapter("c", "v1"))))
    try:
        assert await asyncio.to_thread(store.started.acquire, True, HANG_S)  # b's download
        store.calls[-1][1].set()
        assert await asyncio.to_thread(store.started.acquire, True, HANG_S)  # c's, held
        await until(lambda: any(a["name"] == "b" for p in engine.pushes for a in p["adapters"]))
        assert [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a", "b"] and not staging.done()
    finally:
        release_all(store)
    await asyncio.wait_for(staging, HANG_S)
    assert [a["name"] for a in engine.pushes[-1]["adapters"]] == ["a", "b", "c"]
