"""AdapterPool: a replaced or unregistered version gives its GPU pages and slot back as soon as nothing
uses it (no reference, no copy in flight, no queued request it was loaded for), and registering the same
`name@version` again afterwards makes a fresh version (its new tenant, its new weights)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.adapter_entry import AdapterNotFoundError
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import dense_from_layout, make_pool


@pytest.fixture
def pool():
    p = make_pool()
    yield p
    p.close()


def gpu_held(pool) -> tuple[int, int]:
    """(adapter pages, slots) held on the GPU."""
    return pool.page_pool.num_used("adapter"), pool.config.max_slots - len(pool._free_slots)


def test_an_unregistered_version_in_use_is_dropped_when_its_last_reference_goes(pool):
    pool.add("sql@v1", random_weights(1), tenant="acme")
    slot = pool.load("sql@v1")
    assert pool.acquire("sql@v1") == slot  # a request in flight
    pool.unregister("sql")
    assert pool.slot_key(slot) == "sql@v1" and pool.layout.ranks[:, :, slot].sum() > 0  # it still computes
    pool.release(slot)  # the request finished
    assert pool.slot_key(slot) is None and gpu_held(pool) == (0, 0)
    assert int(pool.layout.ranks[:, :, slot].abs().sum()) == 0
    assert pool.stats()["resident"] == {"gpu": 0, "cpu": 0}
    assert pool.stats()["evictions"]["gpu"] == {"unregister": 1}
    pool.check()


@pytest.mark.parametrize("how", ["unregister", "remove", "new_version", "make_current"])
def test_an_idle_version_is_dropped_when_it_retires(pool, how):
    pool.add("m@1", random_weights(1))
    pool.add("m@2", random_weights(2), make_current=False)
    pool.load("m@1")
    pool.load("m@2")
    old = "m@2" if how == "remove" else "m@1"
    if how == "unregister":
        pool.unregister("m")
    elif how == "remove":
        pool.remove("m@2")
    elif how == "new_version":
        pool.add("m@3", random_weights(3))
        pool.wait_idle()
    else:
        pool.make_current("m@2")
    assert old not in pool._entries
    assert old not in {pool.slot_key(s) for s in range(pool.config.max_slots)}
    resident = [k for k in pool._entries if pool._entries[k].resident]
    assert gpu_held(pool)[1] == len(resident)
    assert pool.page_pool.num_used("adapter") == sum(len(pool._entries[k].page_ids) for k in resident)
    pool.check()


def test_a_retired_version_loaded_for_a_queued_request_waits_for_it_then_goes(pool):
    """Loaded for a queued request that has not picked it up yet: it stays for that request (abandoning
    it or taking it and finishing frees it)."""
    for waiter_takes_it in (True, False):
        pool.add("q@1", random_weights(1))
        assert pool.acquire("q@1", waiter="r1") is None
        pool.wait_idle()
        assert pool.entry("q@1").resident
        pool.unregister("q")
        assert pool._entries["q@1"].resident  # kept for r1
        if waiter_takes_it:
            slot = pool.acquire("q@1", waiter="r1")
            assert slot is not None and pool.slot_key(slot) == "q@1"
            pool.release(slot)
        else:
            pool.abandon("q@1", "r1")
        assert "q@1" not in pool._entries and gpu_held(pool) == (0, 0)
        with pytest.raises(AdapterNotFoundError):
            pool.acquire("q@1", waiter="r1")
        pool.check()


def test_registering_a_dropped_version_again_makes_a_fresh_one(pool):
    """sql@v1 (acme's weights) is unloaded while a request uses it; later sql@v1 is pushed again for
    globex from other files: it is registered, with globex as its tenant, and serves the new weights."""
    alpha, beta = random_weights(1), random_weights(2)
    pool.add("sql@v1", alpha, tenant="acme")
    slot = pool.load("sql@v1")
    assert pool.acquire("sql@v1") == slot
    pool.unregister("sql")
    pool.release(slot)
    pool.add("sql@v1", beta, tenant="globex")
    assert pool.resolve("sql") == "sql@v1" and pool.entry("sql@v1").tenant == "globex"
    slot = pool.load("sql@v1")
    a, b, _ = dense_from_layout(pool, slot, 0, "q_proj")
    assert torch.equal(a, beta.modules[(0, "q_proj")].a) and torch.equal(b, beta.modules[(0, "q_proj")].b)
    pool.check()


def test_registering_a_version_still_in_use_again(pool):
    """Re-registered while a request still holds it: the same weights bring it back (for its new tenant),
    other weights are refused until that request finished."""
    weights = random_weights(1)
    pool.add("sql@v1", weights, tenant="acme")
    slot = pool.load("sql@v1")
    assert pool.acquire("sql@v1") == slot
    pool.unregister("sql")
    with pytest.raises(ValueError, match="still in use.*requests in flight"):
        pool.add("sql@v1", random_weights(2), tenant="globex")
    pool.add("sql@v1", weights, tenant="globex")
    assert pool.resolve("sql") == "sql@v1" and pool.entry("sql@v1").tenant == "globex"
    assert pool.acquire("sql") == slot  # the same copy, no reload
    pool.release(slot)
    pool.release(slot)
    assert pool.entry("sql@v1").resident  # registered again: kept like any idle adapter
    pool.check()


def test_a_replaced_version_given_back_to_be_taken_again_can_leave_the_gpu_and_is_read_again():
    """A request runs on x@1 when x@2 replaces it, then gives x@1 back to take it again (detached). x@1 is no
    longer named by anyone else, may leave the GPU for others, and is read again for that request alone; it
    goes when the request finishes on it."""
    pool = make_pool(max_slots=2)
    try:
        w1 = random_weights(1, name="x", version="1")
        pool.add("x@1", w1)
        pool.load("x@1")
        slot = pool.acquire("x@1", "r")
        pool.add("x@2", random_weights(2, name="x", version="2"))
        pool.load("x@2")
        assert pool.resolve("x") == "x@2" and pool.registered() == ["x@2"]
        with pytest.raises(AdapterNotFoundError):
            pool.resolve("x@1")
        pool.release(slot, detach="r")
        pool.add("y@1", random_weights(3))
        pool.load("y@1")  # two slots: the replaced version makes room
        assert not pool.entry("x@1").on_gpu and pool.registered() == ["x@2", "y@1"]
        described = {d["key"]: d for d in pool.describe()}  # reported (its files stay) as replaced, with its holder
        assert described["x@1"]["retired"] and described["x@1"]["holders"] == 1 and described["x@1"]["tier"] == "cpu"
        pool.release(pool.acquire("y@1"))
        assert pool.acquire("x@1", "r") is None  # read again, for the request that ran on it
        pool.wait_idle()
        slot = pool.acquire("x@1", "r")
        assert slot is not None and pool.slot_key(slot) == "x@1"
        a, b, _ = dense_from_layout(pool, slot, 0, "q_proj")
        assert torch.equal(a, w1.modules[(0, "q_proj")].a) and torch.equal(b, w1.modules[(0, "q_proj")].b)
        pool.release(slot)  # it finished on it: gone
        assert "x@1" not in pool._entries and pool.slot_key(slot) is None
        pool.check()
    finally:
        pool.close()


def test_a_retired_version_in_use_retired_again_then_registered_again_is_current_and_stays(pool):
    """x@1 is loaded for a waiter W that a push then left it to (retired, kept for W), W takes it, the name is
    unregistered (x@1 retired again) and the same weights registered again (a quick rollback): x@1 is current
    and stays once W is done. The second retirement marked it replaced for good: the current version went when
    W finished, and every request for `x` failed until the next push."""
    weights = random_weights(1, name="x", version="1")
    pool.add("x@1", weights)
    assert pool.acquire("x@1", "W") is None
    pool.wait_idle()
    pool.add("x@2", random_weights(2, name="x", version="2"))
    pool.wait_idle()
    slot = pool.acquire("x@1", "W")
    pool.unregister("x")
    pool.add("x@1", weights)
    assert pool.resolve("x") == "x@1" and pool.resolve("x@1") == "x@1" and pool.registered() == ["x@1"]
    pool.check()
    pool.release(slot)
    assert pool.acquire(pool.resolve("x"), "new") == slot
    pool.check()
