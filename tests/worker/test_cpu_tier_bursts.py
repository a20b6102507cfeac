"""A burst of requests for distinct cold adapters while every GPU slot is busy: the images read for them wait in
the CPU tier, where the budget's trim cannot drop them, so their reads start only while the budget has room
(adapter_loading.py `_start_wanted_reads`); every request is still served, and no tenant's burst holds back
another tenant's first cold load."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights


@pytest.fixture
def busy_pool():
    """A pool of 2 slots, both held by requests that keep running; (pool, one image's bytes)."""
    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=1000))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=2, max_rank=32, num_load_threads=2))
    try:
        for i in range(2):
            pool.add(f"h{i}@1", loader=lambda i=i: random_weights(i))
            pool.load(f"h{i}@1")
            assert pool.acquire(f"h{i}@1", f"holder{i}") is not None
        yield pool, pool.entry("h0@1").image.nbytes
    finally:
        pool.close()


def ask(pool: AdapterPool, key: str, tenant: str, loader=None, seed: int = 0) -> None:
    """Register `key` for `tenant` and have a request (waiter `key`) ask for it: a miss, its load wanted."""
    pool.add(key, loader=loader or (lambda: random_weights(seed)), tenant=tenant)
    assert pool.acquire(key, key, tenant=tenant) is None


def started(pool: AdapterPool, key: str) -> bool:
    entry = pool.entry(key)
    return entry.image is not None or entry.fetching is not None or entry.on_gpu


def serve_all(pool: AdapterPool, keys: dict[str, str], bound: int, size: int) -> list[str]:
    """Run the requests for `keys` (key -> tenant) as the scheduler does, each taking its adapter and giving it
    back once served, after the two holders leave; the order they were served in. The CPU tier's images stay
    within `bound` bytes throughout, and its host memory within one image more (the pages of an image just
    dropped come back at the arena's next call)."""
    for i in range(2):
        pool.release(pool.entry(f"h{i}@1").slot)
    served: list[str] = []
    for _ in range(2000):
        pool.poll()
        stats = pool.stats()
        assert stats["bytes"]["cpu"] <= bound and stats["host_bytes"]["used"] <= bound + size
        for key, tenant in keys.items():
            if key not in served and (slot := pool.acquire(key, key, count=False, tenant=tenant)) is not None:
                served.append(key)
                pool.release(slot)
        if len(served) == len(keys):
            return served
        pool._wait_some(0.005)
    raise AssertionError(f"served {served} of {list(keys)}")


def test_a_burst_reads_only_what_the_cpu_budget_holds_and_serves_every_request(busy_pool):
    pool, size = busy_pool
    pool.configure(cpu_budget_bytes=3 * size)
    keys = {f"c{i}@1": f"t{i % 3}" for i in range(12)}
    for i, (key, tenant) in enumerate(keys.items()):
        ask(pool, key, tenant, seed=100 + i)
    pool.wait_idle()
    stats = pool.stats()
    # Before: every one of the 12 images was read and held, 4 times the budget.
    assert stats["bytes"]["cpu"] == 3 * size and stats["host_bytes"]["used"] == 3 * size
    assert stats["waiting"] == 12 and stats["reads_waiting"] == 9
    assert [k for k in keys if started(pool, k)] == ["c0@1", "c1@1", "c2@1"]  # the tenants in turns
    registry = CollectorRegistry()
    for c in pool.metrics.collectors():
        registry.register(c)
    assert "lorafleet_adapter_reads_waiting 9.0" in generate_latest(registry).decode()
    served = serve_all(pool, keys, bound=3 * size, size=size)  # a third of the budget each, then more as tenants leave
    assert sorted(served) == sorted(keys)
    assert pool.stats()["reads_waiting"] == 0
    pool.check()


