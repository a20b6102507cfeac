"""Rollbacks and rollouts through ServedAdapters in front of the engine's real AdapterPool (no model): a
rollback to the version a finished rollout retired, a pinned adapter rolled out while every GPU slot is
pinned, a version whose load failed once and then succeeded, and a version handed to another tenant (swaps:
test_served_swap_pool.py)."""

from __future__ import annotations

import contextlib

import pytest

from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.served_adapters import ServedAdapters
from tests.worker.test_adapter_pool import make_pool
from tests.worker.test_served_adapters import ACME, state
from tests.worker.test_served_pool import V1, V2, V3, GatedEngine, PackingEngine, gated_engine, sql

USERS = [f"user-{i}" for i in range(20)]


@pytest.fixture
def engine():
    yield from gated_engine()


def served_keys(served: ServedAdapters) -> set[str]:
    """What the table resolves bare `sql` requests of 20 users to (raises for a version that failed)."""
    return {served.resolve("sql", ACME, user) for user in USERS}


@pytest.mark.parametrize("canary", [None, V3], ids=["alone", "with_canary"])
def test_rolling_back_to_the_version_a_finished_rollout_retired_serves_it_again(engine, canary):
    """{v1}, {v2} (v2 loads: the pool retires v1, the table still lists it as the fallback), then {v1} again: v1
    was taken as still registered, its pin/priority calls failed ("not registered") and every request got 503
    until the operator's next retry."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    served.apply(state(1, sql(V1)), host)
    engine.load("sql@v1")
    served.apply(state(2, sql(V2)), host)
    engine.load("sql@v2")
    assert pool.resolve("sql") == "sql@v2" and "sql@v1" not in pool.registered()
    served.apply(state(3, sql(V1, canary)), host)
    assert served.get("sql").errors == {}
    engine.load("sql@v1")
    assert pool.resolve("sql") == "sql@v1"
    assert served_keys(served) <= {"sql@v1", "sql@v3"} and "sql@v1" in served_keys(served)
    pool.check()


AAA = {"name": "aaa", "tenant": "acme", "stable": {"version": "v9", "uri": "/c/aaa/v9"}, "warm": False, "pinned": True}


@contextlib.contextmanager
def every_slot_pinned():
    """Two GPU slots, both pinned: aaa@v9 and sql@v1 (the pool, the table, the engine facade)."""
    engine = PackingEngine(make_pool(max_slots=2, num_load_threads=2))
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    try:
        served.apply(state(1, AAA, sql(V1, pinned=True)), host)
        pool.wait_idle()
        assert sorted(pool.pinned_slot_keys()) == ["aaa@v9", "sql@v1"]
        yield pool, served, host
        pool.check()
    finally:
        pool.close()


def test_a_pinned_adapter_rolled_out_while_every_slot_is_pinned_takes_its_old_version_s_slot():
    """Both slots pinned (aaa, sql@v1), then {sql: v2 pinned}: v1 held its slot until v2 was resident, and v2
    could never be placed (every slot pinned): every sql request got 503 for good while v1 could serve."""
    with every_slot_pinned() as (pool, served, host):
        served.apply(state(2, AAA, sql(V2, pinned=True)), host)
        pool.load("sql@v2", timeout=10)
        assert pool.resolve("sql") == "sql@v2" and "sql@v1" not in pool.registered()
        assert sorted(pool.pinned_slot_keys()) == ["aaa@v9", "sql@v2"]
        assert served_keys(served) == {"sql@v2"}


def test_a_pinned_rollout_while_the_old_version_is_in_use_switches_once_it_is_released():
    """As above, with a request running on v1 when v2 is pushed: v1 serves on, and v2 takes its slot once the
    request has released it (no request asks for v2 until then: the pool places it by itself)."""
    with every_slot_pinned() as (pool, served, host):
        slot = pool.acquire("sql@v1", waiter="r1")
        served.apply(state(2, AAA, sql(V2, pinned=True)), host)
        pool.wait_idle()
        assert pool.resolve("sql") == "sql@v1"  # in use: it keeps its slot meanwhile
        # ...which v2 is about to take: its state report does not say it is stuck behind pinned slots.
        assert pool.replaces_pinned("sql@v2") and not pool.replaces_pinned("aaa@v9")
        pool.release(slot)
        pool.wait_idle()
        assert pool.resolve("sql") == "sql@v2" and "sql@v1" not in pool.registered()


class ProbingAdapters(EngineAdapters):
    """Records, as the push registers the old stable version again as the canary, whether the pool still had it
    registered (the table published until the push ends sends most users to it)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.old_registered: list[bool] = []

    def register_adapter(self, name, source, *, make_current=True, **kw):
        if not make_current:
            self.old_registered.append(f"{name}@{kw['version']}" in self.pool.registered())
        return super().register_adapter(name, source, make_current=make_current, **kw)


