"""AdapterPool: what keeps an adapter on the GPU (a queued request, the adapters' page floor), which
version a re-registration leaves current, what a caller hears after a failed load recovered, and when a
version handed to another tenant is brought within that tenant's quota."""

from __future__ import annotations

import threading

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights
from tests.worker.test_adapter_pool import PAGE_ELEMS, failed_load, flaky_loader, make_pool


@pytest.fixture(scope="module")
def adapter_pages() -> int:
    """Pages one `random_weights` adapter (default rank) takes."""
    probe = make_pool()
    try:
        probe.add("probe@1", random_weights(0))
        return probe.entry("probe@1").image.num_pages
    finally:
        probe.close()


def test_an_anonymous_acquire_after_a_recovered_load_gets_the_slot():
    pool = make_pool()
    try:
        broken = failed_load(pool)
        with pytest.raises(AdapterLoadError, match="object store unreachable"):
            pool.acquire("flaky@1", waiter="w1")
        broken["on"] = False
        assert pool.acquire("flaky@1", waiter="w2") is None  # a new request loads it again
        pool.wait_idle()
        slot = pool.acquire("flaky@1", waiter="w2")
        assert slot is not None
        assert pool.acquire("flaky@1") == slot  # the old failure is over: no error, stale or None
        pool.release(slot)
        pool.release(slot)
        pool.check()
    finally:
        pool.close()


def test_evict_refuses_an_adapter_a_queued_request_waits_for():
    pool = make_pool()
    try:
        pool.add("a@1", random_weights(1))
        assert pool.acquire("a@1", waiter="queued") is None
        pool.wait_idle()
        assert pool.entry("a@1").resident
        with pytest.raises(RuntimeError, match="cannot be evicted.*queued requests=1"):
            pool.evict("a@1")
        slot = pool.acquire("a@1", waiter="queued")
        assert slot is not None and pool.stats()["evictions"]["gpu"] == {}
        pool.release(slot)
        pool.evict("a@1")  # nobody holds or waits for it now
        assert not pool.entry("a@1").resident
        pool.check()
    finally:
        pool.close()


def test_kv_reclaim_evicts_no_adapter_when_the_adapter_floor_keeps_the_pages(adapter_pages):
    """Pages below the adapters' floor (min_pages) never go to the KV cache: evicting adapters that
    would only free such pages loses them for nothing."""
    n = adapter_pages
    pages = PagePool(PagePoolConfig(num_pages=3 * n, page_elems=PAGE_ELEMS, min_pages={"kv": 0, "adapter": 2 * n}))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=4, max_rank=32, num_load_threads=1))
    try:
        for i in range(3):
            pool.add(f"a{i}@1", random_weights(i))
            pool.load(f"a{i}@1")
        assert pages.num_free == 0
        assert pool.reclaimable_pages() == n  # only the pages above the floor
        assert not pages.can_allocate(2 * n, "kv")
        assert all(pool.entry(f"a{i}@1").resident for i in range(3))
        assert pool.stats()["evictions"]["gpu"] == {}
        assert pages.can_allocate(n, "kv")  # one adapter's pages are above the floor: that one goes
        assert sum(pool.entry(f"a{i}@1").resident for i in range(3)) == 2
        pool.check()
    finally:
        pool.close()


def test_registering_the_current_version_again_drops_the_version_loading_to_replace_it():
    """A rollback pushed while the new version still loads: the re-registered version stays current."""
    pool = make_pool()
    gate = threading.Event()

    def slow_v2():
        gate.wait(30)
        return random_weights(2)

    try:
        pool.add("a@1", random_weights(1))
        pool.load("a@1")
        pool.add("a@2", loader=slow_v2)  # current once resident
        pool.add("a@1", random_weights(1))
        gate.set()
        pool.wait_idle()
        assert pool.resolve("a") == "a@1"
        assert pool.registered() == ["a@1"]
        pool.check()
    finally:
        gate.set()
        pool.close()


def test_registering_a_canary_again_as_current_promotes_it():
    pool = make_pool()
    try:
        pool.add("a@1", random_weights(1))
        pool.add("a@2", random_weights(2), make_current=False)
        assert pool.resolve("a") == "a@1"
        pool.add("a@2", random_weights(2))  # make_current=True: current once resident
        pool.load("a@2")
        assert pool.resolve("a") == "a@2"
        assert pool.registered() == ["a@2"]
        pool.check()
    finally:
        pool.close()



