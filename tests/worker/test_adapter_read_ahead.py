"""Read ahead (worker/adapter_warmth.py `_read_ahead`): a request's adapter on neither the GPU nor the CPU tier is
read into the CPU tier as the request arrives, while it waits for a seat; within the CPU budget, never pushing an
image out, at most one read ahead per loader thread, never for an adapter already asked for, failing no one."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights
from tests.worker.test_adapter_wait_metric import _serve_until


def _until(pool: AdapterPool, done, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        pool.poll()
        time.sleep(0.002)
    assert done()


def test_a_queued_request_s_adapter_is_read_ahead_into_the_cpu_tier():
    """A request queued behind full seats was not asked for its adapter: its read started only once a seat freed,
    adding to its time to first token. Its arrival starts the read now (no GPU slot taken, nothing evicted); the
    scheduler's ask then finds it read: a CPU hit, and only the copy left."""
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32))
    pool.add("x@1", loader=functools.partial(random_weights, 1, 8))
    pool.hold("x@1", "r1", count=True, tenant="acme")  # arrives; the seats stay taken
    _until(pool, lambda: pool.residency("x@1") == "room")  # read: waiting for GPU room only
    stats = pool.stats()
    assert stats["resident"] == {"gpu": 0, "cpu": 1} and stats["misses"]["cpu"] == 0  # not asked yet
    assert _serve_until(pool, {"x@1": "r1"}, lambda key: "acme") == ["x@1"]
    stats = pool.stats()
    assert (stats["hits"]["cpu"], stats["misses"]["cpu"]) == (1, 0)
    pool.close()


def test_a_read_ahead_takes_only_room_the_cpu_budget_has_and_its_failure_is_told_once_asked():
    """No image leaves the CPU tier for a read ahead: with the budget full, the request's read waits for its ask.
    A read ahead that fails fails no one before the ask, which reads again and tells the request why."""
    nbytes = random_weights(1, 8).nbytes
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32, cpu_budget_bytes=int(1.5 * nbytes)))
    for key, seed in (("x@1", 1), ("y@1", 2)):
        pool.add(key, loader=functools.partial(random_weights, seed, 8))
    pool.prefetch("x@1", "cpu")
    _until(pool, lambda: pool.residency("x@1") == "room")
    pool.hold("y@1", "r1", count=True)
    assert not pool.loads_in_flight() and pool.stats()["resident"]["cpu"] == 1  # not read: x would have to leave
    assert _serve_until(pool, {"y@1": "r1"}, lambda key: None) == ["y@1"]  # its ask reads it
    pool.close()

    calls = []

    def broken():
        calls.append(1)
        raise OSError("disk gone")

    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32))
    pool.add("z@1", loader=broken)
    pool.hold("z@1", "r2", count=True)
    _until(pool, lambda: calls and not pool.loads_in_flight())
    with pytest.raises(AdapterLoadError, match="disk gone"):  # told at its ask, by a read of its own
        _until(pool, lambda: pool.acquire("z@1", waiter="r2") is not None and False, limit_s=5.0)
    assert len(calls) == 2
    pool.hold("z@1", "r3", count=True)  # after a failed load, a request's arrival reads nothing: its ask will
    assert not pool.loads_in_flight() and len(calls) == 2
    pool.close()


def _gated(started: list[str], gate: threading.Event, seed: int, rank: int = 8):
    """random_weights(seed, rank), once `gate` is set; its start noted in `started`."""
    started.append(f"s{seed}")
    assert gate.wait(30)
    return random_weights(seed, rank)


def test_a_burst_of_cold_arrivals_reads_ahead_one_adapter_per_loader_thread():
    """Before any image was read a read's size is unknown (0): 40 cold arrivals started 40 reads for a budget of
    3 images, 38 of them pushed out as they landed, each read again at its ask."""
    started, gate = [], threading.Event()
    nbytes = random_weights(1, 8).nbytes
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32, num_load_threads=2, cpu_budget_bytes=3 * nbytes))
    for i in range(40):
        pool.add(f"a{i}@1", loader=functools.partial(_gated, started, gate, i))
        pool.hold(f"a{i}@1", f"r{i}", count=True, tenant=f"t{i % 4}")
    reads_ahead = sum(1 for i in range(40) if pool.entry(f"a{i}@1").fetching is not None)
    gate.set()
    _until(pool, lambda: not pool.loads_in_flight())
    assert reads_ahead == 2 and len(started) == 2 and pool.stats()["evictions"]["cpu"] == {}
    pool.close()


def test_a_read_ahead_over_the_budget_leaves_not_the_images_there():
    """A larger adapter than any read so far passed the budget's check by the largest image's size, landed over
    the budget and pushed 7 idle images out. It leaves itself instead; the images stay."""
    small = random_weights(1, 4).nbytes
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=8000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32, cpu_budget_bytes=12 * small + small // 2))
    for i in range(10):
        pool.add(f"s{i}@1", loader=functools.partial(random_weights, i, 4))
        pool.prefetch(f"s{i}@1", "cpu")
    pool.wait_idle()
    pool.add("big@1", loader=functools.partial(random_weights, 9, 32))
    pool.hold("big@1", "r1", count=True)
    assert pool.entry("big@1").fetching is not None
    _until(pool, lambda: not pool.loads_in_flight())
    stats = pool.stats()
    assert stats["resident"]["cpu"] == 10 and pool.entry("big@1").image is None
    assert stats["evictions"]["cpu"] == {"budget": 1}  # the read ahead itself
    assert _serve_until(pool, {"big@1": "r1"}, lambda key: None) == ["big@1"]  # its ask reads it, as a request's
    pool.close()


def test_an_adapter_asked_for_is_not_read_ahead_past_its_read_pacing():
    """The scheduler's asks for one tenant's 10 cold adapters start their reads paced (one here); a second request
    for each, arriving, started every held-back read at once, urgent and untrimmable."""
    started, gate = [], threading.Event()
    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=8000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32, num_load_threads=1))
    for i in range(10):
        pool.add(f"a{i}@1", loader=functools.partial(_gated, started, gate, i))
    for i in range(10):
        pool.acquire(f"a{i}@1", waiter=f"r{i}", tenant="t")
    paced = sum(1 for i in range(10) if pool.entry(f"a{i}@1").fetching is not None)
    for i in range(10):
        pool.hold(f"a{i}@1", f"s{i}", count=True, tenant="t")
    assert sum(1 for i in range(10) if pool.entry(f"a{i}@1").fetching is not None) == paced < 10
    assert not any(pool.entry(f"a{i}@1").read_ahead for i in range(10))
    gate.set()
    pool.close()


def test_a_read_ahead_that_timed_out_leaves_no_error_for_a_later_caller():
    """A read ahead nobody asked for ran past the load's time limit: the next anonymous acquire() was refused with
    that stale timeout, for a read it never asked for, after the read had come back. It reads again."""
    gate = threading.Event()

    def slow():
        assert gate.wait(30)
        return random_weights(1, 8)

    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=4000, page_elems=1000)), TINY_DIMS,
                       AdapterPoolConfig(max_slots=2, max_rank=32, load_timeout_s=0.2))
    pool.add("x@1", loader=slow)
    pool.hold("x@1", "r1", count=True)
    assert pool.entry("x@1").fetching is not None
    _until(pool, lambda: pool.entry("x@1").fetching is None)  # past its time limit: given up
    gate.set()
    _until(pool, lambda: pool.entry("x@1").hung is None)  # its thread came back
    assert pool.acquire("x@1") is None  # a read of its own, no stale refusal
    _until(pool, lambda: pool.acquire("x@1") is not None)
    pool.close()
