"""Adapters that wait for a GPU slot are read into the CPU tier within its budget: a burst of tenants asking
for distinct cold adapters while every slot is busy no longer holds all of their images in host memory."""

from __future__ import annotations

import functools
import time

from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig, TenantQuota
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights

IMAGE_BYTES = 72_000  # one random_weights(rank 8) image of TINY_DIMS


def _settle(pool: AdapterPool) -> None:
    deadline = time.monotonic() + 60
    while pool.loads_in_flight() and time.monotonic() < deadline:
        pool.poll()
        time.sleep(0.005)
    pool.poll()


def _parked_bytes(pool: AdapterPool) -> int:
    return sum(e.image.nbytes for e in pool._entries.values() if e.image is not None and not e.on_gpu)


def test_adapters_waiting_for_a_slot_are_read_within_the_cpu_budget_and_all_get_served():
    budget = 2 * IMAGE_BYTES + IMAGE_BYTES // 2
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32, num_load_threads=2, cpu_budget_bytes=budget))
    for i in range(22):
        pool.add(f"a{i}@1", loader=functools.partial(random_weights, i, 8), tenant=f"t{i}")
    running = [pool.load(key) for key in ("a0@1", "a1@1")]
    assert all(pool.acquire(key, waiter=("run", key)) is not None for key in ("a0@1", "a1@1"))
    waiting = {f"a{i}@1": ("req", i) for i in range(2, 22)}  # twenty tenants, one cold adapter each
    for key, waiter in waiting.items():
        assert pool.acquire(key, waiter=waiter, tenant=f"t{key[1:-2]}") is None
    _settle(pool)
    read = [k for k in waiting if pool._entries[k].image is not None]
    # Before: all twenty were read and kept (1.44 MB against a 180 kB budget).
    assert 1 <= len(read) <= 3 and _parked_bytes(pool) <= budget + IMAGE_BYTES, (read, _parked_bytes(pool))

    served: list[str] = []
    for slot in running:
        pool.release(slot)
    deadline = time.monotonic() + 60
    while waiting and time.monotonic() < deadline:  # each request, asking again, runs once it gets a slot
        for key, waiter in list(waiting.items()):
            if (slot := pool.acquire(key, waiter=waiter)) is not None:
                served.append(key)
                del waiting[key]
                pool.release(slot)
        assert _parked_bytes(pool) <= budget + IMAGE_BYTES
        pool.poll()
        time.sleep(0.002)
    assert not waiting and len(served) == 20


def _serve_until(pool: AdapterPool, waiting: dict[str, object], tenant_of, limit_s: float = 30.0) -> list[str]:
    """Ask again for each waiting request's adapter until all got a slot (each given back at once): the order."""
    served: list[str] = []
    deadline = time.monotonic() + limit_s
    while waiting and time.monotonic() < deadline:
        pool.poll()
        for key, waiter in list(waiting.items()):
            if (slot := pool.acquire(key, waiter=waiter, tenant=tenant_of(key))) is not None:
                served.append(key)
                del waiting[key]
                pool.release(slot)
        time.sleep(0.002)
    assert not waiting, waiting
    return served


def test_images_a_tenants_own_quota_holds_back_do_not_keep_other_tenants_adapters_from_being_read():
    """A's one-slot quota is busy; A asks for four more adapters, which can only wait for A's own slot. Their
    images filled the CPU budget and B's cold adapter was never read, slots free: B's request hung."""
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=8, max_rank=32, num_load_threads=2, cpu_budget_bytes=3 * IMAGE_BYTES,
                                         tenant_quotas={"A": TenantQuota(max_adapters=1)}))
    for i in range(5):
        pool.add(f"a{i}@1", random_weights(i, 8), tenant="A")  # registered with weights: sizes known
        pool.evict(f"a{i}@1", "cpu")
    pool.add("b0@1", loader=functools.partial(random_weights, 99, 8), tenant="B")
    pool.load("a0@1")
    assert pool.acquire("a0@1", waiter="long-A") is not None
    for i in range(1, 5):
        assert pool.acquire(f"a{i}@1", waiter=f"A{i}", tenant="A") is None
    _settle(pool)
    # Those asked for before one landed were read (the budget's room); once one is held back by A's quota, no more
    read = [pool.entry(f"a{i}@1").image is not None for i in range(1, 5)]
    assert read[0] and not read[3], read
    assert _serve_until(pool, {"b0@1": "B"}, lambda key: "B", limit_s=5) == ["b0@1"]
    pool.close()


def test_a_tenant_asking_after_anothers_backlog_is_read_in_its_turn():
    """Room for two reads at a time: A asks for eight cold adapters, then B for one. B's read started after
    all eight of A's; now it is the next one after A's first."""
    started: list[str] = []

    def slow(key: str, seed: int):
        started.append(key)
        time.sleep(0.05)
        return random_weights(seed, 8)

    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=8000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=32, max_rank=32, cpu_budget_bytes=IMAGE_BYTES))
    pool.add("seed@1", random_weights(77, 8))  # as the engine registers: an image's size is known
    keys = [f"a{i}@1" for i in range(1, 9)] + ["b1@1"]
    for i, key in enumerate(keys):
        pool.add(key, loader=functools.partial(slow, key, i), tenant=key[0].upper())
    waiting = {key: ("w", key) for key in keys}
    for key in keys:
        pool.acquire(key, waiter=waiting[key], tenant=key[0].upper())
    _serve_until(pool, waiting, lambda key: key[0].upper())
    assert started.index("b1@1") == 1, started
    pool.close()


def test_a_request_that_missed_its_adapter_observes_its_wait():
    """The load histogram times the read and the copy; a request's wait (the load's queue, GPU room) was
    nowhere. lorafleet_adapter_wait_seconds observes it from the miss to the slot, once per request."""
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32))
    pool.add("x@1", loader=functools.partial(random_weights, 1, 8))
    pool.hold("x@1", "r1", count=True)  # arrives: a GPU miss
    pool.hold("x@1", "r2", count=True)
    assert _serve_until(pool, {"x@1": "r1"}, lambda key: None) == ["x@1"]
    pool.abandon("x@1", "r2")  # went away: no wait to observe
    samples = {s.name: s.value for m in pool.metrics.wait_seconds.collect() for s in m.samples}
    assert samples["lorafleet_adapter_wait_seconds_count"] == 1 and samples["lorafleet_adapter_wait_seconds_sum"] > 0
    pool.close()
