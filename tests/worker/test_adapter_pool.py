"""AdapterPool: layout in the unified page pool, async loads, refcounts, pinning, quotas, versions,
failures, metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from lorafleet.kernels.lora_layout import PROJS
from lorafleet.worker.adapter_entry import AdapterLoadError, AdapterNotFoundError
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig, TenantQuota
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights

PAGE_ELEMS = 1000  # not a multiple of any row length: rows must skip to the next page


def make_pool(num_pages=256, **kw) -> AdapterPool:
    pages = PagePool(PagePoolConfig(num_pages=num_pages, page_elems=PAGE_ELEMS))
    cfg = AdapterPoolConfig(**{"max_slots": 4, "max_rank": 32, "num_load_threads": 1, **kw})
    return AdapterPool(pages, TINY_DIMS, cfg)


def flaky_loader() -> tuple[dict[str, bool], Callable[[], object]]:
    """(switch, loader): the loader raises ConnectionError while switch["on"], else returns an adapter."""
    broken = {"on": True}

    def loader():
        if broken["on"]:
            raise ConnectionError("object store unreachable")
        return random_weights(5)

    return broken, loader


def failed_load(pool: AdapterPool, key: str = "flaky@1", waiter: str = "w1") -> dict[str, bool]:
    """Register ``key`` with a flaky loader and let the load ``waiter`` starts fail; returns its switch."""
    broken, loader = flaky_loader()
    pool.add(key, loader=loader)
    assert pool.acquire(key, waiter=waiter) is None
    pool.wait_idle()
    return broken


def dense_from_layout(pool: AdapterPool, slot: int, layer: int, proj: str):
    """Read A [r, in] and B [out, r] of one module back through the layout's offsets."""
    lay = pool.layout
    pid = PROJS.index(proj)
    r = int(lay.ranks[layer, pid, slot])
    fan_in, fan_out = TINY_DIMS.in_out(proj)
    flat = lay.pool.view(-1)
    a = torch.stack([flat[int(o) : int(o) + fan_in] for o in lay.a_offsets[layer, pid, slot, :r]])
    bt = torch.stack([flat[int(o) : int(o) + fan_out] for o in lay.b_offsets[layer, pid, slot, :r]])
    return a, bt.T, float(lay.scales[layer, pid, slot])


@pytest.fixture
def pool():
    p = make_pool()
    yield p
    p.close()


def test_mixed_ranks_and_module_subsets_round_trip_through_the_layout(pool):
    adapters = {
        "r4@1": random_weights(1, rank=4, projs=("q_proj", "v_proj"), alpha=8),
        "r16@1": random_weights(2, rank=16, alpha=5),
        "r32@1": random_weights(3, rank=32, projs=("gate_proj", "down_proj"), alpha=64),
    }
    for key, w in adapters.items():
        pool.add(key, w)
        pool.load(key)
    pool.check()
    for key, w in adapters.items():
        slot = pool.entry(key).slot
        for layer in range(TINY_DIMS.num_layers):
            for proj in PROJS:
                if (layer, proj) not in w.modules:
                    assert int(pool.layout.ranks[layer, PROJS.index(proj), slot]) == 0
                    continue
                a, b, scale = dense_from_layout(pool, slot, layer, proj)
                m = w.modules[(layer, proj)]
                assert torch.equal(a, m.a) and torch.equal(b, m.b) and scale == pytest.approx(m.scale)
    # No rank padding: waste is under one row per page.
    for key, w in adapters.items():
        rows = sum(2 * m.a.shape[0] for m in w.modules.values())
        elems = sum(m.a.numel() + m.b.numel() for m in w.modules.values())
        e = pool.entry(key)
        assert len(e.page_ids) * PAGE_ELEMS - elems < len(e.page_ids) * 128  # < one (longest) row per page
        assert rows > 0
    assert 0 < pool.stats()["fragmentation"] < 0.13
    # The layout's row_align is as large as the widths allow, and every live row honours it (the
    # kernels' vector loads rely on it).
    assert pool.layout.row_align == TINY_DIMS.row_align(PAGE_ELEMS) > 1
    pool.layout.check_alignment()


def test_row_align_follows_the_model_widths_and_page_size():
    from lorafleet.worker.adapter_image import ModelDims

    llama = ModelDims(num_layers=32, hidden_size=4096, intermediate_size=14336, q_size=4096, kv_size=1024)
    assert llama.row_align(2 * 2 * 16 * 8 * 128 * 32) == 16
    assert llama.row_align(1000) == 8
    assert ModelDims(num_layers=2, hidden_size=64, intermediate_size=86, q_size=64, kv_size=32).row_align(4096) == 2


def test_rows_never_straddle_pages():
    pool = make_pool()
    w = random_weights(7, rank=16)
    pool.add("x@1", w)
    slot = pool.load("x@1")
    lay = pool.layout
    for layer in range(TINY_DIMS.num_layers):
        for pid, proj in enumerate(PROJS):
            fan_in, fan_out = TINY_DIMS.in_out(proj)
            for o in lay.a_offsets[layer, pid, slot, :16].tolist():
                assert o // PAGE_ELEMS == (o + fan_in - 1) // PAGE_ELEMS
            for o in lay.b_offsets[layer, pid, slot, :16].tolist():
                assert o // PAGE_ELEMS == (o + fan_out - 1) // PAGE_ELEMS
    pool.close()


