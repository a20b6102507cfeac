"""AdapterPool versions (worker/adapter_versions.py): stable and canary swapped in one push. The current
version registered again as the canary of the version loading to replace it stays registered (and on the
GPU) once that one switches; only that registration keeps it. A new version whose load failed for now
(a retryable failure) still replaces the current one once a retry loads it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.adapter_pool import AdapterPool
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import make_pool

READ_ERROR = OSError("adapter_model.safetensors: read error")  # may pass: a retryable failure
BAD_FILE = ValueError("adapter_model.safetensors: not a safetensors file")  # cannot pass by itself


def gated(seed: int, error: Exception | None = None) -> tuple[threading.Event, Callable[[], object]]:
    """(gate, loader): the loader returns an adapter (or raises `error`) once the gate is set."""
    gate = threading.Event()

    def loader():
        gate.wait(10)
        if error is not None:
            raise error
        return random_weights(seed)

    return gate, loader


def swap_loading(pool: AdapterPool, error: Exception | None = None) -> threading.Event:
    """a@1 current and resident, a@2 its canary never loaded; then swapped: a@2 registered as current (its
    load held at the gate returned), a@1 again as the canary."""
    pool.add("a@1", random_weights(1))
    pool.load("a@1")
    gate, loader = gated(2, error)
    pool.add("a@2", loader=loader, make_current=False)
    pool.add("a@2", loader=loader)
    pool.add("a@1", random_weights(1), make_current=False)
    return gate


def test_the_old_stable_version_stays_registered_and_resident_as_the_canary_of_the_version_it_swapped_with():
    pool = make_pool()
    gate = swap_loading(pool)
    try:
        assert pool.resolve("a") == "a@1"  # current until a@2 is resident
        slot = pool.acquire("a")
        gate.set()
        pool.wait_idle()
        assert pool.resolve("a") == "a@2" and sorted(pool.registered()) == ["a@1", "a@2"]
        assert pool.acquire("a@1") == slot  # the canary share needs no reload
        described = {d["key"]: d for d in pool.describe()}
        assert described["a@2"]["current"] and not described["a@1"]["current"]
        pool.release(slot)
        pool.release(slot)
        pool.check()
    finally:
        gate.set()
        pool.close()


@pytest.mark.parametrize("error", [READ_ERROR, BAD_FILE], ids=["retryable", "not_retryable"])
def test_a_swap_whose_new_stable_version_fails_to_load_leaves_the_old_one_current(error):
    pool = make_pool()
    gate = swap_loading(pool, error)
    try:
        gate.set()
        pool.wait_idle()
        assert pool.resolve("a") == "a@1" and pool.registered() == ["a@1", "a@2"]
        pool.check()
    finally:
        pool.close()


@pytest.mark.parametrize("how", ["failed_load", "replaced", "make_current", "registered_again"])
def test_only_the_swap_keeps_the_old_version_a_later_switch_retires_it(how):
    """The canary registration keeps the current version for the switch to the version loading then; one that
    failed (for good), was replaced by another, or a switch made at once (`make_current`) retires it as usual;
    so does the switch to the version loading if it was registered again as current after that registration."""
    pool = make_pool()
    gate = swap_loading(pool, BAD_FILE if how == "failed_load" else None)
    try:
        if how == "failed_load":
            gate.set()
            pool.wait_idle()
        if how == "make_current":
            pool.make_current("a@2")
            assert pool.registered() == ["a@2"]
        elif how == "registered_again":  # a push that no longer names a@1 as the canary
            pool.add("a@2", random_weights(2))
            gate.set()
            pool.load("a@2")
            assert pool.resolve("a") == "a@2" and pool.registered() == ["a@2"]
        else:
            pool.add("a@3", random_weights(3))  # a new stable version, no canary
            gate.set()  # the one loader thread is free again
            pool.load("a@3")
            assert pool.resolve("a") == "a@3"
            assert pool.registered() == (["a@2", "a@3"] if how == "failed_load" else ["a@3"])
        pool.check()
    finally:
        gate.set()
        pool.close()


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("retryable", [True, False])
def test_a_new_version_whose_load_failed_for_now_becomes_current_once_a_retry_loads_it(swap, retryable):
    """After a failure that may pass (a read error, a timeout), the new version still replaces the current one
    once a later load succeeds (keeping the old one if it is its canary); after one that cannot pass by itself,
    the current one stays current even if the version loads later (it must be registered again)."""
    pool = make_pool()
    broken = {"on": True}

    def loader():
        if broken["on"]:
            raise READ_ERROR if retryable else BAD_FILE
        return random_weights(2)

    try:
        pool.add("a@1", random_weights(1))
        pool.load("a@1")
        pool.add("a@2", loader=loader)
        if swap:
            pool.add("a@1", random_weights(1), make_current=False)
        assert pool.acquire("a@2", waiter="r1") is None
        pool.wait_idle()
        with pytest.raises(AdapterLoadError) as exc:
            pool.acquire("a@2", waiter="r1")
        assert exc.value.retryable == retryable and pool.resolve("a") == "a@1"
        broken["on"] = False
        assert pool.acquire("a@2", waiter="r2") is None
        pool.wait_idle()
        pool.release(pool.acquire("a@2", waiter="r2"))
        assert pool.resolve("a") == ("a@2" if retryable else "a@1")
        assert pool.registered() == (["a@2"] if retryable and not swap else ["a@1", "a@2"])
        pool.check()
    finally:
        pool.close()


@pytest.mark.parametrize("resident", [True, False])
def test_make_current_if_resident_switches_now_only_a_version_on_the_gpu(resident):
    """a@1 current, a@2 its canary (resident or only in CPU memory): make_current(if_resident) switches to a
    resident a@2 at once; else a@1 keeps serving, and a@1 registered again as the canary (a swap) stays
    registered once a@2 has loaded and switched."""
    pool = make_pool()
    try:
        pool.add("a@1", random_weights(1))
        pool.load("a@1")
        pool.add("a@2", random_weights(2), make_current=False)
        if resident:
            pool.load("a@2")
        copier = threading.Event()  # a@2's copy waits behind this: it lands only once a@1 came back
        pool._copy_executor.submit(copier.wait, 10)
        assert pool.make_current("a@2", if_resident=True) is resident
        assert pool.resolve("a") == ("a@2" if resident else "a@1")
        pool.add("a@1", random_weights(1), make_current=False)  # back as the canary
        copier.set()
        pool.wait_idle()
        assert pool.resolve("a") == "a@2" and sorted(pool.registered()) == ["a@1", "a@2"]
        pool.check()
    finally:
        pool.close()
