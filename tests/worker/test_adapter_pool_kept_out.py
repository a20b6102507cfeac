"""AdapterPool: versions kept off the GPU by pinned adapters. A caller with no request behind it (load(),
the admin path, and an acquire without a waiter) is refused as a request is when its owner's pinned
adapters fill its GPU quota with slots free, rather than waiting out its timeout or hearing None for
ever; and a pinned version's successor that arrives while the old version's copy is still in flight,
every slot pinned, waits for it to land and then takes its slot."""

from __future__ import annotations

import threading
import time

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.adapter_pool_config import TenantQuota
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import make_pool

QUOTA_MSG = "tenant 'beta' is at its GPU quota, held by its pinned"


def beta_kept_out():
    """3 slots, beta's quota 1 adapter held by the pinned chat@c1; sql@v1 (beta) in CPU memory."""
    pool = make_pool(max_slots=3, tenant_quotas={"beta": TenantQuota(max_adapters=1)})
    pool.add("chat@c1", random_weights(0), tenant="beta", pinned=True)
    pool.add("sql@v1", random_weights(1), tenant="beta")
    pool.wait_idle()
    assert pool.pinned_slot_keys() is None  # a slot is free
    return pool


def test_load_of_a_version_its_owner_s_pinned_adapters_keep_out_fails_at_once_and_it_stays_wanted():
    pool = beta_kept_out()
    try:
        t0 = time.monotonic()
        with pytest.raises(AdapterLoadError, match=QUOTA_MSG) as exc:
            pool.load("sql@v1", timeout=60.0)
        assert exc.value.retryable and time.monotonic() - t0 < 30.0  # refused, not timed out
        assert pool.has_pending_loads()  # still wanted: placed once there is room
        pool.unpin("chat@c1")
        pool.wait_idle()
        assert pool.entry("sql@v1").resident
        pool.check()
    finally:
        pool.close()


def test_an_acquire_without_a_waiter_is_refused_as_a_request_is():
    pool = beta_kept_out()
    try:
        assert pool.acquire("sql@v1") is None
        pool.poll()
        with pytest.raises(AdapterLoadError, match=QUOTA_MSG) as exc:
            pool.acquire("sql@v1")
        assert exc.value.retryable and pool.has_pending_loads()
        pool.check()
    finally:
        pool.close()


def test_a_successor_arriving_while_its_pinned_predecessor_copies_is_placed_once_it_lands():
    """2 slots: aaa@9 pinned and resident; sql@v1 pinned, its copy in flight, when sql@v2 (pinned) replaces it.
    Every slot is pinned then; v1 is not resident yet, so it cannot give way, and v2 fails. Once v1 lands,
    v2 should take its slot by itself (as when v1 was resident from the start), without any request."""
    pool = make_pool(max_slots=2)
    try:
        pool.add("aaa@9", random_weights(9), pinned=True)
        pool.wait_idle()
        with pool._lock:  # the engine thread has not finished v1's copy when the push registers v2
            pool.add("sql@v1", random_weights(1), pinned=True)
            v1 = pool.entry("sql@v1")
            assert v1.on_gpu and not v1.resident
            assert pool.pinned_slot_keys() == ["aaa@9", "sql@v1"]
            pool.add("sql@v2", random_weights(2), pinned=True)
        pool.wait_idle()
        pool.poll()
        v2 = pool.entry("sql@v2")
        state = (pool.resolve("sql"), v2.resident, "sql@v2" in pool._wanted, v2.error and v2.error.reason)
        assert pool.resolve("sql") == "sql@v2", state
        assert sorted(pool.pinned_slot_keys()) == ["aaa@9", "sql@v2"]
        pool.check()
    finally:
        pool.close()


def test_load_hears_a_failure_another_caller_without_a_waiter_was_told_first():
    """load() waits on a fetch that fails for good; an acquire without a waiter looks first and is told.
    load() still raises it, rather than waiting out its timeout."""
    pool = make_pool()
    gate, waiting, out = threading.Event(), threading.Event(), {}

    def loader():
        gate.wait(10)
        raise ValueError("corrupt safetensors header")

    def run_load():
        try:
            pool.load("bad@1", timeout=60.0)
            out["r"] = "slot"
        except Exception as exc:  # noqa: BLE001 - the test reads which
            out["r"] = exc

    wait_some = pool._wait_some
    pool._wait_some = lambda seconds: (waiting.set(), wait_some(seconds))[1]
    pool.add("bad@1", loader=loader)
    try:
        assert pool.acquire("bad@1") is None  # starts the load (held in the loader)
        t = threading.Thread(target=run_load)
        t.start()
        assert waiting.wait(10)  # load() polls
        with pool._lock:
            gate.set()
            pool.entry("bad@1").fetching.exception(timeout=10)  # failed; nobody has finished it yet
            with pytest.raises(AdapterLoadError, match="corrupt"):
                pool.acquire("bad@1")  # told first
        t.join(30)
        assert isinstance(out["r"], AdapterLoadError), out
    finally:
        pool.close()