def test_acquire_never_blocks_and_one_load_serves_concurrent_requests(pool):
    gate = threading.Event()
    calls = []

    def slow_loader():
        calls.append(1)
        gate.wait(30)
        return random_weights(11)

    pool.add("cold@1", loader=slow_loader)
    # Five requests ask while the load is stuck in its thread: every call returns at once.
    assert [pool.acquire("cold@1", waiter=i) for i in range(5)] == [None] * 5
    assert pool.acquire("cold@1", waiter=0) is None
    gate.set()
    pool.wait_idle()
    slots = {pool.acquire("cold@1", waiter=i) for i in range(5)}
    assert len(calls) == 1 and len(slots) == 1 and None not in slots
    slot = slots.pop()
    assert pool.entry("cold@1").refcount == 5
    stats = pool.stats()
    assert stats["misses"]["gpu"] == 5 and stats["hits"]["gpu"] == 0 and stats["misses"]["cpu"] == 1
    for _ in range(5):
        pool.release(slot)
    with pytest.raises(RuntimeError, match="holds no reference"):
        pool.release(slot)
    pool.check()


def test_bare_name_resolves_to_current_version(pool):
    pool.add("n@1", random_weights(1))
    pool.load("n@1")
    slot = pool.acquire("n")
    assert pool.slot_key(slot) == "n@1"
    pool.release(slot)
    with pytest.raises(AdapterNotFoundError):
        pool.acquire("missing")


def test_never_evicts_referenced_or_pinned_adapters(pool):
    for i in range(4):
        pool.add(f"a{i}@1", random_weights(i), pinned=(i == 0))
    pool.wait_idle()  # a0 (pinned) is loaded without a request
    assert pool.entry("a0@1").resident
    held = [pool.acquire(f"a{i}@1") for i in range(1, 4)]
    pool.wait_idle()
    held = [pool.acquire(f"a{i}@1") for i in range(1, 4)]
    assert None not in held
    pool.add("new@1", random_weights(9))
    assert pool.acquire("new@1", waiter="r") is None
    pool.wait_idle()
    assert pool.acquire("new@1", waiter="r") is None  # 4 slots: 1 pinned + 3 referenced
    assert all(pool.entry(f"a{i}@1").resident for i in range(4))
    with pytest.raises(RuntimeError, match="cannot be evicted"):
        pool.evict("a0@1")
    with pytest.raises(RuntimeError, match="cannot be evicted"):
        pool.evict("a1@1")
    pool.release(held[1])  # a2 free to go
    pool.poll()
    pool.wait_idle()
    assert pool.acquire("new@1", waiter="r") is not None
    assert not pool.entry("a2@1").resident and pool.entry("a0@1").resident
    assert pool.stats()["evictions"]["gpu"] == {"capacity": 1}
    pool.check()


def test_an_adapter_fails_at_once_when_every_slot_is_held_by_pinned_adapters():
    """Pinned adapters never leave on their own: an adapter that needs a slot while all of them are
    pinned fails its waiters with a reason they can act on instead of leaving them waiting forever.
    Once one is unpinned, the next request gets its slot."""
    pool = make_pool(max_slots=2)
    for i in range(2):
        pool.add(f"p{i}@1", random_weights(i), pinned=True)
    pool.add("other@1", random_weights(5))
    pool.wait_idle()
    assert pool.acquire("other@1", waiter="r") is None
    pool.poll()
    with pytest.raises(AdapterLoadError, match=r"every adapter slot \(2, --max-loras\) is held by pinned adapters "
                                               r"\(p0@1, p1@1\); unpin one"):
        pool.acquire("other@1", waiter="r")
    assert (pool.stats()["load_failures"], pool.stats()["refusals"]) == (0, 1)  # a policy's, not a failed load
    pool.unpin("p0@1")
    assert pool.acquire("other@1", waiter="r2") is None
    pool.wait_idle()
    assert pool.acquire("other@1", waiter="r2") is not None
    assert not pool.entry("p0@1").resident and pool.entry("p1@1").resident
    pool.check()
    pool.close()


def test_an_adapter_waits_for_a_slot_that_an_in_flight_request_will_free():
    """One slot pinned, the other in use: the in-use one frees when its request ends, so a new adapter
    waits for it instead of failing."""
    pool = make_pool(max_slots=2)
    pool.add("p@1", random_weights(0), pinned=True)
    pool.add("busy@1", random_weights(1))
    pool.add("next@1", random_weights(2))
    pool.load("busy@1")
    slot = pool.acquire("busy@1")
    pool.wait_idle()
    assert pool.acquire("next@1", waiter="r") is None
    pool.wait_idle()
    assert pool.acquire("next@1", waiter="r") is None  # still waiting, not failed
    pool.release(slot)
    pool.wait_idle()
    assert pool.acquire("next@1", waiter="r") is not None
    assert pool.stats()["load_failures"] == 0
    pool.check()
    pool.close()


@pytest.mark.parametrize("hot", ["hot@1", "a-hot@1"])  # named after and before the cold ones: no order by name passes
def test_lru_keeps_the_hot_adapter_when_cold_ones_stream_through(hot):
    # The seed's pitfall: without LRU, cold adapters fill memory and push the hot one out.
    pool = make_pool(max_slots=3)
    pool.add(hot, random_weights(0))
    for i in range(20):
        pool.load(hot)
        slot = pool.acquire(hot)
        pool.release(slot)
        pool.add(f"cold{i}@1", random_weights(100 + i))
        pool.load(f"cold{i}@1")
        assert pool.entry(hot).resident
    pool.check()
    pool.close()


def test_lru_counts_an_adapter_in_use_until_now_as_recent():
    """hot serves one long request while c1 and c2 serve a short one each; once hot's ends, it was used last:
    a new adapter needing a slot evicts c1 (idle longest), not hot, whose last acquire was the earliest."""
    pool = make_pool(max_slots=3)
    for i, key in enumerate(("hot@1", "c1@1", "c2@1", "c3@1")):
        pool.add(key, random_weights(i))
    pool.load("hot@1")
    held = pool.acquire("hot@1")
    for key in ("c1@1", "c2@1"):
        pool.load(key)
        pool.release(pool.acquire(key))
    pool.release(held)
    pool.load("c3@1")
    assert {k: pool.entry(k).resident for k in ("hot@1", "c1@1", "c2@1", "c3@1")} == {
        "hot@1": True, "c1@1": False, "c2@1": True, "c3@1": True}
    pool.check()
    pool.close()


