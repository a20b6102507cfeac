"""Stable and canary swapped in one push, against the engine's real AdapterPool (no model): which version the
pool keeps at the switch (the one serving then, named by the push), when the new stable version's copy lands
while the push runs, and when the old stable version cannot be registered again as the canary."""

from __future__ import annotations

import contextlib

import pytest

from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.served_adapters import ServedAdapters
from tests.worker.test_served_adapters import ACME, state
from tests.worker.test_served_pool import V1, V2, V3, GatedEngine, gated_engine, sql
from tests.worker.test_served_rollback import ProbingAdapters, served_keys


@pytest.fixture
def engine():
    yield from gated_engine()


def test_a_swap_to_a_canary_off_the_gpu_keeps_the_old_stable_version_when_it_lands_mid_push(engine):
    """{v1, canary v2}, v2 not on the GPU, then {v2, canary v1}: v2 is registered as current (current once on
    the GPU). If its copy landed while the push still read v1's files to register it again as the canary (the
    engine reads them inside `register_adapter`), the switch retired v1 (404s for sql@v1, then v1 read again
    into CPU memory only): v1 is now kept at that switch."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), ProbingAdapters(engine)
    served.apply(state(1, sql(V1, V2)), host)
    engine.load("sql@v1")
    assert {d["key"]: d["tier"] for d in pool.describe()}["sql@v2"] != "gpu"
    real, landed = host.register_adapter, []

    def register(name, source, *, make_current=True, **kw):
        if not make_current:  # v1's files are being read: v2's copy lands meanwhile
            engine.load("sql@v2")
            landed.append(pool.resolve("sql") == "sql@v2")
        return real(name, source, make_current=make_current, **kw)

    host.register_adapter, host.old_registered = register, []
    served.apply(state(2, sql(V2, V1)), host)
    assert landed == [True] and host.old_registered == [True]
    assert pool.resolve("sql") == "sql@v2" and pool.resolve("sql@v1") == "sql@v1"
    assert {d["key"]: d["tier"] for d in pool.describe()}["sql@v1"] == "gpu"
    assert served.get("sql").split.stable == "v2" and served.get("sql").split.canary == "v1"
    pool.check()


def canaries_cannot_be_registered(host: EngineAdapters) -> None:
    """From now on a version registered as a canary fails as one whose files are gone."""
    real = host.register_adapter

    def register(name, source, *, make_current=True, **kw):
        if not make_current:
            raise OSError(f"{source}/adapter_config.json: No such file or directory")
        return real(name, source, make_current=make_current, **kw)

    host.register_adapter = register


def test_a_swap_whose_old_stable_version_cannot_be_registered_again_takes_it_off_the_engine(engine):
    """{v1, canary v2}, both on the GPU, then {v2, canary v1} with v1's files gone: the swap keeps v1 registered
    as the canary, its registration again fails, and the split leaves it out. It stayed registered and on the
    GPU, reached by no request, until a push no longer named it; it now leaves, its error reported."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    served.apply(state(1, sql(V1, V2)), host)
    engine.load("sql@v1")
    engine.load("sql@v2")
    canaries_cannot_be_registered(host)
    served.apply(state(2, sql(V2, V1)), host)
    assert pool.resolve("sql") == "sql@v2" and pool.registered() == ["sql@v2"]
    assert served_keys(served) == {"sql@v2"}
    v1 = served.report(host).find("sql", "v1")
    assert v1 is not None and "No such file" in v1.error and v1.tier == "none"
    pool.check()


