"""Eviction policies: orders, pluggability by name, and each policy in a pool under pressure."""

import pytest

from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.eviction import CostAwarePolicy, EvictionCandidate, LFUPolicy, LRUPolicy, make_policy
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights

C = EvictionCandidate
CANDIDATES = [
    C("old-frequent", nbytes=100, last_used=1, uses=50, reload_seconds=0.1),
    C("new-rare", nbytes=100, last_used=9, uses=1, reload_seconds=0.1),
    C("big-rare", nbytes=10_000, last_used=8, uses=2, reload_seconds=0.1),
    C("mid", nbytes=100, last_used=5, uses=5, reload_seconds=0.1),
]


def keys(policy):
    return [c.key for c in policy.order(CANDIDATES)]


def test_lru_orders_by_last_use():
    assert keys(LRUPolicy()) == ["old-frequent", "mid", "big-rare", "new-rare"]


def test_lfu_orders_by_use_count():
    assert keys(LFUPolicy()) == ["new-rare", "big-rare", "mid", "old-frequent"]


def test_cost_aware_evicts_large_cheap_to_reload_first():
    order = keys(CostAwarePolicy())
    assert order[0] == "big-rare" and order[-1] == "old-frequent"
    # An expensive reload protects an adapter of the same size and use.
    a = C("cheap", 100, 1, 3, reload_seconds=0.001)
    b = C("dear", 100, 1, 3, reload_seconds=2.0)
    assert [c.key for c in CostAwarePolicy().order([b, a])] == ["cheap", "dear"]


def test_policies_are_chosen_by_name():
    assert make_policy("lru").name == "lru" and make_policy("lfu").name == "lfu"
    assert make_policy("cost").name == "cost"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        AdapterPoolConfig(eviction_policy="fifo")


def use_frequent_then_recent(pool: AdapterPool) -> None:
    """Both slots filled: `frequent@1` used five times, then `recent@1` once (LRU and LFU disagree)."""
    pool.add("frequent@1", random_weights(1))
    pool.add("recent@1", random_weights(2))
    pool.load("frequent@1")
    for _ in range(5):
        pool.release(pool.acquire("frequent@1"))
    pool.load("recent@1")
    pool.release(pool.acquire("recent@1"))


@pytest.mark.parametrize(("policy", "survivor"), [("lru", "recent"), ("lfu", "frequent")])
def test_policy_decides_the_victim_inside_the_pool(policy, survivor):
    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=1000))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=2, eviction_policy=policy, num_load_threads=1))
    use_frequent_then_recent(pool)
    pool.add("newcomer@1", random_weights(3))
    pool.load("newcomer@1")
    assert pool.entry(f"{survivor}@1").resident
    victim = "frequent@1" if survivor == "recent" else "recent@1"
    assert not pool.entry(victim).resident
    pool.check()
    pool.close()


def test_plan_placement_quota_first_then_pages_and_nothing_pointless():
    from lorafleet.worker.adapter_pool_config import TenantQuota
    from lorafleet.worker.eviction import plan_placement

    ordered = [("x1", "other", 4, 400), ("m1", "me", 2, 200), ("x2", "other", 4, 400), ("m2", "me", 2, 200)]
    common = {"nbytes": 200, "tenant": "me", "ordered": ordered, "free_slots": 0}
    # Over quota (2 of 2 held): my own least valuable adapter goes first, even if another's is older.
    assert plan_placement(need_pages=2, quota=TenantQuota(max_adapters=2), tenant_count=2, tenant_bytes=400,
                          free_pages=0, **common) == ["m1"]
    # No quota: the policy order decides; enough pages after x1.
    assert plan_placement(need_pages=3, quota=TenantQuota(), tenant_count=2, tenant_bytes=400, free_pages=0,
                          **common) == ["x1"]
    # Cannot fit even after evicting everything: evict nothing.
    assert plan_placement(need_pages=100, quota=TenantQuota(), tenant_count=2, tenant_bytes=400, free_pages=0,
                          **common) is None
    # A byte quota the adapter alone exceeds can never be met.
    assert plan_placement(need_pages=1, quota=TenantQuota(max_bytes=100), tenant_count=0, tenant_bytes=0,
                          free_pages=10, nbytes=200, tenant="me", ordered=[], free_slots=1) is None