def test_failed_load_fails_only_its_waiters_and_can_recover(pool):
    broken, loader = flaky_loader()

    pool.add("ok@1", random_weights(4))
    pool.load("ok@1")
    asked = threading.Event()  # both requests wait for the one load before it fails
    pool.add("flaky@1", loader=lambda: asked.wait(10) and loader())
    assert pool.acquire("flaky@1", waiter="w1") is None
    assert pool.acquire("flaky@1", waiter="w2") is None
    asked.set()
    pool.wait_idle()
    failures = pool.poll()
    for w in ("w1", "w2"):
        with pytest.raises(AdapterLoadError, match="object store unreachable") as exc:
            pool.acquire("flaky@1", waiter=w)
        assert exc.value.retryable  # an I/O error may pass: the HTTP layer does not mark the version failed
    assert failures == [] or failures[0][0] == "flaky@1"
    slot = pool.acquire("ok@1", waiter="other")  # unaffected
    assert slot is not None
    pool.release(slot)
    pool.check()
    broken["on"] = False
    assert pool.acquire("flaky@1", waiter="w3") is None  # a new request starts a new load
    pool.wait_idle()
    assert pool.acquire("flaky@1", waiter="w3") is not None
    assert pool.stats()["load_failures"] == 1


@pytest.mark.parametrize("bad", ["shape", "rank", "layer"])
def test_shape_mismatch_fails_with_the_module_named(pool, bad):
    w = random_weights(3, rank=8)
    if bad == "shape":
        w.modules[(1, "k_proj")].a = torch.zeros(8, 65)
    elif bad == "rank":
        w = random_weights(3, rank=48)  # above max_rank=32
    else:
        w.modules[(5, "q_proj")] = w.modules[(0, "q_proj")]
    pool.add("bad@1", loader=lambda: w)
    assert pool.acquire("bad@1", waiter=1) is None
    pool.wait_idle()
    expected = {"shape": r"layers\.1\.k_proj", "rank": "max_rank", "layer": "layer 5"}[bad]
    with pytest.raises(AdapterLoadError, match=expected) as exc:
        pool.acquire("bad@1", waiter=1)
    assert not exc.value.retryable  # the files must change first
    pool.check()
    assert pool.stats()["resident"]["gpu"] == 0


class PanicException(BaseException):
    """As pyo3 raises a Rust library's panic (tokenizers, safetensors): a BaseException, not an Exception."""


def test_a_loader_s_panic_fails_only_its_adapter(pool):
    """One adapter's malformed file makes a Rust library panic in its loader thread: that adapter's requests
    fail, the step loop (which finishes loads) goes on, and the next adapter loads."""
    def panics():
        raise PanicException("Onig: Regex search error: retry-limit-in-match over")

    pool.add("p@1", loader=panics)
    pool.add("ok@1", loader=lambda: random_weights(1))
    assert pool.acquire("p@1", waiter=1) is None and pool.acquire("ok@1", waiter=2) is None
    pool.wait_idle()
    with pytest.raises(AdapterLoadError, match="load failed: Onig"):
        pool.acquire("p@1", waiter=1)
    assert pool.acquire("ok@1", waiter=2) is not None
    pool.check()


def test_same_key_with_different_content_is_refused(pool):
    pool.add("s@1", random_weights(1))
    pool.add("s@1", random_weights(1))  # same content: no-op
    with pytest.raises(ValueError, match="new version"):
        pool.add("s@1", random_weights(2))


def test_reload_with_changed_content_is_refused_not_served(pool):
    current = {"w": random_weights(1)}
    pool.add("d@1", loader=lambda: current["w"])
    pool.load("d@1")
    pool.evict("d@1", "gpu")
    pool.evict("d@1", "cpu")
    current["w"] = random_weights(2)  # the file under d@1 changed
    assert pool.acquire("d@1", waiter=1) is None
    pool.wait_idle()
    with pytest.raises(AdapterLoadError, match="content changed"):
        pool.acquire("d@1", waiter=1)
    pool.check()


def test_versions_switch_atomically_and_in_flight_requests_keep_their_version(pool):
    v1, v2 = random_weights(1, name="m", version="1"), random_weights(2, name="m", version="2")
    pool.add("m@1", v1)
    pool.load("m@1")
    s1 = pool.acquire("m")
    queued_key = pool.resolve("m")  # a request resolved before the switch, admitted after it
    pool.add("m@2", v2)
    assert pool.resolve("m") in ("m@1", "m@2")
    pool.wait_idle()
    assert pool.resolve("m") == "m@2"
    s2 = pool.acquire("m")
    assert s1 != s2 and pool.slot_key(s1) == "m@1" and pool.slot_key(s2) == "m@2"
    a, _, _ = dense_from_layout(pool, s1, 0, "q_proj")
    assert torch.equal(a, v1.modules[(0, "q_proj")].a)  # the old version is intact while in use
    assert pool.acquire(queued_key) == s1  # still resident: it keeps the version it resolved
    with pytest.raises(AdapterNotFoundError):
        pool.resolve("m@1")  # no new request can name it
    assert "m@1" not in pool.registered()
    pool.release(s1)
    pool.release(s1)
    # Replaced versions are the first to go when memory is needed.
    pool.add("x@1", random_weights(3))
    pool.add("y@1", random_weights(4))
    pool.add("z@1", random_weights(5))
    for k in ("x@1", "y@1", "z@1"):
        pool.load(k)
    assert int(pool.layout.ranks[:, :, s1].abs().sum()) == 0 or pool.slot_key(s1) != "m@1"
    with pytest.raises(AdapterNotFoundError):
        pool.acquire(queued_key)  # gone now: the request fails with a clear error
    assert pool.stats()["evictions"]["gpu"].get("version") == 1
    pool.release(s2)
    pool.check()


