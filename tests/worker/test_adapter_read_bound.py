"""Adapters that wait for a GPU slot are read into the CPU tier within its budget (worker/adapter_loading.py,
`_read_room`): a burst of tenants asking for distinct cold adapters while every slot is busy no longer holds all
of their images in host memory; tenants are read in turns, and no adapter is left unread for good."""

from __future__ import annotations

import functools
import time

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig, TenantQuota
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights


def _pool(**config) -> AdapterPool:
    pages = PagePool(PagePoolConfig(num_pages=8000, page_elems=1000))
    return AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(**{"max_rank": 32, "num_load_threads": 2, **config}))


def _image_bytes() -> int:
    pool = _pool(max_slots=1)
    pool.add("probe@1", random_weights(0, 8))
    try:
        return pool.entry("probe@1").image.nbytes
    finally:
        pool.close()


def _waiting_bytes(pool: AdapterPool) -> int:
    """Bytes of the images read for the GPU and not placed."""
    return sum(e.image.nbytes for e in pool._entries.values()
               if e.image is not None and not e.on_gpu and e.key in pool._wanted)


def _settle(pool: AdapterPool, peak: list[int] | None = None) -> None:
    """Poll until no read runs (`peak`: the most waiting bytes seen)."""
    deadline = time.monotonic() + 30
    while True:
        pool.poll()
        if peak is not None:
            peak[0] = max(peak[0], _waiting_bytes(pool))
        if not pool.loads_in_flight() or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _serve_all(pool: AdapterPool, waiting: dict[str, object], tenant_of, peak: list[int] | None = None,
               limit_s: float = 30.0) -> list[str]:
    """Ask again for each waiting request's adapter until all got a slot (each given back at once): the order."""
    served: list[str] = []
    deadline = time.monotonic() + limit_s
    while waiting and time.monotonic() < deadline:
        for key, waiter in list(waiting.items()):
            if (slot := pool.acquire(key, waiter=waiter, tenant=tenant_of(key))) is not None:
                served.append(key)
                del waiting[key]
                pool.release(slot)
        _settle(pool, peak)
    assert not waiting, waiting
    return served


def test_adapters_waiting_for_a_slot_are_read_within_the_cpu_budget_and_all_get_served():
    """Both slots busy, twenty tenants each ask for a cold adapter: all twenty were read and held (1.4 MB
    against a budget of two and a half images). Now two are, and every request is served as slots turn over."""
    size = _image_bytes()
    budget = 2 * size + size // 2
    pool = _pool(max_slots=2, cpu_budget_bytes=budget)
    reads = []

    def read(key, seed):
        reads.append(key)
        return random_weights(seed, 8)

    try:
        for i in range(22):
            pool.add(f"a{i}@1", loader=functools.partial(read, f"a{i}@1", i), tenant=f"t{i}")
        running = [pool.load(key) for key in ("a0@1", "a1@1")]
        assert all(pool.acquire(key, waiter=("run", key)) is not None for key in ("a0@1", "a1@1"))
        waiting = {f"a{i}@1": ("req", i) for i in range(2, 22)}
        for key, waiter in waiting.items():
            assert pool.acquire(key, waiter=waiter, tenant=f"t{key[1:-2]}") is None
        peak = [0]
        _settle(pool, peak)
        assert len(reads) == 2 + 2 and peak[0] <= budget, (reads, peak)
        for slot in running:
            pool.release(slot)
        served = _serve_all(pool, waiting, lambda key: f"t{key[1:-2]}", peak)
        assert len(served) == 20 and peak[0] <= budget, peak
        pool.check()
    finally:
        pool.close()


