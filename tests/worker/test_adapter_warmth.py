"""A directive's `warm` versions stay GPU-resident: the pool brings one back after pressure evicted it,
only into room nobody else needs, backs off from one that fails to load, and stops once a push drops
the flag or the version (worker/adapter_warmth.py). Time is a fake clock: checks run when it says so."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.worker import adapter_warmth
from lorafleet.worker.app_keys import ENGINE
from lorafleet.worker.directives import DesiredState
from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.served_adapters import ServedAdapters
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import flaky_loader, make_pool
from tests.worker.test_admin_pushes import client, directive, push  # noqa: F401 (client: a fixture)
from tests.worker.test_served_adapters import SQL, RecordingHost


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.0) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(adapter_warmth, "time", clock)
    return clock


def checks(pool, clock: FakeClock, n: int = 5, seconds: float = 1.0) -> None:
    """`n` due checks, each after `seconds`, with whatever loads they start finished."""
    for _ in range(n):
        clock.advance(seconds)
        pool.poll()
        pool.wait_idle()


def take_kv_pages(pool) -> list[int]:
    """A KV cache that wants every page: idle adapters are evicted for it (unified paging)."""
    pages = pool.page_pool
    n = pages.available("kv") + pool.reclaimable_pages()
    assert pages.can_allocate(n, "kv")
    return pages.allocate(n, ("kv", "long-request"))


def test_a_warm_adapter_evicted_by_kv_pressure_comes_back_once_room_frees(clock):
    pool = make_pool()
    pool.add("warm@1", random_weights(1))
    pool.add("cold@1", random_weights(2))
    pool.set_warm("warm@1", True)
    pool.load("warm@1")
    pool.load("cold@1")
    kv = take_kv_pages(pool)
    assert not pool.entry("warm@1").resident and not pool.entry("cold@1").resident
    checks(pool, clock)  # the KV cache holds every page: nothing to come back into
    assert not pool.entry("warm@1").on_gpu and pool.page_pool.num_used("adapter") == 0

    pool.page_pool.free(kv)  # the request finished; no push, no traffic for the adapter
    checks(pool, clock, n=1)
    assert pool.entry("warm@1").resident
    assert not pool.entry("cold@1").on_gpu  # only what a directive keeps warm comes back
    assert pool.stats()["rewarms"] == 1
    pool.check()
    pool.close()


def test_a_warm_adapter_comes_back_only_into_free_room_never_evicting(clock):
    """Another tenant's adapters took every slot; once idle they could be evicted, yet the warm one
    waits for a slot freed by itself: coming back evicts nothing, cold or warm."""
    pool = make_pool(max_slots=2)
    for i, key in enumerate(("warm@1", "c1@1", "c2@1")):
        pool.add(key, random_weights(i + 1), tenant="acme" if key == "warm@1" else "globex")
    pool.set_warm("warm@1", True)
    pool.load("warm@1")
    pool.load("c1@1")
    held = pool.acquire("c1@1")  # a request uses it
    pool.load("c2@1")  # the warm adapter is the only idle one: it goes
    assert not pool.entry("warm@1").on_gpu
    pool.release(held)
    evictions = pool.stats()["evictions"]["gpu"]
    checks(pool, clock, n=10)
    assert pool.entry("c1@1").resident and pool.entry("c2@1").resident and not pool.entry("warm@1").on_gpu
    assert pool.stats()["evictions"]["gpu"] == evictions and pool.stats()["rewarms"] == 0

    pool.unregister("c2")  # a slot frees
    checks(pool, clock, n=1)
    assert pool.entry("warm@1").resident and pool.entry("c1@1").resident
    pool.check()
    pool.close()


def test_a_version_its_owner_s_pinned_adapters_keep_out_does_not_hold_warm_ones_back(clock):
    """sql@v1 stays wanted while beta's pinned chat@c1 fills beta's quota: it needs no room a warm adapter
    would take, so the warm one evicted by KV pressure comes back all the same."""
    from lorafleet.worker.adapter_pool_config import TenantQuota

    pool = make_pool(tenant_quotas={"beta": TenantQuota(max_adapters=1)})
    pool.add("chat@c1", random_weights(0), tenant="beta", pinned=True)
    pool.add("sql@v1", random_weights(1), tenant="beta")
    pool.add("warm@1", random_weights(2), tenant="acme")
    pool.set_warm("warm@1", True)
    pool.load("warm@1")
    pool.wait_idle()
    kv = take_kv_pages(pool)
    assert not pool.entry("warm@1").on_gpu
    pool.page_pool.free(kv)
    assert pool.acquire("sql@v1", waiter="r") is None and pool.has_pending_loads()  # refused, still wanted
    checks(pool, clock, n=3)  # the first look passes: the KV cache was short since the last one
    assert pool.entry("warm@1").resident and not pool.entry("sql@v1").on_gpu
    pool.check()
    pool.close()


@pytest.mark.parametrize("warm_priority", [0, -1])
def test_warm_adapters_are_evicted_after_cold_ones_of_their_priority(clock, warm_priority):
    pool = make_pool(max_slots=2)
    for i, key in enumerate(("warm@1", "cold@1", "new@1")):
        pool.add(key, random_weights(i + 1))
    pool.set_warm("warm@1", True)
    pool.set_priority("warm@1", warm_priority)
    pool.load("warm@1")  # least recently used, yet kept over the cold one of its priority
    pool.load("cold@1")
    pool.release(pool.acquire("cold@1"))  # used since
    pool.load("new@1")
    survivor, victim = ("warm@1", "cold@1") if warm_priority == 0 else ("cold@1", "warm@1")
    assert pool.entry(survivor).resident and not pool.entry(victim).on_gpu
    pool.close()


@pytest.mark.parametrize(("error", "retried"), [(ConnectionError, True), (ValueError, False)])
def test_a_warm_adapter_that_fails_to_load_backs_off(clock, error, retried):
    """Its CPU copy gone too, it is read again: a read error is retried after 5 s, then 10 s, then 20 s
    (never in a tight loop); a failure the files must fix is not retried until a load succeeds."""
    broken, flaky = flaky_loader()
    calls = []

    def loader():
        calls.append(clock.now)
        if broken["on"]:
            raise error("object store unreachable")
        return flaky()

    broken["on"] = False
    pool = make_pool()
    pool.add("warm@1", loader=loader)
    pool.set_warm("warm@1", True)
    pool.load("warm@1")
    broken["on"] = True
    pool.evict("warm@1", "gpu")
    pool.evict("warm@1", "cpu")
    checks(pool, clock, n=30)
    assert not pool.entry("warm@1").on_gpu and pool.entry("warm@1").error is not None
    first = calls[1]
    if not retried:
        assert len(calls) == 2
        return
    assert [t - first for t in calls[1:]] == [0, 6, 17]  # 5 s, 10 s, 20 s after each failure was seen
    broken["on"] = False
    checks(pool, clock, n=40)
    assert pool.entry("warm@1").resident and len(calls) == 5
    pool.close()


def test_a_dropped_warm_flag_or_a_retired_version_is_not_brought_back(clock):
    pool = make_pool()
    pool.add("warm@1", random_weights(1))
    pool.set_warm("warm@1", True)
    pool.load("warm@1")
    pool.evict("warm@1", "gpu")
    pool.set_warm("warm@1", False)
    checks(pool, clock)
    assert not pool.entry("warm@1").on_gpu and not pool.is_warm("warm@1")
    pool.set_warm("warm@1", True)
    checks(pool, clock, n=1)
    assert pool.entry("warm@1").resident

    pool.add("warm@2", random_weights(2))  # a new version: the old one retires once this one is resident
    pool.load("warm@2")
    assert not pool.is_warm("warm@1") and pool.stats()["warm"] == 0
    pool.close()


def test_a_push_marks_its_versions_warm_and_a_later_push_unmarks_them():
    host, served = RecordingHost(), ServedAdapters("base")
    canary = SQL | {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 50}
    served.apply(DesiredState.from_dict({"generation": 1, "adapters": [canary]}), host)
    assert host.warm == {"sql@v1": True, "sql@v2": True}
    served.apply(DesiredState.from_dict({"generation": 2, "adapters": [canary | {"warm": False}]}), host)
    assert host.warm == {"sql@v1": False, "sql@v2": False}


def test_the_engine_step_brings_a_warm_adapter_back_while_busy(clock, tiny_llama_dir, qv_adapters_dir):
    """A worker busy with other traffic never goes idle: the step loop itself brings it back."""
    from lorafleet.worker import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128))
    pool = engine.adapter_pool
    key = engine.register_adapter("alpha", qv_adapters_dir / "alpha")
    pool.set_warm(key, True)
    pool.load(key)
    kv = take_kv_pages(pool)
    assert not pool.entry(key).on_gpu
    pool.page_pool.free(kv)
    for _ in range(200):
        if not engine.has_unfinished():
            engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
        clock.advance()
        engine.step()
        if pool.entry(key).resident:
            break
    assert pool.entry(key).resident
    engine.close()


async def test_a_pushed_warm_adapter_comes_back_without_a_push_until_one_drops_warm(client, qv_adapters_dir):  # noqa: F811
    """Through the admin API with the running engine (its idle loop does the checks, on real time)."""
    pool = client.app[ENGINE].engine.adapter_pool
    alpha = qv_adapters_dir / "alpha"
    await push(client, 1, directive("alpha", alpha, warm=True))
    await asyncio.to_thread(pool.wait_idle)
    assert pool.entry("alpha@v1").resident
    kv = await asyncio.to_thread(take_kv_pages, pool)
    assert not pool.entry("alpha@v1").on_gpu
    pool.page_pool.free(kv)
    for _ in range(600):  # the same generation is never pushed again: no push brings it back
        if pool.entry("alpha@v1").resident:
            break
        await asyncio.sleep(0.05)
    assert pool.entry("alpha@v1").resident

    await push(client, 2, directive("alpha", alpha, warm=False))
    assert not pool.is_warm("alpha@v1")
    pool.page_pool.free(await asyncio.to_thread(take_kv_pages, pool))
    await asyncio.to_thread(pool.wait_idle)
    assert not pool.entry("alpha@v1").on_gpu and pool.stats()["rewarms"] == 1


def test_a_pinned_version_whose_load_failed_comes_back_after_the_backoff(clock):
    """Pinning was weaker than warm: a pinned version's failed load was never tried again (it left the
    wanted set), so it stayed off the GPU until the next push or a request paid the cold load."""
    pool = make_pool(warm_retry_s=5.0)
    broken, loader = flaky_loader()
    pool.add("p@1", loader=loader)
    pool.pin("p@1")
    pool.wait_idle()
    assert pool.entry("p@1").error is not None and not pool.entry("p@1").on_gpu
    broken["on"] = False  # the store answers again
    checks(pool, clock, n=2, seconds=1.0)  # within the backoff: not yet
    assert not pool.entry("p@1").on_gpu
    checks(pool, clock, n=2, seconds=3.0)
    assert pool.entry("p@1").resident and not pool.has_pending_loads()
    pool.check()
    pool.close()


def test_unpinning_lets_a_pinned_version_refused_for_want_of_a_slot_take_it_at_once(clock):
    # A push that moves a pin from a to c: its directives pin c (refused: every slot pinned) before a is
    # unpinned. c must not stay in the CPU tier, reporting a stale refusal, while unpinned a keeps the slot.
    pool = make_pool(max_slots=2)
    for i, key in enumerate(("a@1", "b@1", "c@1")):
        pool.add(key, random_weights(i))
    pool.pin("a@1")
    pool.pin("b@1")
    pool.wait_idle()
    pool.pin("c@1")
    pool.wait_idle()
    assert not pool.entry("c@1").on_gpu and "held by pinned adapters" in str(pool.entry("c@1").error)
    pool.unpin("a@1")
    pool.wait_idle()
    pool.poll()
    assert pool.entry("c@1").resident and not pool.entry("a@1").on_gpu
    pool.check()
    pool.close()


def test_a_warm_canary_s_prefetch_never_displaces_a_warm_stable_version_of_its_priority(clock):
    """Two warm adapters with a canary each on three GPU slots (the operator planned a's canary beside both
    stable versions). The push prefetched every version as a request would, so b's canary evicted a's stable
    version, the least recently used warm one; the re-warm check only takes free room, so a's stable version
    stayed off the GPU for good while 80 % of its users loaded it on every request. A warm-up displaces only
    lower ranks: b's canary stays in CPU memory, loaded on demand, as the operator planned."""
    from tests.worker.test_served_pool import PackingEngine, tier

    engine = PackingEngine(make_pool(max_slots=3, num_load_threads=2))
    pool, served = engine.adapter_pool, ServedAdapters("base")
    try:
        adapters = [SQL | {"name": name, "warm": True,
                           "stable": {"version": "v1", "uri": f"/c/{name}/v1"},
                           "canary": {"version": "v2", "uri": f"/c/{name}/v2"}, "canary_weight": 20}
                    for name in ("a", "b")]
        served.apply(DesiredState.from_dict({"generation": 1, "adapters": adapters}), EngineAdapters(engine))
        pool.wait_idle()
        checks(pool, clock)
        assert tier(pool, "a@v1") == tier(pool, "b@v1") == "gpu"
        assert [tier(pool, k) for k in ("a@v2", "b@v2")] == ["gpu", "cpu"]  # the room left, in push order
        pool.check()
    finally:
        pool.close()