def test_a_request_taking_its_adapter_again_is_one_gpu_lookup_and_removal_updates_the_gauges():
    """A queued request that gave its adapter back (so it could be evicted) and takes it again is not a
    second GPU hit (the autoscaler's hit rate); removing a version updates the gauges at once, not at
    the next poll."""
    pool = make_pool()
    try:
        pool.add("a@1", random_weights(1))
        pool.add("a@2", random_weights(2), make_current=False)
        pool.load("a@1")
        pool.load("a@2")
        slot = pool.acquire("a@1", waiter=7)
        pool.release(slot)
        assert pool.acquire("a@1", waiter=7, count=False) == slot
        assert pool.stats()["hits"].get("gpu", 0) == 1 and not pool.stats()["misses"].get("gpu", 0)
        pool.release(slot)
        gauge = pool.metrics.resident.labels("cpu")
        assert gauge._value.get() == pool.stats()["resident"]["cpu"] == 2
        pool.remove("a@2")  # unused: its CPU and GPU copies go at once
        assert gauge._value.get() == pool.stats()["resident"]["cpu"] == 1
    finally:
        pool.close()


class _NoScan(dict):
    """The pool's table of entries, refusing a walk over all of them."""

    def values(self):
        raise AssertionError("a walk over every registered adapter")


def test_kv_held_pages_reads_the_pinned_versions_only(adapter_pages):
    """It is asked per request: with thousands of adapters registered it must not walk them all. Pinned,
    unpinned, re-pinned and removed versions are counted as they are now."""
    pool = make_pool()
    try:
        for i in range(3):
            pool.add(f"a{i}@1", random_weights(i))
        pool.add("p@1", random_weights(5), pinned=True)
        pool.add("q@1", random_weights(6))
        pool.pin("q@1")
        pool._entries = _NoScan(pool._entries)
        assert pool.kv_held_pages("a0@1") == (adapter_pages, 2 * adapter_pages)
        assert pool.kv_held_pages("p@1") == (adapter_pages, adapter_pages)  # its own name is its own pages
        pool.unpin("q@1")
        assert pool.kv_held_pages(None) == (0, adapter_pages)
        pool.pin("q@1")
        assert pool.kv_held_pages(None) == (0, 2 * adapter_pages)
    finally:
        pool._entries = dict(pool._entries)
        pool.close()


def test_a_canary_s_kv_room_counts_its_name_s_pinned_stable_version(adapter_pages):
    """A pinned stable x@1 with a canary x@2 beside it: both stay on the GPU while a request runs on the canary, so
    its KV cache can never have either's pages. Only its own were counted: a request that could never fit was
    admitted and failed midway (CapacityError) instead of being refused up front."""
    pool = make_pool()
    try:
        pool.add("x@1", random_weights(1), pinned=True)
        pool.add("x@2", random_weights(2), make_current=False)
        assert pool.kv_held_pages("x@2") == (adapter_pages, adapter_pages)
        assert pool.kv_held_pages("x@1") == (adapter_pages, 0)  # its own pinned pages count once, as its own
    finally:
        pool.close()


def test_an_adapter_evicted_from_memory_still_counts_its_pages_for_the_kv_room(adapter_pages):
    """Once read, an adapter's pages are known (its digest fixes them) after its image left CPU memory too: what
    /v1/models and the context refusal hold a request for it to. It counted as no pages then, so the base
    model's limit was advertised for it and a request that could never fit beside it was admitted."""
    pool = make_pool()
    try:
        pool.add("a@1", random_weights(1))
        assert pool.kv_held_pages("a@1") == (adapter_pages, 0)
        pool.evict("a@1", tier="cpu")
        assert pool.entry("a@1").image is None and pool.kv_held_pages("a@1") == (adapter_pages, 0)
    finally:
        pool.close()


def test_the_pool_layout_records_each_projection_s_widths():
    """So the LoRA launchers refuse activations of other widths (kernels/lora.py `_check_widths`)."""
    from lorafleet.kernels.lora_layout import PROJS

    pool = make_pool()
    try:
        assert pool.layout.widths == tuple(TINY_DIMS.in_out(p) for p in PROJS)
    finally:
        pool.close()


