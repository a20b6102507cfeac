"""lorafleet_adapter_wait_seconds: what a request that missed its adapter on the GPU waited for it."""

from __future__ import annotations

import functools
import time

from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights


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


def test_the_wait_starts_when_the_scheduler_asks_not_while_the_request_waits_for_a_seat():
    """A request queued behind full seats is not asked for its adapter: its wait for a seat was observed as
    adapter wait (18 s of 'adapter wait' for an adapter that took milliseconds). It now counts from the
    scheduler's first ask; an adapter on the GPU by then (another request loaded it) observes 0."""
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32))
    pool.add("x@1", loader=functools.partial(random_weights, 1, 8))
    pool.add("y@1", loader=functools.partial(random_weights, 2, 8))
    pool.hold("x@1", "r1", count=True)  # both arrive while every seat is taken: GPU misses
    pool.hold("y@1", "r2", count=True)
    pool.load("x@1")  # another request's load brings x while r1 waits for a seat
    seat_wait_s = 0.6
    time.sleep(seat_wait_s)  # the seats stay taken
    assert _serve_until(pool, {"x@1": "r1", "y@1": "r2"}, lambda key: None) == ["x@1", "y@1"]
    (hist,) = pool.metrics.wait_seconds.collect()
    samples = {(s.name, s.labels.get("le")): s.value for s in hist.samples}
    assert samples[("lorafleet_adapter_wait_seconds_count", None)] == 2
    assert samples[("lorafleet_adapter_wait_seconds_bucket", "0.0005")] >= 1  # r1: x was there when asked for
    assert samples[("lorafleet_adapter_wait_seconds_sum", None)] < seat_wait_s  # r2: y's load alone
    pool.close()

