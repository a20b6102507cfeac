"""The stager over a long life: local sources never block its event loop (a hung network mount leaves
`/healthz` answering), what it keeps per download and per cache key stays bounded, progress is kept per
download, and an unchanged local adapter is not read again on every push. No object store is needed:
the download is replaced where a test needs one."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest

import lorafleet.worker.sources as sources_module
from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.sources import CONFIG_FILE, WEIGHTS_FILE, adapter_digest
from lorafleet.worker.stager import RECENT_DOWNLOADS, Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_digests import LocalDigests
from lorafleet.worker.stager_http import STAGER, create_app
from lorafleet.worker.stager_locks import KeyLocks

TOKEN = "t" * 20
WEIGHTS = b"w" * 4096


def config(tmp_path: Path) -> StagerConfig:
    """One version staged at a time: the tests let each held download go in turn."""
    return StagerConfig(stager_token=TOKEN, stager_cache_dir=str(tmp_path / "cache"), s3_allow=["adapters/team/"],
                        s3_endpoint="127.0.0.1:9", s3_secure=False, local_roots=[str(tmp_path / "local")],
                        stage_concurrency=1)


def fake_adapter(path: Path, weights: bytes = WEIGHTS) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text('{"r": 4}')
    (path / WEIGHTS_FILE).write_bytes(weights)
    return path


def settled(folder: Path) -> Path:
    """`folder` with its adapter's files as if written a minute ago (the digest of a file written a moment
    ago is not kept: it may still be being written)."""
    then = time.time_ns() - 60 * 10**9
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        os.utime(folder / name, ns=(then, then))
    return folder


class FakeStore:
    """Stands in for the object store: every prefix holds the same adapter; a download can be held."""

    def __init__(self, stager: Stager, monkeypatch, *, hold: bool = False) -> None:
        self.hold, self.calls = hold, []  # (cache entry's temp dir name, its release)
        self.started = threading.Semaphore(0)
        monkeypatch.setattr(stager.sources, "download", self.download)
        monkeypatch.setattr(stager.sources, "object_etags", lambda uri, quick=False, deadline=None: [(uri + WEIGHTS_FILE, "etag-" + uri)])

    def download(self, uri: str, dest: Path, *, progress=None, deadline=None, etags=None) -> Path:
        release = threading.Event()
        self.calls.append((dest.name, release))
        if progress is not None:
            progress(len(WEIGHTS) // 2, len(WEIGHTS))
        self.started.release()
        if self.hold:
            assert release.wait(10)
        return fake_adapter(dest)

    def release(self, key_start: str) -> None:
        """Let the held download of the cache key starting with `key_start` finish."""
        next(release for name, release in self.calls if name.startswith(".tmp-" + key_start)).set()


@pytest.mark.parametrize("slow", ["local_path", "hashing"])
async def test_a_hung_local_mount_leaves_the_stager_answering(aiohttp_client, tmp_path, monkeypatch, slow):
    """Resolving, listing and hashing a local folder run off the event loop: while they hang, `/healthz`
    answers; once they return, the stage completes."""
    folder = fake_adapter(tmp_path / "local" / "a")
    sha = adapter_digest(folder)
    client = await aiohttp_client(create_app(config(tmp_path)))
    entered, released, late = threading.Event(), threading.Event(), []

    def hung(real):
        def call(*args, **kwargs):
            entered.set()
            if not released.wait(5):
                late.append(real.__name__)  # nothing else ran meanwhile: it blocked the event loop
            return real(*args, **kwargs)
        return call

    if slow == "local_path":
        sources = client.app[STAGER].sources
        monkeypatch.setattr(sources, "local_path", hung(sources.local_path))
    else:
        monkeypatch.setattr(sources_module, "adapter_digest", hung(sources_module.adapter_digest))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    staging = asyncio.ensure_future(client.post("/v1/stage", json={"uri": str(folder), "sha256": sha},
                                                headers=headers))
    assert await asyncio.to_thread(entered.wait, 10)
    health = await asyncio.wait_for(client.get("/healthz"), 10)
    assert health.status == 200 and late == [] and not staging.done()
    released.set()
    resp = await asyncio.wait_for(staging, 10)
    body = await resp.json()
    assert resp.status == 200 and body["path"] == str(folder.resolve()) and body["sha256"] == sha, body


async def test_download_times_and_key_locks_stay_bounded(tmp_path, monkeypatch):
    """Every download adds a time and takes its cache key's lock: the stager keeps the recent times only
    (the histogram in /metrics counts them all) and no lock of a key nobody is staging."""
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    n = RECENT_DOWNLOADS + 20
    for i in range(n):
        assert not (await stager.stage(f"s3://adapters/team/a{i}/", None)).cached
    assert stager.counts["downloads"] == n and len(stager.download_seconds) == RECENT_DOWNLOADS
    assert len(stager.disk_stats()["download_seconds"]) == RECENT_DOWNLOADS
    assert stager.registry.get_sample_value("lorafleet_stager_download_seconds_count") == n
    assert len(stager._locks) == 0


async def test_uris_no_longer_desired_whose_copy_left_the_cache_are_forgotten(tmp_path, monkeypatch):
    """The store-down fallback remembers each URI's last copy: pushes and the engine's requests that bring
    ever new URIs must not make that map grow for ever; a desired URI is remembered while its copy is cached."""
    copy_bytes = len('{"r": 4}') + len(WEIGHTS) + 65  # + the cache's .sha256 file
    stager = Stager(dataclasses.replace(config(tmp_path), stager_cache_bytes=int(2.5 * copy_bytes),
                                        stage_lease_s=1e-6))  # a lease that ends at once: copies may go
    FakeStore(stager, monkeypatch)
    n = 12
    for generation in range(1, n + 1):
        ref = VersionRef("v1", f"s3://adapters/team/pushed-{generation}/")
        assert (await stager.apply(DesiredState(generation, [AdapterDirective("a", "t", ref)]))).find("a", "v1")
    for i in range(n):
        await stager.stage(f"s3://adapters/team/asked-{i}/", None)
    assert stager.cache.evictions >= 2 * n - 3
    cached = set(stager.cache.entries())
    assert len(stager._by_uri) <= len(cached) + 1 and set(stager._by_uri.values()) <= cached
    assert f"s3://adapters/team/pushed-{n}/" in stager._by_uri  # the desired one: its copy is protected


async def test_one_cache_key_under_two_uris_is_one_entry_each_uri_checked_once(tmp_path, monkeypatch):
    """Two URIs of the same bytes share one entry; each URI's objects are downloaded and hashed once (a digest
    hands out no copy to a URI that never held it), then served from the entry."""
    stager = Stager(config(tmp_path))
    store = FakeStore(stager, monkeypatch)
    sha = adapter_digest(fake_adapter(tmp_path / "template"))
    first, second = await asyncio.gather(stager.stage("s3://adapters/team/x/", sha),
                                         stager.stage("s3://adapters/team/y/", sha))
    assert first.path == second.path and (first.cached, second.cached) == (False, False)
    assert len(store.calls) == 2 and stager.counts["downloads"] == 2 and len(stager._locks) == 0
    assert [p.name for p in stager.cache.root.iterdir()] == [sha]  # the second download's copy was dropped
    again = await asyncio.gather(*(stager.stage(f"s3://adapters/team/{n}/", sha) for n in "xy"))
    assert all(s.cached and s.path == first.path for s in again) and len(store.calls) == 2


async def test_key_locks_serialize_one_key_and_are_dropped_once_unused():
    """A lock is dropped only when nobody holds or waits on it: one that arrives as the holder lets go
    still waits for the waiter before it, and a waiter that gives up leaves nothing behind."""
    locks, inside, most, order = KeyLocks(), [], [0], []
    gates = {name: asyncio.Event() for name in "abcd"}

    async def stage(name: str) -> None:
        async with locks.hold("k"):
            inside.append(name)
            most[0] = max(most[0], len(inside))
            order.append(name)
            await gates[name].wait()
            inside.remove(name)

    a = asyncio.ensure_future(stage("a"))
    b = asyncio.ensure_future(stage("b"))
    gone = asyncio.ensure_future(stage("gone"))
    while order != ["a"] or len(locks) != 1:
        await asyncio.sleep(0)
    gone.cancel()
    gates["a"].set()
    c = asyncio.ensure_future(stage("c"))  # arrives as `a` lets go, before `b` runs
    for gate in ("b", "c"):
        gates[gate].set()
    await asyncio.gather(a, b, c)
    assert gone.cancelled() and order == ["a", "b", "c"] and most == [1] and len(locks) == 0


async def test_progress_is_kept_per_download_not_per_uri(tmp_path, monkeypatch):
    """One URI staged with and without its sha256 is two downloads (two cache keys): each one's progress is
    reported until it ends, whichever ends first."""
    uri = "s3://adapters/team/a/"
    stager = Stager(config(tmp_path))
    store = FakeStore(stager, monkeypatch, hold=True)
    sha = adapter_digest(fake_adapter(tmp_path / "template"))
    by_digest = asyncio.ensure_future(stager.stage(uri, sha))
    by_etags = asyncio.ensure_future(stager.stage(uri, None))
    for _ in range(2):
        assert await asyncio.to_thread(store.started.acquire, True, 10)
    half, size = len(WEIGHTS) // 2, len(WEIGHTS)
    assert stager.disk_stats()["downloading"] == {uri: {"done": 2 * half, "total": 2 * size}}
    store.release(sha)
    assert (await asyncio.wait_for(by_digest, 10)).sha256 == sha
    assert stager.disk_stats()["downloading"] == {uri: {"done": half, "total": size}}  # the other one's
    store.release("u-")
    assert (await asyncio.wait_for(by_etags, 10)).sha256 == sha
    assert stager.disk_stats()["downloading"] == {} and stager.counts["downloads"] == 2


async def test_an_unchanged_local_adapter_is_not_read_again_on_every_push(tmp_path, monkeypatch):
    folder = settled(fake_adapter(tmp_path / "local" / "a"))
    sha = adapter_digest(folder)
    stager = Stager(config(tmp_path))
    hashed = []
    real = sources_module.adapter_digest
    monkeypatch.setattr(sources_module, "adapter_digest",
                        lambda path, *a, **kw: hashed.append(path) or real(path, *a, **kw))

    async def push(generation: int) -> str | None:
        ref = VersionRef("v1", str(folder), sha)
        report = await stager.apply(DesiredState(generation, [AdapterDirective("a", "t", ref)]))
        return report.find("a", "v1").error

    assert await push(1) is None and len(hashed) == 1
    assert await push(2) is None and len(hashed) == 1  # unchanged: not read again
    os.utime(folder / WEIGHTS_FILE)  # touched
    assert await push(3) is None and len(hashed) == 2
    settled(folder)
    assert await push(4) is None and len(hashed) == 3
    assert await push(5) is None and len(hashed) == 3
    # Replaced by an upload that keeps the size and the old modification time (cp -p, rsync -t): hashed again.
    mtime = (folder / WEIGHTS_FILE).stat().st_mtime_ns
    new = fake_adapter(tmp_path / "upload", b"v" * len(WEIGHTS)) / WEIGHTS_FILE
    os.utime(new, ns=(mtime, mtime))
    os.replace(new, folder / WEIGHTS_FILE)
    error = await push(6)
    assert len(hashed) == 4 and error is not None and "sha256 mismatch" in error, error
    assert stager.forwarded["a"].stable.sha256 == sha  # what was served keeps being served


def test_local_digests_wait_for_files_to_settle_and_stay_bounded(tmp_path):
    computed = []
    digests = LocalDigests(max_folders=2)
    folders = [fake_adapter(tmp_path / name) for name in "abc"]

    def digest(folder: Path) -> str:
        return digests.digest(folder, (CONFIG_FILE, WEIGHTS_FILE), lambda: (computed.append(folder) or folder.name, None))

    assert [digest(folders[0]) for _ in range(2)] == ["a", "a"] and len(computed) == 2  # fresh: read each time
    for folder in folders:
        settled(folder)
        digest(folder)
    assert len(computed) == 5 and len(digests) == 2  # `a`, the least recently used, went
    assert [digest(f) for f in folders[1:]] == ["b", "c"] and len(computed) == 5
    digest(folders[0])
    assert len(computed) == 6


async def test_a_push_protects_the_cached_copies_of_all_its_versions_from_the_start(tmp_path, monkeypatch):
    """A push's first download fills the cache past its budget: the copy of one of its later versions, cached but
    not served, was not protected yet (only once the push reached that version) and was evicted by that trim,
    then downloaded again."""
    copy_bytes = len('{"r": 4}') + len(WEIGHTS) + 65 + 40  # + the cache's .sha256 and .source files
    stager = Stager(dataclasses.replace(config(tmp_path), stager_cache_bytes=int(2.5 * copy_bytes),
                                        stage_lease_s=1e-6))  # a lease that ends at once: copies may go
    FakeStore(stager, monkeypatch)
    later, other = "s3://adapters/team/later/", "s3://adapters/team/other/"
    assert not (await stager.stage(later, None)).cached
    assert not (await stager.stage(other, None)).cached  # the cache now holds later (least recent) and other
    desired = DesiredState(1, [AdapterDirective("first", "t", VersionRef("v1", "s3://adapters/team/first/")),
                               AdapterDirective("later", "t", VersionRef("v1", later))])
    await stager.apply(desired)
    assert stager.counts["downloads"] == 3 and stager.errors == {}  # later, other, first: later not again
    assert stager.staged[("later", "v1")].cached


async def test_a_restarted_stager_falls_back_to_the_copy_last_served_not_last_downloaded(tmp_path, monkeypatch):
    """X staged (upload 1), re-uploaded (2, downloaded), then upload 1 put back: its copy is served from the cache.
    A stager restarted then fell back to copy 2 (the newest download) while the store was down."""
    from lorafleet.worker.staged_copy import SOURCE_FILE

    uri = "s3://adapters/team/x/"
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)

    def upload(tag: str) -> None:
        monkeypatch.setattr(stager.sources, "object_etags", lambda uri, quick=False, deadline=None: [(uri + WEIGHTS_FILE, tag)])

    keys = []
    for age, tag in ((30, "etag-1"), (20, "etag-2")):
        upload(tag)
        keys.append((await stager.stage(uri, None)).path.name)
        then = time.time() - age  # the two downloads well apart in time
        os.utime(stager.cache.root / keys[-1] / SOURCE_FILE, (then, then))
    upload("etag-1")
    assert (await stager.stage(uri, None)).path.name == keys[0]  # served from the cache
    assert Stager(config(tmp_path)).last_copy(uri) == keys[0]


async def test_a_restarted_stager_dates_a_shared_digest_copy_by_each_uri_s_own_use(tmp_path, monkeypatch):
    """U staged by digest (copy S1), re-uploaded and staged again (copy L2, U's last), then W, whose objects hold
    S1's bytes, staged from S1. A stager restarted while the store is down fell back to S1 for U (the shared
    copy was dated by W's later use), serving U's older upload."""
    held = {"u": WEIGHTS, "w": WEIGHTS}
    stager = Stager(config(tmp_path))
    monkeypatch.setattr(stager.sources, "download", lambda uri, dest, **kw: fake_adapter(dest, held[uri[-2]]))
    monkeypatch.setattr(stager.sources, "object_etags", lambda uri, quick=False, deadline=None: [
        (uri + WEIGHTS_FILE, "etag-" + held[uri[-2]].decode()[:1] + str(len(held[uri[-2]])))])
    u, w, s1 = "s3://adapters/team/u/", "s3://adapters/team/w/", adapter_digest(fake_adapter(tmp_path / "one"))
    assert (await stager.stage(u, s1)).path.name == s1
    held["u"] = b"v" * 100  # U uploaded again
    last = (await stager.stage(u, None)).path.name
    assert last != s1 and stager.last_copy(u) == last
    assert (await stager.stage(w, s1)).path.name == s1  # W's own objects hashed to S1: served from that copy
    restarted = Stager(config(tmp_path))
    assert restarted.last_copy(u) == last and restarted.last_copy(w) == s1


async def test_a_restarted_stager_falls_back_only_to_digest_copies_its_uri_held(tmp_path, monkeypatch):
    """A copy keyed by its digest, last served for y but downloaded from x only (an earlier version's note): a
    restarted stager's store-outage fallback for x is that copy, and y has none."""
    from lorafleet.worker.staged_copy import ORIGINS_FILE, SOURCE_FILE

    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    sha = adapter_digest(fake_adapter(tmp_path / "template"))
    path = (await stager.stage("s3://adapters/team/x/", sha)).path
    assert Stager(config(tmp_path)).last_copy("s3://adapters/team/x/") == sha
    (path / SOURCE_FILE).write_text("s3://adapters/team/y/\n")  # as served for y, unchecked, before origins
    restarted = Stager(config(tmp_path))
    assert restarted.last_copy("s3://adapters/team/y/") is None
    (path / ORIGINS_FILE).write_text("s3://adapters/team/x/\ns3://adapters/team/y/\n")
    assert Stager(config(tmp_path)).last_copy("s3://adapters/team/y/") == sha


class TwoFolders:
    """A store whose `mine` prefix holds the owner's adapter and every other prefix other files."""

    def __init__(self, stager: Stager, monkeypatch, mine: str) -> None:
        self.mine, self.calls = mine, []
        monkeypatch.setattr(stager.sources, "download", self.download)
        monkeypatch.setattr(stager.sources, "object_etags", lambda uri, quick=False, deadline=None: [(uri + "w", uri)])

    def download(self, uri: str, dest: Path, *, progress=None, deadline=None, etags=None) -> Path:
        self.calls.append(uri)
        return fake_adapter(dest, b"owner" * 100 if uri == self.mine else b"other" * 100)


async def test_a_name_given_to_another_tenant_is_not_handed_the_old_owners_copy(tmp_path):
    """m at v1 is t1's, staged from t1's folder; pushed again for t2 with the same version and sha256 under a URI of
    t2's own that holds other files: t2's URI is downloaded and refused, never forwarded t1's copy for t2."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        stager = Stager(config(tmp_path))
        store = TwoFolders(stager, monkeypatch, mine="s3://adapters/team/t1/m/")
        sha = adapter_digest(fake_adapter(tmp_path / "owner", b"owner" * 100))
        await stager.apply(DesiredState(1, [AdapterDirective("m", "t1", VersionRef("v1", store.mine, sha))]))
        assert stager.forwarded["m"].tenant == "t1"
        theirs = VersionRef("v1", "s3://adapters/team/t2/empty/", sha)
        report = await stager.apply(DesiredState(2, [AdapterDirective("m", "t2", theirs)]))
        assert store.calls == [store.mine, theirs.uri] and "sha256 mismatch" in report.find("m", "v1").error
        assert "m" not in stager.forwarded or stager.forwarded["m"].tenant != "t2"


async def test_a_second_uri_of_the_same_bytes_is_its_own_fallback_after_a_restart(tmp_path, monkeypatch):
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    sha = adapter_digest(fake_adapter(tmp_path / "template"))
    for name in "xy":
        await stager.stage(f"s3://adapters/team/{name}/", sha)
    restarted = Stager(config(tmp_path))
    assert [restarted.last_copy(f"s3://adapters/team/{name}/") for name in "xy"] == [sha, sha]


async def test_the_state_report_comes_while_a_staged_folder_s_mount_hangs(tmp_path, monkeypatch):
    """A local folder staged, then its mount stops answering: the state report still comes (its size is the
    last known), report after report, and no report pins one more thread (the stager's JSON and cache trims
    use the same default executor). Each report waited for the folder's size on a thread of its own."""
    folder = fake_adapter(tmp_path / "local" / "acme" / "a")
    stager = Stager(dataclasses.replace(config(tmp_path), download_timeout_s=2.0))
    await stager.apply(DesiredState(1, [AdapterDirective("a", "acme", VersionRef("v1", str(folder)))]))
    assert ("a", "v1") in stager.staged
    hung, released = threading.Event(), threading.Event()
    real_stat = os.stat

    def stat(path, *args, **kw):
        if hung.is_set() and os.fspath(path).startswith(str(folder)):
            released.wait(60)  # the mount does not answer
        return real_stat(path, *args, **kw)

    stager.folder_sizes.known.clear()  # counted again: as for a folder staged just before the mount hung
    monkeypatch.setattr(os, "stat", stat)
    hung.set()
    try:
        for _ in range(2 * min(32, (os.cpu_count() or 1) + 4)):
            report = await asyncio.wait_for(stager.state(), 10)
            assert [(a.name, a.tier, a.bytes) for a in report.adapters] == [("a", "disk", 0)]
        ran = await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 5)  # the default executor has threads free
        assert ran == "ran"
    finally:
        released.set()
    for _ in range(200):  # the count left hanging ends once the mount answers; the next report starts none
        report = await asyncio.wait_for(stager.state(), 10)
        if report.adapters[0].bytes:
            break
        await asyncio.sleep(0.05)
    assert [a.bytes for a in report.adapters] == [len(WEIGHTS) + len('{"r": 4}')]


def test_a_relative_cache_dir_hands_out_absolute_paths(tmp_path, monkeypatch):
    """The engine is handed the cache's paths, and a push's local URI must be absolute: a relative
    --stager-cache-dir is taken from the stager's working directory at start, not kept relative."""
    monkeypatch.chdir(tmp_path)
    stager = Stager(dataclasses.replace(config(tmp_path), stager_cache_dir="cache"))
    assert stager.config.stager_cache_dir == str(tmp_path / "cache") and stager.cache.root == tmp_path / "cache"


def test_a_torn_last_line_of_an_entry_s_notes_names_no_uri(tmp_path):
    """A note appended on a disk that filled up midway ends without its newline: "s3://b/t/ab/" cut to
    "s3://b/t/a" would have made the entry a copy of another URI's objects (and its last copy)."""
    from lorafleet.worker.staged_copy import ORIGINS_FILE, has_origin

    entry = fake_adapter(tmp_path / "entry")
    (entry / ORIGINS_FILE).write_text("s3://adapters/team/x/\ns3://adapters/team/a")
    assert has_origin(entry, "s3://adapters/team/x/") and not has_origin(entry, "s3://adapters/team/a")
