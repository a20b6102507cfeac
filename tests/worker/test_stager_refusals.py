"""The stager tells the node's disk from the object store: a cache volume that cannot be written is the
node's failure (the store is not marked down, later versions of the push are still fetched), and the
store's refusal of a listing (access denied, the bucket gone) is an answer, never papered over with the
URI's last cached copy as if the store could not be reached. And a copy staged by its listing serves a
push of the same bytes by their digest (the seed's two steps) without a second download."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import threading
import time

import pytest
import urllib3
from minio.error import S3Error

import lorafleet.worker.disk_cache as disk_cache
from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.staged_copy import DIGEST_FILE
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_store import is_outage
from lorafleet.worker.staging_errors import staging_error
from tests.worker.test_stager_bounds import WEIGHTS, FakeStore, config, fake_adapter


async def test_a_cache_volume_that_cannot_be_written_is_the_nodes_failure_not_the_stores(tmp_path, monkeypatch):
    stager = Stager(config(tmp_path))
    store = FakeStore(stager, monkeypatch)
    real, calls = disk_cache._sync_tree, []

    def sync_tree(path):  # the volume was remounted read-only after an error, for the first entry
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path)

    monkeypatch.setattr(disk_cache, "_sync_tree", sync_tree)
    report = await stager.apply(DesiredState(1, [
        AdapterDirective("a", "t", VersionRef("v1", "s3://adapters/team/a/")),
        AdapterDirective("b", "t", VersionRef("v1", "s3://adapters/team/b/"))]))
    errors = {a.name: a.error for a in report.adapters}
    assert "disk cache cannot be written (Read-only file system" in errors["a"]
    assert "object store" not in errors["a"]
    assert errors["b"] is None or "object store" not in errors["b"]
    assert len(store.calls) == 2  # b was still fetched: the store was never marked down
    assert stager.disk_stats()["store"]["reachable"]
    assert stager.metrics.store_up._value.get() == 1


def _refusal(code: str) -> S3Error:
    return S3Error(urllib3.HTTPResponse(status=403 if code in ("AccessDenied", "InvalidObjectState") else 404), code,
                   code, "/adapters", "r", "h")


@pytest.mark.parametrize("code, status", [("AccessDenied", 403), ("NoSuchBucket", 404), ("InvalidObjectState", 403),
                                          ("NoSuchVersion", 404)])
async def test_a_refused_listing_is_answered_not_served_from_the_last_cached_copy(tmp_path, monkeypatch, code,
                                                                                status):
    """Any 403 or 404 the store answers (an archived object, a version gone) is its answer, reported as such
    with the store's code: neither served from the cache nor taken for an outage."""
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    uri = "s3://adapters/team/sql/"
    assert (await stager.stage(uri, None)).path.exists()

    def refused(uri, quick=False, deadline=None):
        raise _refusal(code)

    monkeypatch.setattr(stager.sources, "object_etags", refused)
    with pytest.raises(S3Error):
        await stager.stage(uri, None)  # access revoked, or the bucket deleted, to withdraw the adapter
    store = stager.disk_stats()["store"]
    assert store["reachable"] and store["fallbacks"] == 0
    error = staging_error(_refusal(code), uri)
    assert isinstance(error, APIError) and error.status == status and not is_outage(_refusal(code))
    assert error.code == ("store_refused" if status == 403 else "missing") and code in error.message


def _answer(code: str, status: int) -> S3Error:
    return S3Error(urllib3.HTTPResponse(status=status), code, code, "/adapters", "r", "h")


@pytest.mark.parametrize("failure", ["unreachable", "SlowDown", "XMinioServerNotInitialized", "InvalidAccessKeyId",
                                     "RequestTimeout", "TooManyRequests"])
async def test_a_store_that_cannot_answer_still_falls_back_to_the_last_cached_copy(tmp_path, monkeypatch, failure):
    """Unreachable, busy or restarting (a 5xx with an XML body is an S3Error too), or refusing the stager's own
    key (a rotated secret: every adapter alike, not a withdrawal of this one): the cached copy serves."""
    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    uri = "s3://adapters/team/sql/"
    first = await stager.stage(uri, None)
    status = {"SlowDown": 503, "XMinioServerNotInitialized": 503, "InvalidAccessKeyId": 403, "RequestTimeout": 400,
              "TooManyRequests": 429}.get(failure)

    def down(uri, quick=False, deadline=None):
        if status is None:
            raise urllib3.exceptions.MaxRetryError(None, uri, "connection refused")
        raise _answer(failure, status)

    monkeypatch.setattr(stager.sources, "object_etags", down)
    again = await stager.stage(uri, None)
    assert again.path == first.path and stager.disk_stats()["store"]["fallbacks"] == 1
    if failure == "InvalidAccessKeyId":
        error = staging_error(_answer(failure, 403), uri)
        assert error.code == "stager_credentials" and "LORAFLEET_S3_ACCESS_KEY" in error.message
    elif status is not None:
        assert is_outage(_answer(failure, status))