def test_a_tenants_burst_holds_no_room_of_another_tenants_share(busy_pool):
    """Each tenant waiting keeps to its share of the budget: acme's burst (its images waiting, its reads hung
    on a dead mount) takes none of globex's, whose first cold load starts at once."""
    pool, size = busy_pool
    pool.configure(cpu_budget_bytes=4 * size)
    reads: list[str] = []
    hung = threading.Event()

    def read(key: str, seed: int):
        reads.append(key)
        if key.startswith("stuck"):
            hung.wait(30)
        return random_weights(seed)

    def ask_read(key: str, tenant: str, seed: int) -> None:
        ask(pool, key, tenant, loader=lambda: read(key, seed))

    try:
        for i in range(8):
            ask_read(f"burst{i}@1", "acme", 200 + i)
        pool.wait_idle()
        assert sorted(reads) == [f"burst{i}@1" for i in range(4)]  # alone, acme has the whole budget
        ask_read("own@1", "globex", 300)  # the budget is full of acme's images: globex's read starts all the same
        ask_read("second@1", "globex", 301)  # and its second, within its half
        ask_read("third@1", "globex", 302)  # not its third: it waits for globex's own images to leave
        for i in range(3):
            ask_read(f"stuck{i}@1", "initech", 400 + i)
        for key in ("own@1", "second@1", "stuck0@1"):
            assert started(pool, key), key
        assert not any(started(pool, k) for k in ("third@1", "stuck1@1", "stuck2@1", "burst4@1"))
        stats = pool.stats()
        assert stats["reads_waiting"] == 4 + 1 + 2
        serve = {f"burst{i}@1": "acme" for i in range(8)} | {k: "globex" for k in ("own@1", "second@1", "third@1")}
        # Served while initech's read hangs: acme's four, read while it was alone, and globex's half at most.
        serve_all(pool, serve, bound=6 * size, size=size)
        # Alone now, initech has the whole budget; its adapters never read before: one more read than its hung one
        # (the loader threads), until that one is taken for stuck (read_room.STUCK_READ_S) or lands.
        assert started(pool, "stuck1@1") and not started(pool, "stuck2@1")
    finally:
        hung.set()
    pool.wait_idle()


def test_reads_of_unknown_size_start_no_more_than_the_loader_threads(busy_pool):
    """Before any image was read (no size to expect), reads for the GPU start no more at once than the loader
    threads, not all queued at once; the images that land then bound the others."""
    pool, size = busy_pool
    pool._largest_image = 0  # as at start-up: no image read yet
    for i in range(2):
        pool.entry(f"h{i}@1").image_bytes = 0
    pool.configure(cpu_budget_bytes=2 * size)
    go = threading.Event()

    def blocked(seed):
        go.wait(30)
        return random_weights(seed)

    for i in range(6):
        ask(pool, f"u{i}@1", "acme", loader=lambda i=i: blocked(400 + i))
    assert [i for i in range(6) if started(pool, f"u{i}@1")] == [0, 1]  # num_load_threads
    go.set()
    pool.wait_idle()
    assert pool.stats()["bytes"]["cpu"] == 2 * size
    assert sum(started(pool, f"u{i}@1") for i in range(6)) == 2


def test_warm_ups_are_read_as_before_and_take_no_room_from_a_requests_read(busy_pool):
    """Warm-ups (a directive's, pinned versions, a new version loading beside the current one) are not paced: no
    request waits for them, and the operator's directives bound them. Their images count in no tenant's share."""
    pool, size = busy_pool
    pool.configure(cpu_budget_bytes=size)
    reads: list[str] = []

    def read(key: str, seed: int):
        reads.append(key)
        return random_weights(seed)

    for i in range(3):
        pool.add(f"warm{i}@1", loader=lambda i=i: read(f"warm{i}@1", 500 + i), tenant="acme")
        pool.prefetch(f"warm{i}@1", "gpu")
    pool.wait_idle()
    assert sorted(reads) == ["warm0@1", "warm1@1", "warm2@1"]
    ask(pool, "asked@1", "acme", loader=lambda: read("asked@1", 510))
    ask(pool, "next@1", "acme", loader=lambda: read("next@1", 511))
    pool.wait_idle()
    assert reads[3:] == ["asked@1"]  # acme's first read waited for; its second waits for room in its share
    pool.release(pool.entry("h0@1").slot)
    pool.evict("h0@1")  # a slot: the request's adapter goes first, then the other is read
    pool.wait_idle()
    assert pool.entry("asked@1").on_gpu and reads[4:] == ["next@1"]