def _canary_pool(**kw):
    pool = make_pool(**kw)
    pool.add("sql@v1", random_weights(1))
    pool.add("sql@v2", random_weights(2), make_current=False)  # the canary
    return pool


@pytest.mark.parametrize("other", ["cold", "lower_priority_warm", "lower_priority_pinned_warm"])
def test_a_warm_canary_s_prefetch_displaces_what_ranks_below_it(clock, other):
    """What the operator plans a canary's room over: an idle adapter loaded on demand, or a warm one of a lower
    priority (never a pinned one). Placed only into free room, such a canary stayed off the GPU for good, its
    adapter Loading."""
    pool = _canary_pool(max_slots=2)
    pool.add("other@1", random_weights(3), pinned=other.endswith("pinned_warm"))
    pool.load("sql@v1")
    pool.load("other@1")
    pool.set_warm("other@1", other != "cold")
    pool.set_priority("other@1", -1 if other != "cold" else 0)
    for key in ("sql@v1", "sql@v2"):  # marked once both slots are taken: a warm check would take a free one
        pool.set_warm(key, True)
    pool.prefetch("sql@v2")
    pool.wait_idle()
    displaced = other != "lower_priority_pinned_warm"
    assert pool.entry("sql@v2").resident is displaced and pool.entry("other@1").on_gpu is not displaced
    assert pool.entry("sql@v1").resident
    pool.close()