@pytest.mark.parametrize("flags", [{}, {"pinned": True}], ids=["plain", "pinned"])
def test_a_swap_while_a_rollout_loads_does_not_keep_the_rollout_s_fallback(engine, flags):
    """{v1}, {v2} (v2 still loading: v1 serves, the fallback), then {v3, canary v2} with v3 off the GPU: the pool
    was told to keep its current version at v3's switch, which was v1, not v2; v1 stayed registered (pinned, it
    held a slot the canary v2 then never got). v1 retires at the switch, as before the swap's keep."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    served.apply(state(1, sql(V1, **flags)), host)
    engine.load("sql@v1")
    served.apply(state(2, sql(V2, **flags)), host)
    assert pool.resolve("sql") == "sql@v1"
    served.apply(state(3, sql(V3, V2, **flags)), host)
    engine.load("sql@v3")
    assert pool.resolve("sql") == "sql@v3" and "sql@v1" not in pool.registered()
    pool.check()


@pytest.mark.parametrize("flags", [{}, {"pinned": True}], ids=["plain", "pinned"])
def test_a_swap_off_the_gpu_whose_old_stable_version_cannot_be_the_canary_retires_it_at_the_switch(engine, flags):
    """{v1, canary v2}, v2 off the GPU, then {v2, canary v1} with v1's files gone: v2 was registered to keep v1
    at its switch, v1's registration as the canary then failed, and v1 stayed registered (and on the GPU) after
    the switch, reached by no request."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    served.apply(state(1, sql(V1, V2, **flags)), host)
    engine.load("sql@v1")
    canaries_cannot_be_registered(host)
    served.apply(state(2, sql(V2, V1, **flags)), host)
    assert pool.resolve("sql") == "sql@v1"  # serves until v2 is on the GPU
    engine.load("sql@v2")
    assert pool.resolve("sql") == "sql@v2" and pool.registered() == ["sql@v2"]
    pool.check()


def test_a_swap_keeps_the_version_serving_at_the_switch_not_at_the_push_s_start():
    """{v1, canary v3}, {v2 (loading: v1 serves), canary v3}; then {aaa, sql: v3, canary v2}, and v2's load ends
    while aaa registers (v2 serves now). Whether to keep v2 at v3's switch was decided on what served when the
    push began (v1): v2 was retired at once, bare sql requests failed until v2 was read again, into CPU only."""
    with contextlib.contextmanager(gated_engine)(max_slots=4) as engine:
        pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
        served.apply(state(1, sql(V1, V3)), host)
        engine.load("sql@v1")
        engine.load("sql@v3")
        served.apply(state(2, sql(V2, V3)), host)
        assert pool.resolve("sql") == "sql@v1"
        real, seen = host.register_adapter, []

        def register(name, source, **kw):
            if name == "aaa":  # meanwhile the engine thread finishes v2's load: v2 current, v1 retired
                engine.load("sql@v2")
            if name == "sql" and not kw.get("make_current", True):  # v2 about to be read again as the canary
                seen.append(pool.resolve(served.resolve("sql", ACME, "user-x")))
            return real(name, source, **kw)

        host.register_adapter = register
        aaa = {"name": "aaa", "tenant": "acme", "stable": {"version": "v9", "uri": "/c/aaa/v9"}, "warm": False}
        served.apply(state(3, aaa, sql(V3, V2)), host)
        assert seen == ["sql@v2"] and pool.resolve("sql") == "sql@v3"
        assert {d["key"]: d["tier"] for d in pool.describe()}["sql@v2"] == "gpu"
        pool.check()


def test_a_swap_from_a_loading_version_whose_canary_fails_does_not_retry_the_new_stable_version():
    """{v1, canary v3}, {v2 (loading), canary v3}, then {v3, canary v2}: v3 cannot be placed (above acme's GPU byte
    quota) and v2's registration as the canary fails. v2 was never what the engine served, so nothing was kept
    for it; all the same the push asked the pool to switch to v3 again, which failed a second time."""
    from lorafleet.worker.adapter_pool_config import TenantQuota
    from tests.lora_factory import random_weights

    class Engine(GatedEngine):  # v3 is read at registration, at rank 32: above the quota
        def register_adapter(self, name, path, version=None, **kw):
            if version != "v3":
                return super().register_adapter(name, path, version, **kw)
            kw.pop("sha256", None)
            self.adapter_pool.add(f"{name}@{version}", random_weights(3, rank=32), **kw)
            return f"{name}@{version}"

    quota = {"acme": TenantQuota(max_bytes=200_000)}
    with contextlib.contextmanager(gated_engine)(Engine, max_slots=4, tenant_quotas=quota) as engine:
        pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
        served.apply(state(1, sql(V1, V3)), host)
        engine.load("sql@v1")
        served.apply(state(2, sql(V2, V3)), host)
        canaries_cannot_be_registered(host)
        before = pool.stats()["refusals"]  # over the tenant's quota: a policy's refusal, not a failed load
        served.apply(state(3, sql(V3, V2)), host)
        assert pool.stats()["refusals"] - before == 1 and pool.resolve("sql") == "sql@v1"