def test_a_large_adapter_is_not_passed_for_ever_by_the_same_tenants_smaller_ones(busy_pool):
    pool, size = busy_pool
    reads: list[str] = []

    def read(key: str, seed: int, rank: int = 8):
        reads.append(key)
        return random_weights(seed, rank=rank)

    pool.add("big@1", loader=lambda: read("big@1", 600, rank=32), tenant="acme")
    pool.prefetch("big@1", "cpu")
    pool.wait_idle()
    big = pool.entry("big@1").image_bytes
    assert big > 3 * size
    pool.evict("big@1", "cpu")  # its size is known: more than the whole budget
    pool.configure(cpu_budget_bytes=3 * size)
    keys = ["s0@1", "s1@1", "s2@1", "big@1", "s3@1", "s4@1"]
    for i, key in enumerate(keys):
        if key != "big@1":
            pool.add(key, loader=lambda key=key, i=i: read(key, 610 + i), tenant="acme")
        assert pool.acquire(key, key, tenant="acme") is None
    pool.wait_idle()
    assert reads[0] == "big@1" and "big@1" not in reads[1:] and not {"s3@1", "s4@1"} & set(reads)
    serve_all(pool, dict.fromkeys(keys, "acme"), bound=big + size, size=size)
    # The large one was read again once the tenant's images left room for it (none waiting), before the smaller
    # ones asked after it.
    again = reads.index("big@1", 1)
    assert sorted(reads[1:again]) == ["s0@1", "s1@1", "s2@1"] and reads[again + 1:] == ["s3@1", "s4@1"]


def quota_pool(**config) -> tuple[AdapterPool, int]:
    """4 slots, acme at most one adapter on the GPU; acme's a@1 on it, held by a long request."""
    from lorafleet.worker.adapter_pool import TenantQuota

    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=1000))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=4, max_rank=32, num_load_threads=2,
                                                           tenant_quotas={"acme": TenantQuota(max_adapters=1)}, **config))
    pool.add("a@1", loader=lambda: random_weights(9), tenant="acme")
    pool.load("a@1")
    assert pool.acquire("a@1", "long-request", tenant="acme") is not None
    return pool, pool.entry("a@1").image.nbytes


def test_an_image_its_owners_quota_holds_back_takes_no_room_from_the_tenants_other_reads():
    pool, size = quota_pool()
    try:
        pool.configure(cpu_budget_bytes=size)
        ask(pool, "own@1", "acme", seed=12)  # acme's: waits for acme's quota, which the long request holds
        pool.wait_idle()
        assert pool.residency("own@1") == "quota"
        pool.add("lent@1", loader=lambda: random_weights(13), tenant="default")  # lent to acme: not under its quota
        assert pool.acquire("lent@1", "lent@1", tenant="acme") is None
        pool.wait_idle()
        assert pool.entry("lent@1").on_gpu  # read and placed while own@1 waits, a slot being free
    finally:
        pool.close()


def test_a_read_hung_past_the_stuck_mark_holds_no_room_of_its_tenant(busy_pool, monkeypatch):
    from lorafleet.worker import adapter_loading

    pool, size = busy_pool
    monkeypatch.setattr(adapter_loading, "STUCK_READ_S", 0.3)
    pool.configure(cpu_budget_bytes=size)
    hung = threading.Event()
    try:
        ask(pool, "stuck@1", "acme", loader=lambda: (hung.wait(30), random_weights(3))[1])
        ask(pool, "ok@1", "acme", seed=4)  # acme's share (the budget, one image) is taken by the hung read
        assert not started(pool, "ok@1")
        began = time.monotonic()
        while not started(pool, "ok@1") and time.monotonic() - began < 10:
            pool.keep_warm()  # what the engine calls each step while requests run (no poll)
            time.sleep(0.02)
        assert started(pool, "ok@1") and time.monotonic() - began < 5  # not the load timeout (300 s)
    finally:
        hung.set()
    pool.wait_idle()