def test_nobody_asking_is_nobody_refused():
    """A load() of an adapter on the GPU asks for nothing: a later prefetch of it (nobody waiting) that its
    owner's pinned adapters keep out is not refused, and the next acquire without a waiter is not told so."""
    pool = make_pool(max_slots=3, tenant_quotas={"beta": TenantQuota(max_adapters=1)})
    try:
        pool.add("sql@v1", random_weights(1), tenant="beta")
        pool.load("sql@v1")
        pool.load("sql@v1")  # resident already
        pool.evict("sql@v1")
        pool.add("chat@c1", random_weights(0), tenant="beta", pinned=True)
        pool.wait_idle()
        before = pool.stats()["load_failures"]
        pool.prefetch("sql@v1", "gpu")
        pool.poll()
        assert pool.stats()["load_failures"] == before and pool.entry("sql@v1").error is None
        assert pool.acquire("sql@v1") is None  # asks now: refused at its next look
        pool.poll()
        with pytest.raises(AdapterLoadError, match=QUOTA_MSG):
            pool.acquire("sql@v1")
    finally:
        pool.close()


def test_the_state_report_knows_a_successor_waits_for_its_predecessor_s_copy():
    """The admin state marks a version kept out by pinned slots unless replaces_pinned(key): while the
    pinned predecessor still copies, its successor takes the slot once it lands, and is not so marked."""
    pool = make_pool(max_slots=2)
    try:
        pool.add("aaa@9", random_weights(9), pinned=True)
        pool.wait_idle()
        with pool._lock:
            pool.add("sql@v1", random_weights(1), pinned=True)
            pool.add("sql@v2", random_weights(2), pinned=True)
            assert not pool.entry("sql@v1").resident and "sql@v2" in pool._wanted
            assert pool.replaces_pinned("sql@v2")
    finally:
        pool.close()


def _beta_gated():
    """beta's quota 1, held by the pinned chat@c1; sql@v1 (beta) loads through a loader held by a gate."""
    pool = make_pool(max_slots=3, tenant_quotas={"beta": TenantQuota(max_adapters=1)})
    pool.add("chat@c1", random_weights(0), tenant="beta", pinned=True)
    pool.wait_idle()
    gate = threading.Event()
    pool.add("sql@v1", loader=lambda: (gate.wait(10), random_weights(1))[1], tenant="beta")
    return pool, gate


def _load_in_thread(pool, out: dict, polls: list) -> threading.Thread:
    """pool.load("sql@v1") on a thread, started and polling when this returns; `polls` counts its looks."""
    wait_some = pool._wait_some
    pool._wait_some = lambda seconds: (polls.append(1), wait_some(seconds))[1]

    def run():
        try:
            out["r"] = pool.load("sql@v1", timeout=60.0)
        except Exception as exc:  # noqa: BLE001 - the test reads which
            out["r"] = exc

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while not polls and time.monotonic() < deadline:
        time.sleep(0.001)
    return t


def _refused_to_another_caller_first(pool, gate) -> None:
    with pool._lock:
        gate.set()
        pool.entry("sql@v1").fetching.result(timeout=10)
        with pytest.raises(AdapterLoadError, match=QUOTA_MSG):
            pool.acquire("sql@v1")  # an acquire without a waiter is told the refusal first


def test_load_hears_a_refusal_another_caller_was_told_first():
    pool, gate = _beta_gated()
    out, polls = {}, []
    try:
        t = _load_in_thread(pool, out, polls)
        _refused_to_another_caller_first(pool, gate)
        t.join(30)
        assert isinstance(out.get("r"), AdapterLoadError) and QUOTA_MSG in str(out["r"]), out
    finally:
        pool.close()


def test_load_waits_for_a_copy_that_began_after_its_refusal():
    """Refused (told first to another caller), then room is made and the copy to the GPU begins: load()
    waits for the copy and returns the slot, rather than raising the refusal that is over."""
    pool, gate = _beta_gated()
    out, polls = {}, []
    try:
        t = _load_in_thread(pool, out, polls)
        landed = threading.Event()
        is_done = pool._copier.is_done
        pool._copier.is_done = lambda handle: landed.is_set() and is_done(handle)  # the copy takes a while
        with pool._lock:
            _refused_to_another_caller_first(pool, gate)
            pool.unpin("chat@c1")
            pool.evict("chat@c1")  # room in beta's quota
            pool.poll()
            assert pool.entry("sql@v1").copying is not None
            looked = len(polls)
        deadline = time.monotonic() + 10
        while len(polls) < looked + 2 and time.monotonic() < deadline:  # load() looks while the copy runs
            time.sleep(0.001)
        landed.set()
        t.join(30)
        assert out.get("r") == pool.entry("sql@v1").slot is not None, out
    finally:
        pool.close()