async def test_one_read_of_a_folder_serves_every_digest_asked_of_it(tmp_path, monkeypatch):
    """Pushes that name one hung folder with another digest each started one more thread each; and each caller
    still gets its own answer: the digest it expects, or a mismatch."""
    from lorafleet.worker.sources import SourceError

    stager, release = _stager_with_a_hung_mount(tmp_path, monkeypatch)
    hung = fake_adapter(tmp_path / "local" / "hung")
    try:
        for digest in ("a" * 64, "b" * 64, None):
            with pytest.raises(TimeoutError, match="a hung mount"):
                await stager.stage(str(hung), digest)
        assert len(stager.local_reads) == 1
    finally:
        release.set()
    folder = fake_adapter(tmp_path / "local" / "fine")
    digest = (await stager.stage(str(folder), None)).sha256
    assert (await stager.stage(str(folder), digest)).sha256 == digest
    with pytest.raises(SourceError, match="sha256 mismatch"):
        await stager.stage(str(folder), "c" * 64)


async def test_a_healthy_local_folder_is_never_queued_behind_hung_ones(tmp_path, monkeypatch):
    stager, release = _stager_with_a_hung_mount(tmp_path, monkeypatch)
    hung = [fake_adapter(tmp_path / "local" / f"hung{i}") for i in range(6)]
    healthy = fake_adapter(tmp_path / "local" / "healthy")
    try:
        for folder in hung:
            with pytest.raises(TimeoutError, match="a hung mount"):
                await stager.stage(str(folder), None)
        staged = await asyncio.wait_for(stager.stage(str(healthy), None), 5)
        assert staged.path == healthy
    finally:
        release.set()


async def test_seeded_adapters_are_downloaded_and_kept_once(tmp_path, monkeypatch):
    """The seed stages each folder by its listing (no digest known yet), then pushes it with the digest it
    found: that push found no copy under the digest and downloaded every start-up adapter again, keeping
    two copies of each (neither evictable while leased)."""

    stager = Stager(config(tmp_path))
    FakeStore(stager, monkeypatch)
    folders = [f"s3://adapters/team/seed/a{i}/" for i in range(3)]
    monkeypatch.setattr(stager.sources, "list_adapters", lambda uri: folders)
    monkeypatch.setattr(stager.sources, "download", lambda uri, dest, **_: fake_adapter(dest, WEIGHTS + uri.encode()))
    report = await stager.seed("s3://adapters/team/seed/")
    assert report.errors == {}
    assert stager.counts["downloads"] == 3 and len(stager.cache.entries()) == 3
    cached = {(stager.cache.get(k) / DIGEST_FILE).read_text().strip() for k in stager.cache.entries()}
    assert {a.stable.sha256 for a in stager.desired.adapters} == cached  # pushed with their digests


async def test_a_hung_local_folder_times_out_alone_and_holds_no_other_stage(tmp_path, monkeypatch):
    """A local adapter folder on a mount that stopped answering: its check had no time limit, so the push
    never ended and the versions after it were never staged; each newer push held one more thread of the
    default pool, until S3 stages and state reports waited on it too."""
    stager, release = _stager_with_a_hung_mount(tmp_path, monkeypatch)
    FakeStore(stager, monkeypatch)
    hung = fake_adapter(tmp_path / "local" / "hung")
    try:
        for generation in (1, 2, 3):
            report = await asyncio.wait_for(stager.apply(DesiredState(generation, [
                AdapterDirective("a", "t", VersionRef("v1", str(hung))),
                AdapterDirective("b", "t", VersionRef(f"v{generation}", f"s3://adapters/team/b{generation}/"))])), 10)
            errors = {a.name: a.error for a in report.adapters if a.version != "unstaged"}
            assert "reading the folder took over 0.5 s (a hung mount?)" in errors["a"] and errors["b"] is None
            assert len(stager.local_reads) == 1  # the pushes wait on the one read, not one thread each
        assert (await asyncio.wait_for(stager.stage("s3://adapters/team/other/", None), 5)).path.exists()
        await asyncio.wait_for(stager.state(), 5)
    finally:
        release.set()


