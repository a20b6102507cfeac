"""AdapterPool: a failure told to the requests that waited for it after a later load succeeded, verbs of
other threads racing the KV cache for pages, and what a version replaced mid-load leaves behind."""

from __future__ import annotations

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import failed_load, make_pool


def test_a_waiter_of_a_failed_load_hears_that_failure_after_another_load_succeeded():
    """w1 waited for a load that failed; before its request looks again, a prefetch (a warm push) loads
    the adapter. w1 is told the failure it waited for, an AdapterLoadError, never a bare TypeError."""
    pool = make_pool()
    try:
        broken = failed_load(pool)
        broken["on"] = False
        pool.prefetch("flaky@1")
        pool.wait_idle()
        assert pool.entry("flaky@1").resident
        with pytest.raises(AdapterLoadError, match="object store unreachable"):
            pool.acquire("flaky@1", waiter="w1")
        slot = pool.acquire("flaky@1", waiter="w2")  # later requests are served
        assert slot is not None
        pool.release(slot)
        pool.check()
    finally:
        pool.close()


def test_a_prefetch_racing_a_kv_allocation_for_the_pages_waits_instead_of_raising():
    """A warm push prefetches from the admin thread while the engine thread allocates KV pages: the
    pages the placement counted on are gone when it allocates. The adapter waits for room (as when the
    KV cache held them from the start) instead of the push failing that version."""
    pool = make_pool(num_pages=64)
    try:
        pp = pool.page_pool
        allocate = pp.allocate
        kv: list[int] = []

        def engine_thread_first(num_pages, owner, **kw):
            if owner[0] == "adapter" and not kv:  # the engine thread wins the race for the pages
                kv.extend(allocate(pp.num_free, ("kv", 1)))
            return allocate(num_pages, owner, **kw)

        pp.allocate = engine_thread_first
        pool.add("w@1", random_weights(1))
        pool.prefetch("w@1")  # no PagePoolError
        entry = pool.entry("w@1")
        assert not entry.on_gpu and entry.error is None
        pp.free(kv)
        pool.wait_idle()
        assert pool.entry("w@1").resident
        pool.check()
    finally:
        pool.close()


def test_a_version_retired_while_its_copy_fails_is_forgotten():
    """m@1's copy to the device fails after m@2 replaced it: nothing of m@1 stays behind (no entry, no
    CPU image counted against the CPU tier)."""
    pool = make_pool()
    try:
        pool.add("m@1", random_weights(1))
        copier = pool._copier
        start = copier.start

        def failing_start(pages, page_ids):
            handle = start(pages, page_ids)
            handle.future.result()
            handle.future = pool._executor.submit("t", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
            return handle

        copier.start = failing_start
        assert pool.acquire("m@1", waiter="r") is None  # the copy is under way
        copier.start = start
        pool.add("m@2", random_weights(2))
        pool.make_current("m@2")  # m@1 retires while its copy runs
        pool.wait_idle()
        assert "m@1" not in pool._entries
        assert pool.stats()["bytes"]["cpu"] == pool.entry("m@2").image.nbytes
        pool.check()
    finally:
        pool.close()
