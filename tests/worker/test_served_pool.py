"""ServedAdapters in front of the engine's real AdapterPool (EngineAdapters, no model): which versions the pool
keeps registered through a swap's pushes, and when a new stable version whose load failed becomes current.
Each version's files are read by a loader that waits for the test to open its gate."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError, AdapterNotFoundError
from lorafleet.worker.adapter_pool import AdapterPool
from lorafleet.worker.engine import EngineError
from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.served_adapters import ServedAdapters
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import make_pool
from tests.worker.test_served_adapters import SQL, state

V1, V2, V3 = ({"version": v, "uri": f"/c/sql/{v}"} for v in ("v1", "v2", "v3"))


class GatedEngine:
    """What EngineAdapters calls on the engine, over a real pool: a version registers at once; its weights are
    read (a loader thread) once its gate is open, and that read fails (an I/O error: retryable) for `broken`."""

    def __init__(self, pool: AdapterPool) -> None:
        self.adapter_pool = pool
        self.gates: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        self.broken: set[str] = set()

    def register_adapter(self, name, path, version=None, *, tenant="default", pinned=False, make_current=True,
                         sha256=None, keep_previous=None) -> str:
        key = f"{name}@{version}"
        gate, seed = self.gates[key], int(version.removeprefix("v"))

        def loader():
            gate.wait(30)
            if key in self.broken:
                raise OSError(f"{path}/adapter_model.safetensors: read error")
            return random_weights(seed)

        self.adapter_pool.add(key, loader=loader, tenant=tenant, pinned=pinned, make_current=make_current,
                              keep_previous=keep_previous)
        return key

    def unregister_adapter(self, name: str) -> None:
        try:
            self.adapter_pool.unregister(name)
        except AdapterNotFoundError as exc:
            raise EngineError(str(exc)) from None

    def load(self, key: str) -> None:
        """Open `key`'s gate and wait until it is on the GPU (a new stable version: current then)."""
        self.gates[key].set()
        self.adapter_pool.load(key)


def gated_engine(engine_type: type | None = None, **pool_config):
    """A GatedEngine (or `engine_type`) over a pool of two slots (or `pool_config`), for a fixture or a `with`
    (contextlib.contextmanager): its gates opened and its pool closed after."""
    gated = (engine_type or GatedEngine)(make_pool(**{"max_slots": 2, "num_load_threads": 2, **pool_config}))
    yield gated
    for gate in list(gated.gates.values()):
        gate.set()
    gated.adapter_pool.close()


@pytest.fixture
def engine():
    yield from gated_engine()


def sql(stable: dict, canary: dict | None = None, **flags) -> dict:
    return SQL | {"stable": stable, "warm": False} | ({"canary": canary, "canary_weight": 10} if canary else {}) | flags


@pytest.mark.parametrize("flags", [{}, {"pinned": True}, {"warm": True}], ids=["plain", "pinned", "warm"])
@pytest.mark.parametrize("canary", [None, V3], ids=["kill_switch", "new_canary"])
def test_a_push_dropping_the_old_stable_version_as_the_canary_while_the_swap_loads_retires_it(engine, canary, flags):
    """{v1, canary v2}, swapped to {v2, canary v1} before v2 is on the GPU (v1 kept as its canary), then a push
    without v1 as the canary: once v2 has loaded, v1 is gone from the pool. It stayed registered (resolvable as
    sql@v1), on the GPU, and pinned (holding a slot) or warm (brought back after eviction) if it was."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    served.apply(state(1, sql(V1, V2, **flags)), host)
    engine.load("sql@v1")
    served.apply(state(2, sql(V2, V1, **flags)), host)
    served.apply(state(3, sql(V2, canary, **flags)), host)
    assert pool.resolve("sql") == "sql@v1"  # serving until v2 has loaded
    engine.load("sql@v2")
    assert pool.resolve("sql") == "sql@v2" and pool.registered() == sorted(["sql@v2", *(["sql@v3"] if canary else [])])
    with pytest.raises(AdapterNotFoundError):
        pool.resolve("sql@v1")
    assert "sql@v1" not in {d["key"] for d in pool.describe()} and not pool.is_warm("sql@v1")
    assert pool.pinned_slot_keys() is None  # with v1 pinned, v1 and v2 held both slots
    pool.check()


@pytest.mark.parametrize("rollout", ["swap", "new"])
def test_a_new_stable_version_whose_load_failed_for_now_becomes_current_once_a_retry_loads_it(engine, rollout):
    """A read error may pass: the request that met it is answered 503 (retryable) and the old version keeps
    serving, but once a later request's load succeeds the pool switches to the new version. It did not: the
    old version stayed current (and the fallback, holding its GPU slot) whatever the pushes after."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    served.apply(state(1, sql(V1, V2 if rollout == "swap" else None)), host)
    engine.load("sql@v1")
    engine.broken.add("sql@v2")
    served.apply(state(2, sql(V2, V1 if rollout == "swap" else None)), host)
    assert pool.acquire("sql@v2", waiter="r1") is None
    engine.gates["sql@v2"].set()
    pool.wait_idle()
    with pytest.raises(AdapterLoadError) as exc:
        pool.acquire("sql@v2", waiter="r1")
    assert exc.value.retryable and pool.resolve("sql") == "sql@v1"
    engine.broken.clear()
    assert pool.acquire("sql@v2", waiter="r2") is None  # the next request's load succeeds
    pool.wait_idle()
    pool.release(pool.acquire("sql@v2", waiter="r2"))
    assert pool.resolve("sql") == "sql@v2"
    served.apply(state(3, sql(V2)), host)
    assert pool.registered() == ["sql@v2"] and served.get("sql").sources.keys() == {"v2"}
    pool.check()