def test_a_tenant_asking_after_anothers_backlog_is_read_in_its_turn():
    """Room for one read at a time: A asks for eight cold adapters, then B for one. B's read is the next one
    after A's first, not after all eight."""
    started: list[str] = []

    def slow(key: str, seed: int):
        started.append(key)
        time.sleep(0.02)
        return random_weights(seed, 8)

    pool = _pool(max_slots=32, cpu_budget_bytes=_image_bytes())
    try:
        pool.add("seed@1", random_weights(77, 8))  # a read's size is known from the images seen
        keys = [f"a{i}@1" for i in range(1, 9)] + ["b1@1"]
        for i, key in enumerate(keys):
            pool.add(key, loader=functools.partial(slow, key, i), tenant=key[0].upper())
        waiting = {key: ("w", key) for key in keys}
        for key in keys:
            pool.acquire(key, waiter=waiting[key], tenant=key[0].upper())
        _serve_all(pool, waiting, lambda key: key[0].upper())
        assert started.index("b1@1") == 1, started
        pool.check()
    finally:
        pool.close()


def test_images_a_tenants_own_quota_holds_back_keep_nobodys_adapters_unread():
    """A's one-slot quota is busy: A's other adapters can only wait for A's own slot. Their images do not count
    against the budget, so B's cold adapter is read and served at once, slots free."""
    size = _image_bytes()
    pool = _pool(max_slots=8, cpu_budget_bytes=2 * size, tenant_quotas={"A": TenantQuota(max_adapters=1)})
    try:
        for i in range(5):
            pool.add(f"a{i}@1", loader=functools.partial(random_weights, i, 8), tenant="A")
        pool.add("b0@1", loader=functools.partial(random_weights, 99, 8), tenant="B")
        pool.load("a0@1")
        assert pool.acquire("a0@1", waiter="long-A") is not None
        for i in range(1, 5):
            assert pool.acquire(f"a{i}@1", waiter=f"A{i}", tenant="A") is None
        _settle(pool)
        assert _serve_all(pool, {"b0@1": "B"}, lambda key: "B", limit_s=5) == ["b0@1"]
        pool.check()
    finally:
        pool.close()


def test_a_tenants_adapter_behind_one_its_pinned_quota_refuses_is_read_and_refused_too():
    """A's quota (one adapter) is held by its pinned adapter, so A1 is read and refused (it stays wanted, its
    image held). With a budget of nothing, A2 was never read nor refused: its request waited for ever."""
    pool = _pool(max_slots=8, cpu_budget_bytes=0, tenant_quotas={"A": TenantQuota(max_adapters=1)})
    try:
        pool.add("p@1", random_weights(0, 8), tenant="A", pinned=True)
        pool.wait_idle()
        for i, key in enumerate(("a1@1", "a2@1"), 1):
            pool.add(key, loader=functools.partial(random_weights, i, 8), tenant="A")
        for key in ("a1@1", "a2@1"):
            error = None
            deadline = time.monotonic() + 10
            while error is None and time.monotonic() < deadline:
                try:
                    assert pool.acquire(key, waiter=key, tenant="A") is None
                except AdapterLoadError as exc:
                    error = exc
                _settle(pool)
            assert error is not None and "pinned" in str(error), key
        pool.check()
    finally:
        pool.close()


def test_a_burst_of_one_tenant_leaves_another_tenants_adapter_read_next():
    """Every slot busy, A's burst fills the budget; B's adapter waits its turn, read before the rest of A's once
    room comes, and all are served."""
    size = _image_bytes()
    pool = _pool(max_slots=1, cpu_budget_bytes=2 * size)
    reads = []

    def read(key, seed):
        reads.append(key)
        return random_weights(seed, 8)

    try:
        pool.add("busy@1", random_weights(99, 8))
        busy = pool.load("busy@1")
        assert pool.acquire("busy@1") == busy
        burst = [f"a{i}@1" for i in range(6)]
        for seed, key in enumerate(burst + ["b@1"]):
            pool.add(key, loader=functools.partial(read, key, seed), tenant=key[0].upper())
        for key in burst + ["b@1"]:
            assert pool.acquire(key, waiter=key, tenant=key[0].upper()) is None
        peak = [0]
        _settle(pool, peak)
        assert reads == burst[:2] and peak[0] <= 2 * size
        pool.release(busy)
        waiting = {key: key for key in burst + ["b@1"]}
        _serve_all(pool, waiting, lambda key: key[0].upper(), peak)
        assert reads.index("b@1") == 2 and sorted(reads) == sorted(burst + ["b@1"]) and peak[0] <= 2 * size, reads
        pool.check()
    finally:
        pool.close()
