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


@pytest.mark.parametrize(("policy", "survivor"), [("lru", "recent"), ("lfu", "frequent")])
def test_policy_decides_the_victim_inside_the_pool(policy, survivor):
    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=1000))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=2, eviction_policy=policy, num_load_threads=1))
    pool.add("frequent@1", random_weights(1))
    pool.add("recent@1", random_weights(2))
    pool.load("frequent@1")
    for _ in range(5):
        pool.release(pool.acquire("frequent@1"))
    pool.load("recent@1")
    pool.release(pool.acquire("recent@1"))
    pool.add("newcomer@1", random_weights(3))
    pool.load("newcomer@1")
    assert pool.entry(f"{survivor}@1").resident
    victim = "frequent@1" if survivor == "recent" else "recent@1"
    assert not pool.entry(victim).resident
    pool.check()
    pool.close()