class PackingEngine(GatedEngine):
    """As the real Engine: a version's weights are read and packed in register_adapter, so a pinned one takes
    its GPU slot (evicting another) before register_adapter returns."""

    def register_adapter(self, name, path, version=None, *, tenant="default", pinned=False, make_current=True,
                         sha256=None, keep_previous=None) -> str:
        key = f"{name}@{version}"
        weights = random_weights(int(version.removeprefix("v")))
        self.adapter_pool.add(key, weights, tenant=tenant, pinned=pinned, make_current=make_current,
                              keep_previous=keep_previous)
        return key


class EvictingAdapters(EngineAdapters):
    """The engine thread evicts the version to switch to (pressure from other requests) just before the switch."""

    def make_adapter_current(self, key: str, *, if_resident: bool = False, keep_previous: str | None = None) -> bool:
        if self.pool.entry(key).resident:
            self.pool.evict(key)
        return super().make_adapter_current(key, if_resident=if_resident, keep_previous=keep_previous)


def tier(pool: AdapterPool, key: str) -> str:
    return {d["key"]: d["tier"] for d in pool.describe()}[key]


def test_a_swap_does_not_switch_to_a_version_an_earlier_directive_of_the_push_evicted():
    """{sql: v1, canary v2}, both on the GPU (2 slots), then {aaa pinned}, {sql: v2, canary v1}: registering the
    pinned aaa evicts v2, which was resident when the push began. The swap switched to v2 anyway, only in CPU
    memory, and retired v1; with every slot pinned, stable users got 503 until the next push."""
    engine = PackingEngine(make_pool(max_slots=2, num_load_threads=2))
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    try:
        served.apply(state(1, sql(V1, V2)), host)
        for key in ("sql@v2", "sql@v1"):
            pool.load(key)
        pool.release(pool.acquire("sql@v1", waiter="r1"))  # v2 is the least recently used: the victim
        aaa = SQL | {"name": "aaa", "stable": {"version": "v9", "uri": "/c/aaa/v9"}, "warm": False, "pinned": True}
        served.apply(state(2, aaa, sql(V2, V1)), host)
        assert pool.resolve("sql") == "sql@v1" or tier(pool, "sql@v2") == "gpu"
        assert pool.resolve("sql@v1") == "sql@v1" and served.get("sql").split.stable == "v2"
        pool.wait_idle()
        assert pool.resolve("sql") == "sql@v2" and tier(pool, "sql@v2") == "gpu"
        assert pool.resolve("sql@v1") == "sql@v1"  # kept as the canary
        pool.check()
    finally:
        pool.close()


def test_a_promoted_canary_evicted_before_the_switch_becomes_current_once_resident(engine):
    """{sql: v1, canary v2}, then {sql: v2}: v2 was on the GPU when the push looked, evicted before the switch.
    The switch made the CPU-only v2 current and retired v1; now v1 serves, the fallback, until v2 has loaded."""
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EvictingAdapters(engine)
    served.apply(state(1, sql(V1, V2)), host)
    engine.load("sql@v1")
    engine.load("sql@v2")
    served.apply(state(2, sql(V2)), host)
    assert pool.resolve("sql") == "sql@v1" and tier(pool, "sql@v2") != "gpu"
    assert served.get("sql").fallback == "v1" and served.get("sql").split.stable == "v2"
    pool.load("sql@v2")
    assert pool.resolve("sql") == "sql@v2"
    served.apply(state(3, sql(V2)), host)
    assert pool.registered() == ["sql@v2"]
    pool.check()