def test_make_current_promotes_a_registered_version_and_retires_the_old_one(pool):
    v1, v2 = random_weights(1, name="c", version="1"), random_weights(2, name="c", version="2")
    pool.add("c@1", v1)
    pool.add("c@2", v2, make_current=False)  # a canary beside the stable version
    pool.load("c@1")
    pool.load("c@2")
    assert pool.resolve("c") == "c@1"
    s1 = pool.acquire("c")
    queued_key = pool.resolve("c")  # resolved before the switch, admitted after it
    pool.make_current("c@2")
    assert pool.resolve("c") == "c@2"  # switched within the call
    s2 = pool.acquire("c")
    assert pool.slot_key(s1) == "c@1" and pool.slot_key(s2) == "c@2"
    assert pool.acquire(queued_key) == s1  # in-flight and queued requests keep the old version
    a, _, _ = dense_from_layout(pool, s1, 0, "q_proj")
    assert torch.equal(a, v1.modules[(0, "q_proj")].a)
    assert pool.registered() == ["c@2"]
    with pytest.raises(AdapterNotFoundError):
        pool.resolve("c@1")  # no new request can name it
    described = {d["key"]: d for d in pool.describe()}
    assert described["c@2"]["current"] and not described["c@1"]["current"]
    pool.release(s1)
    pool.release(s1)
    pool.check()
    # Idle now: the retired version is the first to go when memory is needed.
    for i, k in enumerate(("x@1", "y@1", "z@1")):
        pool.add(k, random_weights(10 + i))
        pool.load(k)
    assert pool.stats()["evictions"]["gpu"].get("version") == 1
    with pytest.raises(AdapterNotFoundError):
        pool.acquire(queued_key)
    pool.release(s2)
    pool.check()


def test_make_current_of_an_unknown_or_retired_key_is_refused(pool):
    pool.add("k@1", random_weights(1))
    pool.add("k@2", random_weights(2), make_current=False)
    with pytest.raises(AdapterNotFoundError):
        pool.make_current("k@3")
    with pytest.raises(AdapterNotFoundError):
        pool.make_current("nobody@1")
    pool.make_current("k@2")
    with pytest.raises(AdapterNotFoundError):
        pool.make_current("k@1")  # retired by the switch
    assert pool.resolve("k") == "k@2"
    pool.make_current("k@2")  # already current: no change
    assert pool.registered() == ["k@2"]
    pool.check()


def test_make_current_supersedes_a_version_still_loading(pool):
    pool.add("p@1", random_weights(1))
    pool.load("p@1")
    pool.add("p@2", random_weights(2), make_current=False)
    release = threading.Event()

    def slow():
        release.wait(10)
        return random_weights(3)

    pool.add("p@3", loader=slow)  # becomes current once resident
    pool.make_current("p@2")
    release.set()
    pool.wait_idle()
    assert pool.resolve("p") == "p@2" and pool.registered() == ["p@2"]
    pool.check()


def test_rollback_to_a_replaced_version(pool):
    v1, v2 = random_weights(1), random_weights(2)
    pool.add("r@1", v1)
    pool.load("r@1")
    pool.add("r@2", v2)
    pool.wait_idle()
    assert pool.resolve("r") == "r@2"
    pool.add("r@1", v1)  # roll back: the old version becomes current again once resident
    pool.wait_idle()
    assert pool.resolve("r") == "r@1"
    with pytest.raises(ValueError, match="different weights"):
        pool.add("r@1", random_weights(9))
    pool.check()


def test_failed_new_version_keeps_the_old_one_current(pool):
    pool.add("f@1", random_weights(1))
    pool.load("f@1")
    pool.add("f@2", loader=lambda: (_ for _ in ()).throw(OSError("corrupt safetensors header")))
    pool.wait_idle()
    assert pool.resolve("f") == "f@1"
    assert any(key == "f@2" for key, _ in pool.poll()) or pool.entry("f@2").error is not None
    pool.check()


def test_unregister_waits_for_in_flight_requests(pool):
    pool.add("u@1", random_weights(1))
    pool.load("u@1")
    slot = pool.acquire("u@1")
    pool.unregister("u")
    with pytest.raises(AdapterNotFoundError):
        pool.resolve("u")
    assert pool.layout.ranks[:, :, slot].sum() > 0  # still computing for the in-flight request
    assert not pool.page_pool.can_allocate(pool.page_pool.num_pages, "kv")  # in use: not reclaimed
    pool.release(slot)
    # Unused now: the KV cache asking for the whole pool reclaims its pages.
    assert pool.page_pool.can_allocate(pool.page_pool.num_pages, "kv")
    assert pool.layout.ranks[:, :, slot].sum() == 0
    assert pool.stats()["evictions"]["gpu"] == {"unregister": 1}
    pool.check()


def test_pinned_versions_replaced_by_hot_updates_give_their_slots_back():
    """Pinning holds the version being served: each hot update of a pinned adapter retires the old
    version, which then goes like any replaced version (first, once unused) instead of keeping its
    pages and slot forever."""
    pool = make_pool(num_pages=64, max_slots=3)
    try:
        for v in (1, 2, 3):
            pool.add(f"a@{v}", random_weights(v, rank=8), pinned=True)
            pool.wait_idle()
        assert pool.resolve("a") == "a@3" and pool.entry("a@3").pinned
        for key, seed in (("x@1", 9), ("y@1", 10)):  # unrelated adapters take the old versions' slots
            pool.add(key, random_weights(seed, rank=8))
            pool.load(key, timeout=5)
        assert sorted(pool.slot_key(s) for s in range(3)) == ["a@3", "x@1", "y@1"]
        assert pool.registered() == ["a@3", "x@1", "y@1"]
        assert pool.page_pool.num_used("adapter") == sum(len(pool.entry(k).page_ids) for k in pool.registered())
        assert pool.stats()["evictions"]["gpu"] == {"version": 2}
        pool.check()
    finally:
        pool.close()


