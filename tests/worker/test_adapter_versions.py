"""AdapterPool versions (worker/adapter_versions.py): stable and canary swapped in one push. The current
version registered again as the canary of the version loading to replace it stays registered (and on the
GPU) once that one switches; only that registration keeps it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from lorafleet.worker.adapter_pool import AdapterPool
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import make_pool


def gated(seed: int, fails: bool = False) -> tuple[threading.Event, Callable[[], object]]:
    """(gate, loader): the loader returns an adapter (or raises, `fails`) once the gate is set."""
    gate = threading.Event()

    def loader():
        gate.wait(10)
        if fails:
            raise OSError("adapter_model.safetensors: truncated")
        return random_weights(seed)

    return gate, loader


def swap_loading(pool: AdapterPool, fails: bool = False) -> threading.Event:
    """a@1 current and resident, a@2 its canary never loaded; then swapped: a@2 registered as current (its
    load held at the gate returned), a@1 again as the canary."""
    pool.add("a@1", random_weights(1))
    pool.load("a@1")
    gate, loader = gated(2, fails)
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
        assert pool.resolve("a") == "a@2" and pool.registered() == ["a@1", "a@2"]
        assert pool.acquire("a@1") == slot  # the canary share needs no reload
        described = {d["key"]: d for d in pool.describe()}
        assert described["a@2"]["current"] and not described["a@1"]["current"]
        pool.release(slot)
        pool.release(slot)
        pool.check()
    finally:
        gate.set()
        pool.close()


def test_a_swap_whose_new_stable_version_fails_to_load_leaves_the_old_one_current():
    pool = make_pool()
    gate = swap_loading(pool, fails=True)
    try:
        gate.set()
        pool.wait_idle()
        assert pool.resolve("a") == "a@1" and pool.registered() == ["a@1", "a@2"]
        pool.check()
    finally:
        pool.close()


@pytest.mark.parametrize("how", ["failed_load", "replaced", "make_current"])
def test_only_the_swap_keeps_the_old_version_a_later_switch_retires_it(how):
    """The canary registration keeps the current version for the switch to the version loading then; one that
    failed, was replaced by another, or a switch made at once (`make_current`) retires it as usual."""
    pool = make_pool()
    gate = swap_loading(pool, fails=how == "failed_load")
    try:
        if how == "failed_load":
            gate.set()
            pool.wait_idle()
        if how == "make_current":
            pool.make_current("a@2")
            assert pool.registered() == ["a@2"]
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
