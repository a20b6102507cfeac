"""DiskCache durability: an entry is renamed into place only once its files are on disk, so a power
loss never leaves a complete-looking entry with lost data (the check of an earlier run's entries hashes
only the adapter's two files, not the tokenizer files staged beside them)."""

from __future__ import annotations

import os

from lorafleet.worker.disk_cache import DiskCache


def test_every_file_and_the_entry_are_synced_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, int]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def rename(src, dst) -> None:
        events.append(("rename", os.stat(src).st_ino))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)

    def fill(d):
        (d / "adapter_model.safetensors").write_bytes(b"w" * 100)
        (d / "tokenizer.json").write_text("{}")
        (d / "nested").mkdir()
        (d / "nested" / "merges.txt").write_text("#version: 0.2\n")

    cache = DiskCache(tmp_path / "c", budget_bytes=1 << 20)
    entry = cache.put("k", fill)
    renamed = events.index(("rename", entry.stat().st_ino))
    synced_first = {ino for what, ino in events[:renamed] if what == "fsync"}
    for path in (entry, *entry.rglob("*")):  # every file and directory of the entry, before the rename
        assert path.stat().st_ino in synced_first, path
    assert ("fsync", cache.root.stat().st_ino) in events[renamed:]  # then the rename itself


def test_a_full_disk_gives_up_the_copies_no_one_holds_before_refusing_a_wanted_one(tmp_path):
    """A disk smaller than the cache's budget (or shared with others) fills up: every new version then failed
    with disk full, for good, while copies no push held any more filled the disk. The entries not protected
    go, all of them, and the fill is tried once more. The protected set is read under the cache's lock, as
    the trim reads it (else an entry its owner protects and then looks up could go between the two)."""
    import errno

    import pytest

    from lorafleet.worker.disk_cache import CacheDiskError, cache_write

    capacity = 300  # what the "disk" holds, whatever the budget says
    cache = DiskCache(tmp_path / "c", budget_bytes=10_000)

    def filler(size: int):
        def fill(d):
            if cache.used_bytes + size > capacity:
                cache_write(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
            (d / "adapter_model.safetensors").write_bytes(b"w" * size)
        return fill

    for key in ("old", "held", "older"):
        cache.put(key, filler(100))
    read_locked = []

    def held():
        read_locked.append(cache._lock.locked())
        return {"held"}

    cache.get("old")
    cache.put("new", filler(150), protect=held)
    assert read_locked and all(read_locked), read_locked
    assert sorted(cache.entries()) == ["held", "new"] and cache.evictions == 2
    assert sorted(p.name for p in cache.root.iterdir()) == ["held", "new"]  # nothing half-written left
    with pytest.raises(CacheDiskError) as err:  # nothing left to give up: the disk-full error stands
        cache.put("newer", filler(100), protect={"held", "new"})
    assert err.value.errno == errno.ENOSPC and sorted(cache.entries()) == ["held", "new"]


def test_fills_in_flight_count_against_the_budget(tmp_path):
    """A fill that reserves the bytes it will write makes room first: the least recently used entries not
    protected go before its bytes arrive, so two fills at once stay within the budget. The reservation ends
    with the fill, whether it lands (its real size counts instead) or fails."""
    import threading

    import pytest

    cache = DiskCache(tmp_path / "c", budget_bytes=300)

    def filler(size: int):
        return lambda d: (d / "adapter_model.safetensors").write_bytes(b"w" * size)

    for key in ("a", "b", "c"):
        cache.put(key, filler(100))
    cache.get("a")  # b is now the least recently used
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def slow_fill(d):
        cache.reserve(d, 150, protect={"c"})
        seen["entries"], seen["reserved"] = sorted(cache.entries()), cache.reserved_bytes
        inside.set()
        release.wait(10)
        (d / "adapter_model.safetensors").write_bytes(b"w" * 150)

    worker = threading.Thread(target=cache.put, args=("big", slow_fill))
    worker.start()
    assert inside.wait(10)
    # b (least recent) and a went for the 150 bytes in flight; c is protected: 100 + 150 <= 300
    assert seen == {"entries": ["c"], "reserved": 150}
    assert cache.used_bytes + cache.reserved_bytes <= cache.budget_bytes
    release.set()
    worker.join(10)
    assert cache.reserved_bytes == 0 and sorted(cache.entries()) == ["big", "c"] and cache.used_bytes == 250

    def failing(d):
        cache.reserve(d, 1000)
        raise RuntimeError("the store went away")

    with pytest.raises(RuntimeError):
        cache.put("gone", failing)
    assert cache.reserved_bytes == 0 and "gone" not in cache.entries()


def test_a_folder_the_cache_does_not_count_is_replaced_by_a_fill_not_handed_out(tmp_path):
    """A folder left under an entry's name that the cache does not count (its eviction's removal failed midway)
    is no entry: a fill of that key replaces it and counts its bytes, instead of handing out the leftover."""
    cache = DiskCache(tmp_path, budget_bytes=1 << 20)
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "half").write_bytes(b"x" * 10)  # what a failed rmtree left

    def fill(d):
        (d / "weights").write_bytes(b"w" * 100)

    path = cache.put("k", fill)
    assert sorted(p.name for p in path.iterdir()) == ["weights"] and cache.size_of("k") == 100
    assert cache.get("k") == path and not [p for p in tmp_path.iterdir() if p.name != "k"]


def test_a_link_in_the_cache_folder_is_dropped_not_followed(tmp_path):
    """A symlink planted in the cache folder (to /etc, to /) was counted as an entry at start, its target's
    whole tree walked for its size, and the entry offered to the stager's checks. The link alone is removed."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "data").write_bytes(b"d" * 1000)
    root = tmp_path / "cache"
    root.mkdir()
    (root / "evil").symlink_to(outside)
    (root / ".tmp-x").symlink_to(outside / "sub")  # as a download's leftover is named
    cache = DiskCache(root, budget_bytes=1 << 20)
    assert cache.get("evil") is None and cache.size_of("evil") == 0 and not cache.unverified
    assert list(root.iterdir()) == [] and (outside / "sub" / "data").read_bytes() == b"d" * 1000
