"""A cache entry an earlier run left is checked against its recorded digest before it is handed out again: a
broken entry is dropped, one that could not be read this time is kept for the next try."""

from __future__ import annotations

import errno

import pytest

import lorafleet.worker.staged_copy as staged_copy
from lorafleet.worker.disk_cache import DiskCache
from lorafleet.worker.source_error import read_error
from lorafleet.worker.sources import adapter_digest
from lorafleet.worker.staged_copy import DIGEST_FILE, verify_staged_copy


@pytest.fixture
def cache(tmp_path) -> DiskCache:
    """A cache whose one entry, "u-abc", an earlier run wrote: unverified now."""
    def fill(tmp):
        (tmp / "adapter_config.json").write_text('{"r": 4}')
        (tmp / "adapter_model.safetensors").write_bytes(b"weights")
        (tmp / DIGEST_FILE).write_text(adapter_digest(tmp) + "\n")

    DiskCache(tmp_path / "c", 1 << 30).put("u-abc", fill)
    restarted = DiskCache(tmp_path / "c", 1 << 30)
    assert restarted.unverified == {"u-abc"}
    return restarted


def test_an_intact_entry_is_verified(cache):
    assert verify_staged_copy(cache, "u-abc") == cache.root / "u-abc" and not cache.unverified


@pytest.mark.parametrize("raised", ["oserror", "source-error"])
def test_a_read_error_keeps_the_entry_for_the_next_try(raised, cache, monkeypatch):
    """One EIO while hashing it deleted the entry: after a restart during a store outage, the only copy."""
    def eio(path):
        exc = OSError(errno.EIO, "Input/output error")
        raise exc if raised == "oserror" else read_error(path, exc)  # adapter_digest's own, or the disk's

    monkeypatch.setattr(staged_copy, "adapter_digest", eio)
    assert verify_staged_copy(cache, "u-abc") is None
    assert (cache.root / "u-abc").is_dir() and cache.unverified == {"u-abc"}
    monkeypatch.undo()
    assert verify_staged_copy(cache, "u-abc") == cache.root / "u-abc"


@pytest.mark.parametrize("damage", ["weights", "digest-missing", "digest-garbled"])
def test_a_broken_entry_is_dropped(damage, cache):
    entry = cache.root / "u-abc"
    if damage == "weights":
        (entry / "adapter_model.safetensors").write_bytes(b"torn")
    elif damage == "digest-missing":
        (entry / DIGEST_FILE).unlink()
    else:
        (entry / DIGEST_FILE).write_bytes(b"\xff\xfe\x00")
    assert verify_staged_copy(cache, "u-abc") is None
    assert not entry.exists() and "u-abc" not in cache.entries()


def test_a_download_after_a_kept_entry_replaces_it(cache, monkeypatch):
    """The kept entry could not be checked, so the version is downloaded again: the cache kept the old entry
    (a concurrent fill's, it took it for) and threw the fresh, checked download away, every time."""
    monkeypatch.setattr(staged_copy, "adapter_digest", lambda path: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    assert verify_staged_copy(cache, "u-abc") is None
    monkeypatch.undo()

    def fresh(tmp):
        (tmp / "adapter_config.json").write_text('{"r": 8}')
        (tmp / "adapter_model.safetensors").write_bytes(b"fresh weights")
        (tmp / DIGEST_FILE).write_text(adapter_digest(tmp) + "\n")

    path = cache.put("u-abc", fresh)
    assert (path / "adapter_model.safetensors").read_bytes() == b"fresh weights" and not cache.unverified
    assert sorted(p.name for p in cache.root.iterdir()) == ["u-abc"]  # the old copy gone, nothing left over


def test_a_reader_of_the_entry_never_finds_it_missing_while_it_is_replaced(cache):
    """The replacement renamed the old copy away, then the new one in: the engine re-reading the version
    in between found no adapter_config.json, a failure it does not retry. The two are swapped in one step."""
    import threading

    missing: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                (cache.root / "u-abc" / "adapter_config.json").read_bytes()
            except FileNotFoundError as exc:
                missing.append(str(exc))

    def fresh(tmp):
        (tmp / "adapter_config.json").write_text('{"r": 8}')
        (tmp / "adapter_model.safetensors").write_bytes(b"fresh weights")
        (tmp / DIGEST_FILE).write_text(adapter_digest(tmp) + "\n")

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the reader gets its turns between the writer's calls
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(100):
            cache.unverified.add("u-abc")  # as an earlier run's entry that could not be checked
            cache.put("u-abc", fresh)
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert missing == [] and sorted(p.name for p in cache.root.iterdir()) == ["u-abc"]