def _stager_with_a_hung_mount(tmp_path, monkeypatch) -> tuple[Stager, threading.Event]:
    """A stager (0.5 s time limit) whose local folders named "hung..." do not answer until the event is set."""
    stager = Stager(dataclasses.replace(config(tmp_path), download_timeout_s=0.5))
    release, real = threading.Event(), stager.sources.local_path

    def local_path(uri, folders):
        if "hung" in uri:
            release.wait(30)
        return real(uri, folders)

    monkeypatch.setattr(stager.sources, "local_path", local_path)
    return stager, release


async def test_a_digest_asked_after_the_folder_changed_is_read_afresh(tmp_path):
    """A push with the new files' digest joined a read that hashed the files before they changed and failed
    with a mismatch ("corrupt or changed upload"), though the folder now matches it."""
    stager = Stager(config(tmp_path))
    folder = fake_adapter(tmp_path / "local" / "slow")
    old_digest = (await stager.stage(str(folder), None)).sha256
    gate, hashed, real = threading.Event(), threading.Event(), stager.local_reads._read

    def read(uri, folders):
        staged = real(uri, folders)  # the files as they were
        hashed.set()
        gate.wait(10)
        return staged

    stager.local_reads._read = read
    first = asyncio.ensure_future(stager.stage(str(folder), old_digest))
    assert await asyncio.to_thread(hashed.wait, 10)
    fake_adapter(folder, WEIGHTS + b"new")  # a new upload into the same folder
    new_digest = stager.sources.verify_local(folder, None, str(folder))
    assert new_digest != old_digest
    second = asyncio.ensure_future(stager.stage(str(folder), new_digest))
    await asyncio.sleep(0.05)
    gate.set()
    assert (await second).sha256 == new_digest
    assert (await first).sha256 == old_digest


async def test_callers_of_a_wrong_digest_read_the_folder_twice_in_all(tmp_path):
    # Each caller that found a shared read's digest wrong read again on a thread of its own: N + 1 reads (and
    # threads, on a mount that then hung) for N callers. A reread joins the others'.
    from lorafleet.worker.sources import SourceError

    stager = Stager(config(tmp_path))
    folder = fake_adapter(tmp_path / "local" / "corrupt")
    reads, real = [], stager.local_reads._read
    stager.local_reads._read = lambda uri, folders: reads.append(uri) or real(uri, folders)
    results = await asyncio.gather(*(stager.stage(str(folder), "0" * 64) for _ in range(8)), return_exceptions=True)
    assert all(isinstance(r, SourceError) and "sha256 mismatch" in str(r) for r in results)
    assert len(reads) == 2


async def test_a_superseded_pushs_late_second_fault_does_not_mark_the_store_down_for_the_next_push(tmp_path):
    """Push 1's first object fault is excused; its next download runs on after push 2 began, and push 2's
    first call is answered; then that download faults too. It is push 1's second fault, made before push 2's
    answered call: the store stays up for push 2, whose versions are tried."""
    stager = Stager(config(tmp_path))
    entered, gate = threading.Event(), threading.Event()

    def download(uri, sha256, key, deadline, etags, push_start):
        if uri.endswith("/b/"):
            entered.set()
            gate.wait(30)
        raise urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead(10 bytes read, 90 more expected)")

    async def answers(uri, start=None):
        return True

    stager._download, stager._answers = download, answers
    push1 = time.monotonic()
    with pytest.raises(urllib3.exceptions.ProtocolError):
        await stager._stage_key("s3://adapters/team/a/", None, "ka", push_start=push1)
    assert not stager.store.is_down  # excused: the store answered a listing
    late = asyncio.ensure_future(stager._stage_key("s3://adapters/team/b/", None, "kb", push_start=push1))
    assert await asyncio.to_thread(entered.wait, 30)
    push2 = time.monotonic()  # a newer push begins; push 1's download goes on by itself
    stager.store.answered(time.monotonic())  # push 2's first call is answered
    gate.set()
    with pytest.raises(urllib3.exceptions.ProtocolError):
        await late
    assert not stager.store.is_down
    stager.store.skip(push2)  # push 2's versions are tried (StoreDown: "not tried")