def test_a_request_still_evicts_the_least_recently_used_of_two_warm_versions(clock):
    """A canary at 100 % serves every user of its name: a request's load evicts by recency among warm versions,
    not the canary before the stable version that serves nobody."""
    pool = _canary_pool(max_slots=2)
    pool.add("cold@1", random_weights(3))
    pool.load("sql@v1")
    pool.load("sql@v2")
    for key in ("sql@v1", "sql@v2"):
        pool.set_warm(key, True)
    pool.release(pool.acquire("sql@v2", waiter="r1"))
    assert pool.acquire("cold@1", waiter="r2") is None
    pool.wait_idle()
    assert pool.entry("sql@v2").resident and not pool.entry("sql@v1").on_gpu
    pool.close()


def test_the_warm_check_brings_a_stable_version_back_before_its_canary(clock):
    pool = _canary_pool(max_slots=1)
    for key in ("sql@v2", "sql@v1"):  # the canary marked first (a swap re-registers the old stable version so)
        pool.set_warm(key, True)
    checks(pool, clock)
    assert pool.entry("sql@v1").resident and not pool.entry("sql@v2").on_gpu
    pool.close()


def test_a_pushed_warm_canary_displaces_an_idle_adapter_loaded_on_demand(clock):
    """The operator plans a warm canary's room over adapters loaded on demand (it counts warm copies only): the
    push's prefetch takes it. Left to free room, the canary stayed off the GPU and its adapter Loading."""
    from tests.worker.test_served_pool import PackingEngine, tier

    engine = PackingEngine(make_pool(max_slots=2, num_load_threads=2))
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    try:
        a = SQL | {"name": "a", "warm": True, "stable": {"version": "v1", "uri": "/c/a/v1"}}
        c = SQL | {"name": "c", "warm": False, "stable": {"version": "v1", "uri": "/c/c/v1"}}
        served.apply(DesiredState.from_dict({"generation": 1, "adapters": [a, c]}), host)
        pool.load("c@v1")  # a request's
        pool.wait_idle()
        canary = a | {"canary": {"version": "v2", "uri": "/c/a/v2"}, "canary_weight": 20}
        served.apply(DesiredState.from_dict({"generation": 2, "adapters": [canary, c]}), host)
        pool.wait_idle()
        assert [tier(pool, k) for k in ("a@v1", "a@v2", "c@v1")] == ["gpu", "gpu", "cpu"]
        pool.check()
    finally:
        pool.close()