def test_an_unregistered_pinned_adapter_is_freed_once_its_last_reference_goes():
    pool = make_pool(num_pages=64, max_slots=2)
    try:
        pool.add("a@1", random_weights(1, rank=8), pinned=True)
        slot = pool.load("a@1")
        assert pool.acquire("a@1") == slot  # a request in flight
        pool.unregister("a")
        assert pool.reclaim_for_kv(1) == 0  # still in use: kept for that request
        pool.release(slot)  # unused now, and no longer pinned: freed at once
        assert pool.slot_key(slot) is None and pool.page_pool.num_used("adapter") == 0
        assert pool.stats()["evictions"]["gpu"] == {"unregister": 1}
        pool.check()
    finally:
        pool.close()


def test_kv_cache_reclaims_idle_adapters_but_never_busy_or_pinned_ones():
    pool = make_pool(num_pages=60)
    pp = pool.page_pool
    for i, pinned in enumerate((True, False, False)):
        pool.add(f"k{i}@1", random_weights(i), pinned=pinned)
        pool.load(f"k{i}@1")
    busy = pool.acquire("k1@1")
    per = len(pool.entry("k2@1").page_ids)
    free = pp.num_free
    assert not pp.can_allocate(free + 2 * per, "kv")  # would need the busy or the pinned one: nothing evicted
    assert pool.entry("k2@1").resident
    assert pp.can_allocate(free + per, "kv")  # the idle one goes
    assert not pool.entry("k2@1").resident and pool.entry("k0@1").resident and pool.entry("k1@1").resident
    assert pool.stats()["evictions"]["gpu"] == {"kv": 1}
    pool.release(busy)
    pool.check()
    pool.close()


def test_tenant_quota_makes_a_tenant_evict_its_own_adapters(pool):
    pool.config.tenant_quotas["greedy"] = TenantQuota(max_adapters=2)
    pool.add("other@1", random_weights(0), tenant="polite")
    pool.load("other@1")
    for i in range(4):
        pool.add(f"g{i}@1", random_weights(10 + i), tenant="greedy")
        pool.load(f"g{i}@1")
        pool.check()
    assert pool.entry("other@1").resident
    assert sum(pool.entry(f"g{i}@1").resident for i in range(4)) == 2
    assert pool.stats()["evictions"]["gpu"] == {"quota": 2}


def test_tenant_byte_quota_refuses_an_adapter_larger_than_it(pool):
    pool.config.tenant_quotas["small"] = TenantQuota(max_bytes=10_000)
    pool.add("big@1", random_weights(0), tenant="small")
    assert pool.acquire("big@1", waiter=1) is None
    with pytest.raises(AdapterLoadError, match="quota"):
        pool.acquire("big@1", waiter=1)


def test_cpu_tier_byte_budget():
    one = make_pool()
    one.add("probe@1", random_weights(0))
    size = one.entry("probe@1").image.nbytes
    one.close()
    pool = make_pool(cpu_budget_bytes=2 * size)
    for i in range(5):
        pool.add(f"c{i}@1", loader=lambda i=i: random_weights(i))
        pool.prefetch(f"c{i}@1", tier="cpu")
        pool.wait_idle()
        assert pool.stats()["bytes"]["cpu"] <= 2 * size
    assert pool.stats()["resident"]["cpu"] == 2
    assert pool.stats()["evictions"]["cpu"] == {"budget": 3}
    pool.close()


def test_adapters_with_a_directory_are_re_read_from_it_not_kept_alive(tiny_llama_dir, tmp_path):
    """The CPU tier is what bounds adapter copies in memory (cpu_budget_bytes): the pool keeps no other
    copy of an adapter loaded from a directory. Once out of both tiers it is read and validated again
    from there; files rewritten meanwhile (even valid ones) fail the load instead of serving other
    weights under the old version."""
    import gc
    import json
    import weakref

    from lorafleet.worker.peft_adapter import load_peft_adapter
    from tests.lora_factory import make_peft_adapter

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    pool = make_pool(cpu_budget_bytes=0)
    try:
        refs = []
        for i in range(3):
            weights = load_peft_adapter(make_peft_adapter(tiny_llama_dir, tmp_path / f"a{i}", rank=8, seed=i), config)
            refs.append(weakref.ref(weights.modules[(0, "q_proj")].a))
            pool.add(f"a{i}@1", weights)
            del weights
        gc.collect()
        assert [i for i, r in enumerate(refs) if r() is not None] == []  # nothing else holds them
        slot = pool.load("a1@1")  # read again from tmp_path / "a1"
        expected = load_peft_adapter(tmp_path / "a1", config).modules[(0, "q_proj")]
        a, b, scale = dense_from_layout(pool, slot, 0, "q_proj")
        assert torch.equal(a, expected.a) and torch.equal(b, expected.b) and scale == pytest.approx(expected.scale)
        pool.evict("a1@1", "gpu")
        pool.evict("a1@1", "cpu")
        make_peft_adapter(tiny_llama_dir, tmp_path / "a1", rank=8, seed=99)  # other valid weights, same place
        with pytest.raises(AdapterLoadError, match="files changed after version"):
            pool.load("a1@1")  # never served under the version the old files were registered as
        (tmp_path / "a1" / "adapter_model.safetensors").write_bytes(b"truncated")
        with pytest.raises(AdapterLoadError, match="files changed after version"):
            pool.load("a1@1")
        pool.check()
    finally:
        pool.close()


def test_kv_cache_and_adapters_share_the_pool():
    pool = make_pool(num_pages=24)
    pp = pool.page_pool
    kv = pp.allocate(24, ("kv", 1))  # the KV cache took everything
    pool.add("k@1", random_weights(1))
    assert pool.acquire("k@1", waiter=1) is None
    pool.poll()
    assert pool.acquire("k@1", waiter=1) is None and not pool.can_load("k@1")
    pp.free(kv)
    pool.poll()
    pool.wait_idle()
    slot = pool.acquire("k@1", waiter=1)
    assert slot is not None
    assert not pp.can_allocate(24, "kv") and pp.num_used("adapter") == len(pool.entry("k@1").page_ids)
    pool.check()
    pool.close()