def test_a_read_queued_again_behind_stuck_threads_stays_in_its_tenants_group():
    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=1000))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=2, max_rank=32, num_load_threads=1, spare_load_threads=0,
                                                           load_timeout_s=0.3))
    hung = threading.Event()
    try:
        ask(pool, "stuck@1", "initech", loader=lambda: (hung.wait(30), random_weights(3))[1])
        pool.add("lent@1", loader=lambda: random_weights(4), tenant="default")
        assert pool.acquire("lent@1", "lent@1", tenant="acme") is None  # queued behind the stuck read
        assert pool.entry("lent@1").read_group == "acme"
        began = time.monotonic()
        while pool.entry("lent@1").image is None and time.monotonic() - began < 10:
            pool.poll()  # past the load timeout the loader threads are replaced, the queued read sent again
            pool._wait_some(0.02)
        assert pool.entry("lent@1").image is not None and pool.entry("lent@1").read_group == "acme"
    finally:
        hung.set()
        pool.close()


def test_one_image_at_a_time_waits_for_its_owners_gpu_quota():
    """A tenant at its GPU quota (its adapter on the GPU in use) asking for many cold adapters of its own: one is
    read and waits for the quota (placed first when it frees), the others wait unread, not all read at once."""
    pool, size = quota_pool()
    try:
        pool.configure(cpu_budget_bytes=4 * size)
        for i in range(6):
            ask(pool, f"own{i}@1", "acme", seed=30 + i)
        pool.wait_idle()
        assert [i for i in range(6) if started(pool, f"own{i}@1")] == [0]
        pool.release(pool.entry("a@1").slot)  # the long request ends: own0 takes acme's place, idle until its
        pool.wait_idle()  # request runs, so acme is no longer held back: its reads go on within its share (4 images)
        assert pool.entry("own0@1").on_gpu and [i for i in range(1, 6) if started(pool, f"own{i}@1")] == [1, 2, 3, 4]
    finally:
        pool.close()


def test_an_image_found_in_the_cpu_tier_counts_for_the_tenant_asking_for_it(busy_pool):
    pool, size = busy_pool
    pool.configure(cpu_budget_bytes=size)
    pool.add("shared@1", loader=lambda: random_weights(40), tenant="default")
    assert pool.acquire("shared@1", "acme-req", tenant="acme") is None  # acme's read brings it to the CPU tier
    pool.wait_idle()
    pool.abandon("shared@1", "acme-req")
    assert pool.acquire("shared@1", "globex-req", tenant="globex") is None  # globex now waits for it: a slot
    ask(pool, "cold@1", "acme", seed=41)  # acme waits for nothing else: its first cold read starts at once
    assert started(pool, "cold@1")


@pytest.mark.parametrize("frees", ["abandon", "budget"])
def test_a_read_held_back_starts_once_room_comes_without_a_new_read_landing(busy_pool, frees):
    """acme's share holds one image, x's, waiting for a slot; y's read waits behind it. When x's request goes
    (abandon) or a push raises the budget, the next ask for y starts its read: nothing else may ever move the
    pool (no read in flight, no slot given back), so a request must not wait on a sweep that never comes."""
    pool, size = busy_pool
    pool.configure(cpu_budget_bytes=size)
    ask(pool, "x@1", "acme", seed=1)
    pool.wait_idle()
    assert pool.entry("x@1").image is not None and not pool.entry("x@1").on_gpu  # read, no slot free
    ask(pool, "y@1", "acme", seed=2)
    assert not started(pool, "y@1")  # acme's share is x's image
    if frees == "abandon":
        pool.abandon("x@1", "x@1")
        assert started(pool, "y@1")  # the abandon looked at the reads in line
    else:
        pool.configure(cpu_budget_bytes=2 * size)
        assert pool.acquire("y@1", "y@1", tenant="acme") is None  # the slots are still held
        assert started(pool, "y@1")
    pool.wait_idle()
    assert pool.entry("y@1").image is not None