def test_a_swap_to_a_resident_canary_keeps_the_old_stable_version_registered_and_on_the_gpu(engine):
    """{v1, canary v2}, both on the GPU, then {v2, canary v1}: the switch to v2 retired v1 before the new table
    was published (explicit sql@v1 requests got 404, bare ones waited) and v1 was read again from its files,
    into CPU memory only."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), ProbingAdapters(engine)
    served.apply(state(1, sql(V1, V2)), host)
    engine.load("sql@v1")
    engine.load("sql@v2")
    host.old_registered.clear()
    served.apply(state(2, sql(V2, V1)), host)
    assert host.old_registered == [True]
    assert pool.resolve("sql") == "sql@v2" and pool.resolve("sql@v1") == "sql@v1"
    assert {d["key"]: d["tier"] for d in pool.describe()}["sql@v1"] == "gpu"
    assert served.get("sql").split.stable == "v2" and served.get("sql").split.canary == "v1"
    served.apply(state(3, sql(V2)), host)  # the canary dropped: retired now
    assert pool.registered() == ["sql@v2"]
    pool.check()


def test_loading_a_canary_that_evicts_the_stable_version_does_not_make_it_current():
    """One slot: the canary v2's load evicts the stable v1 (idle, not pinned). v2 became current and v1 was
    dropped, while the table still sent most users to v1 (404 until the next push)."""
    engine = GatedEngine(make_pool(max_slots=1, num_load_threads=2))
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    try:
        served.apply(state(1, sql(V1, V2)), host)
        engine.load("sql@v1")
        engine.load("sql@v2")
        assert pool.resolve("sql") == "sql@v1" and sorted(pool.registered()) == ["sql@v1", "sql@v2"]
        pool.check()
    finally:
        for gate in list(engine.gates.values()):
            gate.set()
        pool.close()


def test_rolling_back_to_a_retired_version_a_request_still_holds_serves_it(engine):
    """{v1}, {v2} loaded while a request runs on v1 (retired, still held), then {v1}: v1 was taken as registered
    (the engine still listed it), its pin call failed and every request got 503 until the next push."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    served.apply(state(1, sql(V1)), host)
    engine.load("sql@v1")
    slot = pool.acquire("sql@v1", waiter="long")
    served.apply(state(2, sql(V2)), host)
    engine.load("sql@v2")
    served.apply(state(3, sql(V1)), host)
    assert served.get("sql").errors == {} and served_keys(served) == {"sql@v1"}
    pool.release(slot)
    pool.load("sql@v1")
    assert pool.resolve("sql") == "sql@v1"
    pool.check()


def test_a_version_handed_to_another_tenant_is_charged_to_that_tenant_within_its_quota():
    """{sql v1, acme}, then the same version for globex, whose quota (1 adapter) its chat@1 already fills: access
    followed globex, but the pool kept charging acme's quota for sql@v1 (and reported acme as its owner)."""
    from lorafleet.worker.adapter_pool_config import TenantQuota
    from lorafleet.worker.tenants import Tenant
    from tests.lora_factory import random_weights

    engine = GatedEngine(make_pool(max_slots=4, num_load_threads=2, tenant_quotas={"globex": TenantQuota(max_adapters=1)}))
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    try:
        pool.add("chat@1", random_weights(7), tenant="globex")
        pool.load("chat@1")
        served.apply(state(1, sql(V1)), host)
        engine.load("sql@v1")
        served.apply(state(2, sql(V1, tenant="globex")), host)
        assert served.get("sql").tenant == "globex" and pool.entry("sql@v1").tenant == "globex"
        pool.check()  # globex holds one adapter on the GPU at most
        assert pool.resolve("sql") == "sql@v1" and served.resolve("sql", Tenant("globex"), None) == "sql@v1"
        pool.load("sql@v1")  # a request's load: within globex's quota, its chat@1 makes room
        assert {d["key"]: d["tier"] for d in pool.describe()}["sql@v1"] == "gpu"
        pool.check()
    finally:
        for gate in list(engine.gates.values()):
            gate.set()
        pool.close()


