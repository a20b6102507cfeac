"""PagePool: unified KV/adapter pages, floors and ceilings, invariants, fragmentation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafleet.worker.page_pool import PagePool, PagePoolConfig, PagePoolError, kv_page_elems


def make_pool(num_pages=16, page_elems=32, **kw) -> PagePool:
    return PagePool(PagePoolConfig(num_pages=num_pages, page_elems=page_elems, **kw))


def test_allocate_free_roundtrip_and_owners():
    pool = make_pool()
    a = pool.allocate(3, ("kv", 1))
    b = pool.allocate(2, ("adapter", "x@1"))
    assert len(set(a) | set(b)) == 5
    assert pool.num_free == 11 and pool.num_used("kv") == 3 and pool.num_used("adapter") == 2
    assert pool.pages_of(("kv", 1)) == a and pool.owner_of(b[0]) == ("adapter", "x@1")
    pool.check()
    pool.free(a[:1])
    assert pool.pages_of(("kv", 1)) == a[1:]
    assert pool.free_owner(("kv", 1)) == 2
    assert pool.free_owner(("adapter", "x@1")) == 2
    assert pool.num_free == 16 and pool.owners() == []
    pool.check()


def test_double_free_and_foreign_ids_are_refused_without_side_effects():
    pool = make_pool()
    ids = pool.allocate(2, ("kv", 7))
    pool.free(ids[:1])
    with pytest.raises(PagePoolError, match="double free"):
        pool.free(ids)  # ids[0] already freed: nothing of this call may happen
    assert pool.pages_of(("kv", 7)) == ids[1:]
    with pytest.raises(PagePoolError):
        pool.free([ids[1], ids[1]])
    with pytest.raises(PagePoolError):
        pool.free([999])
    pool.check()


def test_over_allocation_is_refused():
    pool = make_pool(num_pages=4)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    with pytest.raises(PagePoolError, match="can_allocate"):
        pool.allocate(5, ("kv", 0))
    assert pool.num_free == 4


def test_unknown_kind_is_refused():
    pool = make_pool()
    with pytest.raises(PagePoolError, match="unknown page kind"):
        pool.allocate(1, ("weights", 0))


def test_memory_flows_to_whichever_kind_needs_it():
    # No floors: KV can take the whole pool when no adapter is resident, and vice versa.
    pool = make_pool(num_pages=8)
    kv = pool.allocate(8, ("kv", 0))
    assert not pool.can_allocate(1, "adapter")
    pool.free(kv)
    pool.allocate(8, ("adapter", "a@1"))
    assert not pool.can_allocate(1, "kv")


def test_floors_reserve_pages_and_ceilings_cap_a_kind():
    pool = make_pool(num_pages=10, min_pages={"kv": 4, "adapter": 2}, max_pages={"kv": None, "adapter": 5})
    # Adapters may take at most 5 (ceiling), and never the KV floor.
    assert pool.available("adapter") == 5
    pool.allocate(5, ("adapter", "a@1"))
    assert not pool.can_allocate(1, "adapter")
    assert pool.available("kv") == 5
    pool.free_owner(("adapter", "a@1"))
    # KV may take everything except the adapters' unmet floor of 2.
    assert pool.available("kv") == 8
    pool.allocate(8, ("kv", 1))
    assert pool.available("adapter") == 2
    pool.allocate(2, ("adapter", "b@1"))
    pool.check()


def test_config_validation():
    with pytest.raises(ValueError, match="floors"):
        PagePoolConfig(num_pages=4, page_elems=8, min_pages={"kv": 3, "adapter": 2})
    with pytest.raises(ValueError, match="max_pages"):
        PagePoolConfig(num_pages=4, page_elems=8, min_pages={"kv": 3}, max_pages={"kv": 2})
    with pytest.raises(ValueError, match="unknown page kind"):
        PagePoolConfig(num_pages=4, page_elems=8, min_pages={"lora": 1})


def test_fragmentation_counts_unused_elements_of_adapter_pages():
    pool = make_pool(num_pages=8, page_elems=100)
    pool.allocate(2, ("adapter", "a@1"), used_elems=150)
    assert pool.fragmentation("adapter") == pytest.approx(0.25)
    pool.allocate(2, ("kv", 0))
    assert pool.fragmentation("adapter") == pytest.approx(0.25)
    assert pool.fragmentation(None) == pytest.approx(50 / 400)
    assert pool.stats()["adapter_fragmentation"] == pytest.approx(0.25)


def test_kv_views_alias_the_pool():
    layers, bs, hkv, d = 2, 4, 2, 8
    elems = kv_page_elems(num_layers=layers, block_size=bs, num_kv_heads=hkv, head_dim=d)
    pool = make_pool(num_pages=3, page_elems=elems)
    caches = pool.kv_caches(num_layers=layers, block_size=bs, num_kv_heads=hkv, head_dim=d)
    k1, v1 = caches[1]
    assert k1.shape == (3, bs, hkv, d) and not k1.is_contiguous()
    k1[2, 3, 1, 5] = 7.0
    v1[0] = 1.0
    flat = pool.pool.view(3, layers, 2, bs, hkv, d)
    assert flat[2, 1, 0, 3, 1, 5] == 7.0 and torch.all(flat[0, 1, 1] == 1.0)
    assert torch.count_nonzero(flat[:, 0]) == 0  # layer 0 untouched
    with pytest.raises(ValueError, match="does not match"):
        pool.kv_caches(num_layers=3, block_size=bs, num_kv_heads=hkv, head_dim=d)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["kv", "adapter", "free"]), st.integers(0, 5), st.integers(0, 3)),
                max_size=60))
def test_random_operations_keep_invariants(ops):
    pool = make_pool(num_pages=12, min_pages={"kv": 2, "adapter": 1}, max_pages={"adapter": 8})
    for op, n, who in ops:
        if op == "free":
            owners = pool.owners()
            if owners:
                owner = owners[who % len(owners)]
                pages = pool.pages_of(owner)
                pool.free(pages[: max(1, n)])
        else:
            owner = (op, who)
            if pool.can_allocate(n, op):
                pool.allocate(n, owner)
            else:
                with pytest.raises(PagePoolError):
                    pool.allocate(n, owner)
        pool.check()
        assert pool.num_used("adapter") <= 8
        assert pool.num_free + pool.num_used("kv") + pool.num_used("adapter") == 12


def test_a_kind_at_its_ceiling_asks_no_other_kind_to_give_pages_back():
    """Reclaiming adapter pages for a KV cache at its own ceiling would evict adapters for nothing."""
    pool = make_pool(num_pages=8, max_pages={"kv": 4, "adapter": None})
    pool.allocate(4, ("kv", 1))
    pool.allocate(4, ("adapter", "x@1"))
    asked = []

    def reclaim(n: int) -> int:
        asked.append(n)
        return pool.free_owner(("adapter", "x@1"))

    pool.set_reclaimer("adapter", reclaim)
    assert not pool.can_allocate(1, "kv")
    assert asked == [] and pool.num_used("adapter") == 4
    pool.check()