@pytest.mark.parametrize("busy", ["in_use", "copying"])
def test_a_version_handed_to_a_tenant_over_its_quota_leaves_the_gpu_once_idle(busy):
    """sql@v1 changes owner to globex, whose quota (1 adapter) chat@1 fills, while a request holds it (or while
    its copy runs): the quota check was skipped, and globex stayed over its quota until its next placement. Now
    sql@v1 leaves the GPU when its last request releases it (its copy lands)."""
    from lorafleet.worker.adapter_pool_config import TenantQuota

    pool = make_pool(tenant_quotas={"globex": TenantQuota(max_adapters=1)})
    try:
        pool.add("chat@1", random_weights(1), tenant="globex")
        pool.load("chat@1")
        pool.add("sql@v1", random_weights(2), tenant="acme")
        if busy == "in_use":
            pool.load("sql@v1")
            slot = pool.acquire("sql@v1")
            pool.set_tenant("sql@v1", "globex")
            assert pool.entry("sql@v1").resident  # its request runs on
            pool.release(slot)
        else:
            with pool._lock:  # the copy starts, then the owner changes before it lands
                pool._want(pool.entry("sql@v1"))
                assert pool.entry("sql@v1").on_gpu and not pool.entry("sql@v1").resident
                pool.set_tenant("sql@v1", "globex")
            pool.wait_idle()
        resident = {d["key"] for d in pool.describe() if d["tier"] == "gpu"}
        assert resident == {"chat@1"} and pool.entry("sql@v1").tenant == "globex"
        pool.check()
    finally:
        pool.close()


def test_a_retired_version_still_held_and_rolled_back_for_another_tenant_is_brought_within_its_quota():
    """sql@v1 (acme) is held by a request when v2 replaces it; a rollback registers v1 again for globex, whose
    quota (1 adapter) chat@1 fills. Its owner was set without the quota check, so globex stayed over its quota
    once the request released v1."""
    from lorafleet.worker.adapter_pool_config import TenantQuota

    pool = make_pool(tenant_quotas={"globex": TenantQuota(max_adapters=1)})
    try:
        pool.add("chat@1", random_weights(1), tenant="globex")
        pool.load("chat@1")
        pool.add("sql@v1", random_weights(2), tenant="acme")
        pool.load("sql@v1")
        slot = pool.acquire("sql@v1")
        pool.add("sql@v2", random_weights(3), tenant="acme")
        pool.load("sql@v2")  # v1 retired, held by its request
        pool.add("sql@v1", random_weights(2), tenant="globex")  # the rollback, for another owner
        pool.release(slot)
        pool.wait_idle()
        assert sum(d["tier"] == "gpu" and d["tenant"] == "globex" for d in pool.describe()) == 1
        pool.check()
    finally:
        pool.close()


def test_a_successor_over_its_new_owner_s_quota_says_so_not_that_every_slot_is_pinned():
    """Every slot pinned, and sql@v2 handed to beta, whose quota one pinned adapter fills: v1 (acme's) may
    give way, but frees none of beta's quota. The error names the quota, not --max-loras."""
    from lorafleet.worker.adapter_pool_config import TenantQuota

    pool = make_pool(max_slots=2, tenant_quotas={"beta": TenantQuota(max_adapters=1)})
    try:
        pool.add("sql@v1", random_weights(0), tenant="acme", pinned=True)
        pool.add("chat@c1", random_weights(1), tenant="beta", pinned=True)
        pool.wait_idle()
        assert pool.pinned_slot_keys() == ["chat@c1", "sql@v1"]
        pool.add("sql@v2", random_weights(2), tenant="beta", pinned=True)
        assert pool.acquire("sql@v2", waiter="r") is None
        pool.poll()
        with pytest.raises(AdapterLoadError, match="tenant 'beta' is at its GPU quota") as exc:
            pool.acquire("sql@v2", waiter="r")
        assert exc.value.retryable and "--max-loras" not in str(exc.value)
        pool.check()
    finally:
        pool.close()