def test_a_swap_that_also_changes_the_owner_keeps_the_old_stable_version_on_the_gpu(engine):
    """As the swap above, the push also naming another tenant: v2 was registered again as a new current version,
    which retired v1 before the table was published."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), ProbingAdapters(engine)
    served.apply(state(1, sql(V1, V2)), host)
    engine.load("sql@v1")
    engine.load("sql@v2")
    host.old_registered.clear()
    served.apply(state(2, sql(V2, V1, tenant="globex")), host)
    assert host.old_registered == [True] and pool.resolve("sql") == "sql@v2"
    assert {d["key"]: (d["tier"], d["tenant"]) for d in pool.describe()} == {"sql@v1": ("gpu", "globex"), "sql@v2": ("gpu", "globex")}
    pool.check()


def test_a_swap_to_a_canary_evicted_just_before_the_switch_keeps_the_old_stable_version(engine):
    """{v1, canary v2}, both on the GPU, then {v2, canary v1}; v2 is evicted just before the switch (pressure from
    other requests), so it becomes current only once loaded again. If that load finished while the push still
    read v1's files, v1 was retired before being registered again as the canary (404s for sql@v1, then a
    re-read): the pool now keeps v1 at that switch whenever it happens."""
    from tests.worker.test_served_pool import EvictingAdapters

    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EvictingAdapters(engine)
    served.apply(state(1, sql(V1, V2)), host)
    engine.load("sql@v1")
    engine.load("sql@v2")
    switched_before_canary = []

    def register(name, source, *, make_current=True, **kw):  # v2's reload lands before v1 is registered again
        if not make_current:
            pool.load("sql@v2")
            switched_before_canary.append(pool.resolve("sql") == "sql@v2")
        return EngineAdapters.register_adapter(host, name, source, make_current=make_current, **kw)

    host.register_adapter = register
    served.apply(state(2, sql(V2, V1)), host)
    assert switched_before_canary == [True]
    assert pool.resolve("sql") == "sql@v2" and pool.resolve("sql@v1") == "sql@v1"
    assert {d["key"]: d["tier"] for d in pool.describe()}["sql@v1"] == "gpu"
    pool.check()


def test_a_rollback_whose_version_is_dropped_while_the_push_runs_registers_it_again():
    """Every slot pinned; {sql v2} waits for the last request on the pinned v1; then the rollback {v1}, during which
    that request ends (v2 takes v1's slot, v1 is dropped). The push, which had seen v1 held, took it as registered:
    its pin call failed, and every sql request got 503 until the next push, the pool serving v1 all along."""

    class Host(EngineAdapters):
        meanwhile = None

        def set_adapter_pinned(self, key, pinned):
            if self.meanwhile is not None:  # the engine thread, while the push runs
                self.meanwhile, run = None, self.meanwhile
                run()
            super().set_adapter_pinned(key, pinned)

    with every_slot_pinned() as (pool, served, _):
        host = Host(_.engine)
        slot = pool.acquire("sql@v1", waiter="r1")
        served.apply(state(2, AAA, sql(V2, pinned=True)), host)
        pool.wait_idle()
        host.meanwhile = lambda: (pool.release(slot), pool.wait_idle())
        served.apply(state(3, AAA, sql(V1, pinned=True)), host)
        pool.wait_idle()
        assert served.get("sql").errors == {} and served_keys(served) == {"sql@v1"}
        assert pool.resolve("sql") == "sql@v1"