def test_metrics_are_exposed_through_a_registry(pool):
    pool.add("m@1", random_weights(1))
    pool.load("m@1")
    pool.release(pool.acquire("m@1"))
    registry = CollectorRegistry()
    for c in pool.metrics.collectors():
        registry.register(c)
    text = generate_latest(registry).decode()
    assert 'lorafleet_adapter_hits_total{tier="gpu"} 1.0' in text
    assert 'lorafleet_adapters_resident{tier="gpu"} 1.0' in text
    assert "lorafleet_adapter_load_seconds_bucket" in text
    assert "lorafleet_adapter_pool_fragmentation" in text
    desc = pool.describe()
    assert desc[0]["tier"] == "gpu" and desc[0]["hits"] == 1 and desc[0]["current"]


def test_packing_matches_the_kernels_packing_rule():
    from lorafleet.kernels.lora_layout import pack_lora_layout
    from lorafleet.worker.adapter_image import pack_adapter

    w = random_weights(5, rank=8, projs=("q_proj", "v_proj", "gate_proj", "down_proj"))
    image = pack_adapter(w.modules, TINY_DIMS, page_elems=PAGE_ELEMS, max_rank=8, dtype=torch.float32)
    ref = pack_lora_layout({(0, layer, PROJS.index(p)): (m.a, m.b, m.scale) for (layer, p), m in w.modules.items()},
                           num_layers=TINY_DIMS.num_layers, max_slots=1, page_elems=PAGE_ELEMS, dtype=torch.float32)
    assert torch.equal(image.pages.tensor(), ref.pool)
    a, b = image.global_offsets(list(range(image.num_pages)), PAGE_ELEMS)
    assert torch.equal(a, ref.a_offsets[:, :, 0]) and torch.equal(b, ref.b_offsets[:, :, 0])
    assert torch.equal(image.ranks, ref.ranks[:, :, 0]) and torch.allclose(image.scales, ref.scales[:, :, 0])


def test_a_load_that_never_returns_times_out_and_fails_only_its_waiters():
    pool = make_pool(load_timeout_s=0.05, num_load_threads=2)
    stuck = threading.Event()
    pool.add("stuck@1", loader=lambda: stuck.wait(60) and random_weights(1))
    pool.add("fine@1", random_weights(2))
    assert pool.acquire("stuck@1", waiter="a") is None
    pool.wait_idle()  # returns once the timeout failed the load
    with pytest.raises(AdapterLoadError, match="timed out"):
        pool.acquire("stuck@1", waiter="a")
    pool.load("fine@1")
    pool.check()
    stuck.set()  # the stuck thread finishes; its result is dropped
    pool.close()
    assert not pool.entry("stuck@1").resident


