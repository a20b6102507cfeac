"""AdapterPool.load() (tools, benches, start-up): it ends whatever happens to the adapter while it waits.
Removed, unregistered or replaced: it says so at once; on the GPU and evicted again before it looked:
it asks again and returns the slot, rather than waiting out its timeout."""

from __future__ import annotations

import threading

import pytest

from lorafleet.worker.adapter_entry import AdapterNotFoundError
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import make_pool


def _load_in_thread(pool, key: str, out: dict) -> threading.Thread:
    """pool.load(key) on a thread, already polling when this returns."""
    polls = threading.Event()
    wait_some = pool._wait_some
    pool._wait_some = lambda seconds: (polls.set(), wait_some(seconds))[1]

    def run():
        try:
            out["r"] = pool.load(key, timeout=60.0)
        except Exception as exc:  # noqa: BLE001 - the test reads which
            out["r"] = exc

    t = threading.Thread(target=run)
    t.start()
    assert polls.wait(10)
    return t


@pytest.mark.parametrize("how", ["remove", "unregister", "replace"])
def test_an_adapter_gone_while_load_waits_ends_it_at_once(how):
    pool = make_pool(max_slots=3)
    gate, out = threading.Event(), {}
    try:
        pool.add("sql@v1", random_weights(0))
        pool.wait_idle()
        pool.add("sql@v2", loader=lambda: (gate.wait(10), random_weights(1))[1], make_current=how != "remove")
        t = _load_in_thread(pool, "sql@v2", out)
        if how == "remove":
            pool.remove("sql@v2")
        elif how == "unregister":
            pool.unregister("sql")
        else:
            pool.add("sql@v3", random_weights(3))  # replaces the pending v2, which retires
        gate.set()
        t.join(30)
        assert isinstance(out.get("r"), AdapterNotFoundError), out
    finally:
        pool.close()


def test_an_adapter_that_landed_and_left_before_load_looked_is_asked_for_again():
    pool = make_pool(max_slots=3)
    out = {}
    try:
        pool.add("a@1", random_weights(0))
        pool.wait_idle()
        pool.evict("a@1", "gpu")
        landed = threading.Event()
        is_done = pool._copier.is_done
        pool._copier.is_done = lambda handle: landed.is_set() and is_done(handle)
        t = _load_in_thread(pool, "a@1", out)
        with pool._lock:  # the engine thread, before load() looks: the copy lands, then KV pressure evicts it
            entry = pool.entry("a@1")
            assert entry.copying is not None
            landed.set()
            pool._copier.wait(entry.copying, 5)
            pool.poll()
            assert entry.resident
            pool.reclaim_for_kv(1)
            assert not entry.on_gpu
        t.join(30)
        assert out.get("r") == entry.slot is not None, out
    finally:
        pool.close()