def test_a_warm_up_displaces_a_lower_priority_canary_before_its_stable_version(clock):
    """A priority-10 canary's prefetch on a full worker: of the priority-0 adapter's two versions, its canary
    goes, not the stable version its users resolve to (which the check only brings back into free room)."""
    pool = _canary_pool(max_slots=2)
    pool.add("paid@v1", random_weights(3))
    pool.add("paid@v2", random_weights(4), make_current=False)
    pool.load("sql@v1")
    pool.load("sql@v2")  # the stable version is the least recently used
    for key in ("sql@v1", "sql@v2", "paid@v2"):
        pool.set_warm(key, True)
    pool.set_priority("paid@v2", 10)
    pool.prefetch("paid@v2")
    pool.wait_idle()
    assert pool.entry("paid@v2").resident and pool.entry("sql@v1").resident and not pool.entry("sql@v2").on_gpu
    pool.close()


@pytest.mark.parametrize("mode", ["promote", "swap"])
def test_a_canary_left_in_cpu_memory_then_made_stable_still_switches(clock, mode):
    """b's canary was left in CPU memory (no lower rank to displace on a full worker); promoted, or swapped with
    the stable version, it is the version b resolves to once resident, and its warm-up takes a slot as a new
    stable version's always did (a canary's first: a's). Treated as a canary's warm-up, it was dropped and b
    stayed on v1 until a request paid for the load."""
    from tests.worker.test_served_pool import PackingEngine, tier

    engine = PackingEngine(make_pool(max_slots=3, num_load_threads=2))
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)
    try:
        a, b = (SQL | {"name": n, "warm": True, "stable": {"version": "v1", "uri": f"/c/{n}/v1"},
                       "canary": {"version": "v2", "uri": f"/c/{n}/v2"}, "canary_weight": 20} for n in ("a", "b"))
        served.apply(DesiredState.from_dict({"generation": 1, "adapters": [a, b]}), host)
        checks(pool, clock)
        assert tier(pool, "b@v2") == "cpu"
        b |= {"stable": b["canary"]} | ({"canary": a["stable"] | {"uri": "/c/b/v1"}} if mode == "swap"
                                       else {"canary": None, "canary_weight": 0})
        served.apply(DesiredState.from_dict({"generation": 2, "adapters": [a, b]}), host)
        checks(pool, clock)
        assert pool.resolve("b") == "b@v2" and tier(pool, "b@v2") == "gpu" and tier(pool, "a@v1") == "gpu"
        pool.check()
    finally:
        pool.close()


def test_a_new_stable_version_pushed_while_every_slot_is_busy_switches_once_they_are_free(clock):
    from tests.worker.test_served_pool import PackingEngine

    engine = PackingEngine(make_pool(max_slots=2, num_load_threads=2))
    pool, served, host = engine.adapter_pool, ServedAdapters("base"), EngineAdapters(engine)

    def push(generation: int, a_version: str) -> None:
        adapters = [SQL | {"name": n, "warm": True, "stable": {"version": v, "uri": f"/c/{n}/{v}"}}
                    for n, v in (("a", a_version), ("b", "v1"))]
        served.apply(DesiredState.from_dict({"generation": generation, "adapters": adapters}), host)

    try:
        push(1, "v1")
        pool.wait_idle()
        slots = [pool.acquire(k, waiter=f"r{i}") for i, k in enumerate(("a@v1", "b@v1"))]  # two requests running
        push(2, "v2")
        for slot in slots:
            pool.release(slot)
        checks(pool, clock)
        assert pool.resolve("a") == "a@v2"
        pool.check()
    finally:
        pool.close()