def test_a_pinned_version_gives_way_to_its_successor_when_their_owner_s_quota_is_full():
    """A slot is free, but beta's quota (one adapter) is held by sql@v1, pinned: v2, replacing it, would
    wait for ever beside it. v1 gives way as it does when every slot is pinned, and v2 becomes current."""
    from lorafleet.worker.adapter_pool_config import TenantQuota

    pool = make_pool(max_slots=3, tenant_quotas={"beta": TenantQuota(max_adapters=1)})
    try:
        pool.add("sql@v1", random_weights(0), tenant="beta", pinned=True)
        pool.wait_idle()
        pool.add("sql@v2", random_weights(1), tenant="beta", pinned=True)
        assert pool.acquire("sql@v2", waiter="r") is None
        pool.wait_idle()
        assert not pool.poll() and (slot := pool.acquire("sql@v2", waiter="r")) is not None
        assert pool.resolve("sql") == "sql@v2"
        with pytest.raises(KeyError):  # retired at the switch, held by no request: dropped
            pool.entry("sql@v1")
        pool.release(slot)
        pool.check()
    finally:
        pool.close()



def test_requests_for_a_version_its_owner_s_pinned_adapters_keep_out_are_refused_and_it_stays_wanted():
    """A slot is free, but beta's quota (one adapter) is held by chat@c1, pinned, which never leaves by itself:
    the request waiting for beta's sql@v1 is refused (retryable, saying what to change), not left waiting for
    ever; sql@v1 stays wanted, and is placed, without another request, once chat@c1 is unpinned."""
    from lorafleet.worker.adapter_pool_config import TenantQuota

    pool = make_pool(max_slots=3, tenant_quotas={"beta": TenantQuota(max_adapters=1)})
    try:
        pool.add("chat@c1", random_weights(0), tenant="beta", pinned=True)
        pool.add("sql@v1", random_weights(1), tenant="beta")
        pool.wait_idle()
        assert pool.pinned_slot_keys() is None
        assert pool.acquire("sql@v1", waiter="r") is None
        assert [key for key, _ in pool.poll()] == ["sql@v1"]
        with pytest.raises(AdapterLoadError, match="tenant 'beta' is at its GPU quota, held by its pinned") as exc:
            pool.acquire("sql@v1", waiter="r")
        assert exc.value.retryable and pool.has_pending_loads()
        assert not pool.poll()  # nobody waits now: nothing more to answer
        pool.unpin("chat@c1")
        pool.poll()
        pool.wait_idle()
        assert pool.entry("sql@v1").resident and not pool.entry("chat@c1").on_gpu
        pool.check()
    finally:
        pool.close()


def test_a_pinned_version_whose_successor_failed_to_load_still_counts_against_the_quota():
    """a@2 replaces the pinned a@1 but its load failed (retryable): it stays pending, wanted by no one, so
    a@1 stays; beta's quota (two adapters) is held by a@1 and b@1, pinned, and x@1's request is refused."""
    from lorafleet.worker.adapter_pool_config import TenantQuota

    pool = make_pool(max_slots=4, tenant_quotas={"beta": TenantQuota(max_adapters=2)})
    try:
        pool.add("a@1", random_weights(0), tenant="beta", pinned=True)
        pool.add("b@1", random_weights(1), tenant="beta", pinned=True)
        pool.wait_idle()
        _, loader = flaky_loader()
        pool.add("a@2", loader=loader, tenant="beta")
        pool.wait_idle()
        pool.poll()
        pool.add("x@1", random_weights(2), tenant="beta")
        assert pool.acquire("x@1", waiter="r") is None
        pool.wait_idle()
        pool.poll()
        with pytest.raises(AdapterLoadError, match="held by its pinned adapters"):
            pool.acquire("x@1", waiter="r")
        pool.check()
    finally:
        pool.close()


def test_a_cold_read_whose_only_request_went_away_ends_on_the_cpu_and_evicts_nobody():
    """The request for cold x left (client gone) while x was read: x stayed wanted and, once read, took the
    only slot from idle y, another tenant's hot adapter nobody asked to evict."""
    pool = make_pool(max_slots=1)
    gate = threading.Event()
    try:
        pool.add("y@1", random_weights(2), tenant="globex")
        pool.load("y@1")
        pool.add("x@1", loader=lambda: gate.wait(10) and random_weights(1), tenant="acme")
        assert pool.acquire("x@1", waiter="r") is None
        pool.abandon("x@1", "r")
        gate.set()
        pool.wait_idle()
        assert pool.entry("x@1").tier() == "cpu" and pool.entry("y@1").tier() == "gpu"
        assert pool.stats()["evictions"]["gpu"] == {}
        pool.check()
    finally:
        gate.set()
        pool.close()
