"""Adapters that wait for a GPU slot are read into the CPU tier within its budget: a burst of tenants asking
for distinct cold adapters while every slot is busy no longer holds all of their images in host memory."""

from __future__ import annotations

import functools
import time

from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
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