def _acquire_within(pool: AdapterPool, key: str, waiter: str, seconds: float) -> int | None:
    deadline = time.monotonic() + seconds
    while (slot := pool.acquire(key, waiter=waiter)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return slot


def test_one_tenants_hung_reads_keep_no_other_adapter_from_loading():
    """Two reads of tenant A hang (a stalled mount) and hold both loader threads. Tenant B's load, queued
    behind them, timed out without ever running ("download or disk too slow?"), and so did each retry. Once
    every thread is held past the time limit, loads go to fresh threads; the time limit counts from a
    thread taking the load. (Without spare threads: those let B's load run beside A's reads at once, as
    tests/worker/test_fair_loads.py checks; fresh threads are for when every spare is held too.)"""
    pool = make_pool(load_timeout_s=0.3, num_load_threads=2, spare_load_threads=0)
    hung = threading.Event()
    calls = []
    pool.add("a1@1", loader=lambda: hung.wait(30) and random_weights(1), tenant="A")
    pool.add("a2@1", loader=lambda: hung.wait(30) and random_weights(2), tenant="A")
    pool.add("b@1", loader=lambda: calls.append(1) or random_weights(3), tenant="B")
    try:
        for key in ("a1@1", "a2@1", "b@1"):
            assert pool.acquire(key, waiter=key) is None
        assert _acquire_within(pool, "b@1", "b@1", 5.0) is not None
        assert calls == [1]
        for key in ("a1@1", "a2@1"):
            with pytest.raises(AdapterLoadError, match="load timed out after 0.3 s"):
                pool.acquire(key, waiter=key)
        pool.check()
    finally:
        hung.set()
        pool.close()


def test_a_hung_read_of_a_dropped_version_still_counts_for_fresh_threads():
    """a1's read hangs and a1 is unregistered (its load cannot be cancelled once running), a2's read hangs
    too: both threads are held, b's load queued behind them must still run (it waited forever, never failing,
    as the dropped read was never counted as stuck)."""
    pool = make_pool(load_timeout_s=0.3, num_load_threads=2)
    hung = threading.Event()
    pool.add("a1@1", loader=lambda: hung.wait(30) and random_weights(1))
    pool.add("a2@1", loader=lambda: hung.wait(30) and random_weights(2))
    pool.add("b@1", loader=lambda: random_weights(3))
    try:
        assert pool.acquire("a1@1", waiter="x") is None and pool.acquire("a2@1", waiter="y") is None
        time.sleep(0.05)  # both reads running
        pool.unregister("a1")
        assert pool.acquire("b@1", waiter="b") is None
        assert _acquire_within(pool, "b@1", "b", 5.0) is not None
    finally:
        hung.set()
        pool.close()


def test_a_version_whose_read_hangs_is_not_read_again_until_that_read_returns():
    """Every retry of a read stuck on a hung mount held one more thread, for good (a pinned version is
    retried by itself): the next one fails at once, retryable, until the stuck one has come back."""
    pool = make_pool(load_timeout_s=0.2, num_load_threads=2)
    hung, reads = threading.Event(), []
    pool.add("p@1", loader=lambda: reads.append(1) or (hung.wait(30) and random_weights(1)))
    try:
        assert pool.acquire("p@1", waiter="1") is None
        with pytest.raises(AdapterLoadError, match="timed out"):
            _acquire_within(pool, "p@1", "1", 5.0)
        with pytest.raises(AdapterLoadError, match="its last read has not come back") as again:
            _acquire_within(pool, "p@1", "2", 5.0)
        assert again.value.retryable and reads == [1]
        hung.set()
        deadline = time.monotonic() + 5
        while pool.entry("p@1").hung is not None and not pool.entry("p@1").hung.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _acquire_within(pool, "p@1", "3", 5.0) is not None and reads == [1, 1]
    finally:
        hung.set()
        pool.close()


def test_registering_a_hung_version_again_from_elsewhere_reads_it_from_there():
    """The stuck read's block on reading again held a version for as long as its old mount hung, also once a
    push registered it again from another folder."""
    pool = make_pool(load_timeout_s=0.2, num_load_threads=2)
    hung = threading.Event()
    pool.add("p@1", loader=lambda: hung.wait(30) and random_weights(1))
    try:
        assert pool.acquire("p@1", waiter="1") is None
        with pytest.raises(AdapterLoadError, match="timed out"):
            _acquire_within(pool, "p@1", "1", 5.0)
        pool.add("p@1", loader=lambda: random_weights(1))  # the same version, its files moved
        assert _acquire_within(pool, "p@1", "2", 5.0) is not None
    finally:
        hung.set()
        pool.close()


def test_a_copy_on_a_cpu_device_is_not_queued_behind_hung_reads():
    pool = make_pool(load_timeout_s=30, num_load_threads=2)
    hung = threading.Event()
    pool.add("a1@1", loader=lambda: hung.wait(30) and random_weights(1))
    pool.add("a2@1", loader=lambda: hung.wait(30) and random_weights(2))
    pool.add("b@1", random_weights(3))  # in the CPU tier: only its copy is left
    try:
        assert pool.acquire("a1@1", waiter="x") is None and pool.acquire("a2@1", waiter="y") is None
        assert _acquire_within(pool, "b@1", "rb", 5.0) is not None
    finally:
        hung.set()
        pool.close()


@pytest.mark.gpu
def test_on_cuda_the_cpu_tier_is_pinned_and_copies_land_intact():
    from tests.lora_factory import dense_delta, lora_delta

    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=PAGE_ELEMS, device="cuda", dtype=torch.bfloat16))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=4, max_rank=32))
    weights = {k: random_weights(i, rank=r, dtype=torch.bfloat16, std=0.1) for i, (k, r) in
               enumerate((("g1@1", 16), ("g2@1", 4), ("g3@1", 32)))}
    for key, w in weights.items():
        pool.add(key, w)
        assert pool.entry(key).image.pages.is_pinned()
        assert pool.acquire(key, waiter=key) is None  # the copy runs on the side stream
    pool.wait_idle()
    slots = {key: pool.acquire(key, waiter=key) for key in weights}
    pool.check()
    order = ["g1@1", None, "g3@1", "g2@1", "g1@1", "g3@1"]
    token_slots = torch.tensor([slots[k] if k else -1 for k in order], device="cuda")
    x = torch.randn(len(order), TINY_DIMS.hidden_size, device="cuda").to(torch.bfloat16)
    got = lora_delta(pool.layout, token_slots, x, 1, "gate_proj", TINY_DIMS.intermediate_size)
    for t, k in enumerate(order):
        want = dense_delta(weights[k], x[t : t + 1].cpu(), 1, "gate_proj", TINY_DIMS.intermediate_size) if k else \
            torch.zeros(1, TINY_DIMS.intermediate_size, dtype=torch.bfloat16)
        torch.testing.assert_close(got[t : t + 1].cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    for slot in slots.values():
        pool.release(slot)
    pool.close()


@pytest.mark.gpu
def test_on_cuda_a_slot_is_taken_only_once_its_copy_on_the_side_stream_finished():
    """The CUDA side of the slot's gating (the test below is the CPU copy thread's): a copy waits for the compute
    stream's work queued before it (pages it reuses may still be read there), and the slot is handed out only once
    the copy's event says it is done. With the compute stream busy for about a second, every acquire meanwhile
    finds the copy in flight; once it lands, the slot serves the adapter's delta."""
    from tests.lora_factory import dense_delta, lora_delta

    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=PAGE_ELEMS, device="cuda", dtype=torch.bfloat16))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=4, max_rank=32))
    weights = random_weights(7, rank=8, dtype=torch.bfloat16, std=0.1)
    torch.cuda._sleep(3_000_000_000)  # cycles: the compute stream is busy for over a second
    pool.add("h@1", weights)
    assert pool.acquire("h@1", waiter=1) is None  # placed: its copy is queued behind the compute stream's work
    for _ in range(3):
        assert pool.acquire("h@1", waiter=1) is None, "the slot was handed out before its copy ran"
        assert pool.entry("h@1").copying is not None and not pool.entry("h@1").resident
    torch.cuda.synchronize()
    pool.wait_idle()
    slot = pool.acquire("h@1", waiter=1)
    assert slot is not None
    x = torch.randn(2, TINY_DIMS.hidden_size, device="cuda").to(torch.bfloat16)
    got = lora_delta(pool.layout, torch.tensor([slot, -1], device="cuda"), x, 1, "gate_proj",
                     TINY_DIMS.intermediate_size)
    want = dense_delta(weights, x[:1].cpu(), 1, "gate_proj", TINY_DIMS.intermediate_size)
    torch.testing.assert_close(got[:1].cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    assert int(got[1:].abs().sum()) == 0
    pool.release(slot)
    pool.close()


def test_a_slot_is_invisible_to_kernels_until_its_copy_finished():
    # The seed's pitfall: requests computing with half-loaded weights during a (hot) update.
    pool = make_pool(num_load_threads=1)
    gate = threading.Event()
    pool._copy_executor.submit(gate.wait, 30)  # the only copy thread is busy: the copy below waits its turn
    pool.add("h@1", random_weights(1))
    assert pool.acquire("h@1", waiter=1) is None
    entry = pool.entry("h@1")
    assert entry.slot is not None and entry.copying is not None and not entry.resident
    assert not entry.copying.future.done()  # held by the gate: the copy is really in flight
    assert int(pool.layout.ranks[:, :, entry.slot].abs().sum()) == 0  # kernels see "no adapter"
    pool.check()
    for _ in range(3):  # the loop's polls and asks while the copy is held: it stays invisible, nobody takes it
        pool.poll()
        assert pool.acquire("h@1", waiter=1) is None and not entry.resident
        assert int(pool.layout.ranks[:, :, entry.slot].abs().sum()) == 0
    gate.set()
    pool.wait_idle()
    assert pool.acquire("h@1", waiter=1) == entry.slot
    assert int(pool.layout.ranks[:, :, entry.slot].abs().sum()) > 0
    pool.close()


def _used_in_order(pool: AdapterPool, keys: tuple[str, ...]) -> None:
    """Load `keys` and serve one request on each, in this order (the last is the most recently used)."""
    for i, key in enumerate(keys):
        pool.add(key, random_weights(i))
        pool.load(key)
    for key in keys:
        pool.release(pool.acquire(key))


@pytest.mark.parametrize("order", [("zold@1", "amid@1", "mhot@1"), ("aold@1", "zmid@1", "bhot@1")])
def test_kv_pressure_evicts_the_least_recently_used_idle_adapter(order):
    """The seed's pitfall on its busiest path: the KV cache, not other adapters, takes most of the GPU pages
    back. A reclaim of one adapter's pages evicts the one idle longest (names in no order that would pass),
    and a lower priority before a higher one."""
    old, mid, hot = order
    pool = make_pool(max_slots=4)
    _used_in_order(pool, order)
    assert pool.reclaim_for_kv(len(pool.entry(old).page_ids)) > 0
    assert [pool.entry(k).resident for k in order] == [False, True, True]
    pool.close()

    pool = make_pool(max_slots=4)
    _used_in_order(pool, order)
    pool.set_priority(old, 1)  # used longest ago, but a higher priority: the next one goes
    assert pool.reclaim_for_kv(1) > 0
    assert [pool.entry(k).resident for k in order] == [True, False, True]
    pool.check()
    pool.close()


def test_the_cpu_tier_keeps_the_most_recently_used_images():
    """Over its budget, the CPU tier lets go of the image used longest ago: a hot adapter keeps its CPU copy (a
    warm reload in milliseconds), not the cold ones."""
    one = make_pool()
    one.add("probe@1", random_weights(0))
    size = one.entry("probe@1").image.nbytes
    one.close()
    pool = make_pool(max_slots=4, cpu_budget_bytes=2 * size)
    _used_in_order(pool, ("zold@1", "amid@1"))
    pool.add("new@1", random_weights(9))
    pool.load("new@1")
    assert [pool.entry(k).image is not None for k in ("zold@1", "amid@1", "new@1")] == [False, True, True]
    pool.check()
    pool.close()


def test_a_version_unregistered_while_its_copy_runs_is_counted_as_unregistered_and_dropped_once():
    pool = make_pool(num_load_threads=1)
    dropped = []
    pool.on_dropped = dropped.append
    gate = threading.Event()
    pool._copy_executor.submit(gate.wait, 30)  # the copy below waits its turn
    pool.add("h@1", random_weights(1))
    assert pool.acquire("h@1", waiter=1) is None
    assert pool.entry("h@1").copying is not None
    pool.abandon("h@1", 1)
    pool.unregister("h")
    gate.set()
    pool.wait_idle()
    evictions = pool.stats()["evictions"]
    assert evictions["cpu"] == {"unregister": 1} and evictions["gpu"] == {}  # never resident: no GPU eviction
    assert len(dropped) == 1 and pool.describe() == [] and len(pool._free_slots) == pool.config.max_slots
    pool.close()


def test_a_version_unregistered_while_in_use_is_dropped_once_its_last_request_ends():
    pool = make_pool()
    dropped = []
    pool.on_dropped = dropped.append
    pool.add("h@1", random_weights(1))
    pool.load("h@1")
    slot = pool.acquire("h@1", waiter=1)
    pool.unregister("h")
    assert dropped == []  # its request still runs on it
    pool.release(slot)
    assert len(dropped) == 1 and pool.describe() == [] and pool.stats()["evictions"]["gpu"] == {"unregister": 1}
    pool.close()


@pytest.mark.parametrize("said", ["CUDA error: out of memory", "cudaHostAlloc failed", "oom", "shapes disagree"])
def test_host_memory_short_while_packing_is_a_load_that_may_pass(said):
    """Page-locked host memory short (torch's allocator says "out of memory", or names the allocation) fails the
    waiting request as retryable; the next request's load succeeds. Another error while packing stays final."""
    pool = make_pool()
    pack, calls = pool._pack, []

    def short_once(weights):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(said) if said == "oom" else RuntimeError(said)
        return pack(weights)

    pool._pack = short_once
    pool.add("h@1", loader=lambda: random_weights(1))
    assert pool.acquire("h@1", waiter=1) is None
    pool.wait_idle()
    with pytest.raises(AdapterLoadError) as failed:
        pool.acquire("h@1", waiter=1)
    if said == "shapes disagree":
        assert not failed.value.retryable
        return pool.close()
    assert failed.value.retryable and "host memory" in str(failed.value)
    assert pool.acquire("h@1", waiter=2) is None
    pool.wait_idle()
    assert pool.acquire("h@1", waiter=2) is not None
    pool.close()
