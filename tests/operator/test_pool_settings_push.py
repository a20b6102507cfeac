"""A pool's spec.eviction and spec.adapterMemory.cpuBytes reach its workers in every push: in the pure
reconcile, and through a running operator to the sidecars."""

from __future__ import annotations

from lorafleet.operator.reconcile import reconcile_pool

from .fake_stager import FakeStager
from .test_handlers import (  # noqa: F401  (fixtures)
    POOL,
    TOKEN,
    adapter_body,
    cluster,
    create,
    eventually,
    pod_body,
    running_operator,
)
from .test_reconcile import NOW, adapter, converge, pool, workers

GIB = 1 << 30


def test_pushes_carry_the_pool_settings():
    plan = reconcile_pool(pool(eviction="lfu", adapterMemory={"cpuBytes": "2Gi"}), [adapter("a")], workers(2),
                          now=NOW)
    assert {(d.eviction, d.cpu_bytes) for d in plan.pushes.values()} == {("lfu", 2 * GIB)}


def test_an_unset_cpu_budget_leaves_the_workers_own():
    plan = reconcile_pool(pool(eviction="cost"), [adapter("a")], workers(1), now=NOW)
    assert (plan.pushes["w0"].eviction, plan.pushes["w0"].cpu_bytes) == ("cost", None)
    assert "cpu_bytes" not in plan.pushes["w0"].to_dict()


def test_a_settings_change_alone_is_pushed_under_a_new_generation():
    ws, adapters = workers(2), [adapter("a", warm=1)]
    converge(pool(eviction="lru"), adapters, ws)
    before = {w.pod: w.last_pushed.generation for w in ws}
    assert reconcile_pool(pool(eviction="lru"), adapters, ws, now=NOW).pushes == {}  # converged
    plan = reconcile_pool(pool(eviction="lfu"), adapters, ws, now=NOW)
    assert sorted(plan.pushes) == ["w0", "w1"]
    for w in ws:
        pushed = plan.pushes[w.pod]
        assert pushed.eviction == "lfu" and pushed.generation > before[w.pod]
        assert pushed.adapters == w.last_pushed.adapters


def test_workers_of_a_deleted_pool_get_their_own_settings_back():
    ws, adapters = workers(1), [adapter("a")]
    converge(pool(eviction="lfu", adapterMemory={"cpuBytes": "1Gi"}), adapters, ws)
    plan = reconcile_pool(None, adapters, ws, now=NOW)
    assert (plan.pushes["w0"].eviction, plan.pushes["w0"].cpu_bytes) == (None, None)


async def test_the_operator_pushes_the_pool_settings_to_the_sidecars(cluster):  # noqa: F811
    emulator, url = cluster
    spec = {**POOL["spec"], "eviction": "lfu", "adapterMemory": {"cpuBytes": "3Gi"}}
    async with FakeStager(TOKEN) as first, FakeStager(TOKEN) as second, running_operator(url):
        sidecars = [first, second]
        for i, s in enumerate(sidecars):
            await create(emulator, "pods", pod_body(f"worker-{i}", s.port))
        await create(emulator, "lorapools", {**POOL, "spec": spec})
        await create(emulator, "loraadapters", adapter_body("sql"))
        await eventually(lambda: all(s.applied and s.applied.by_name().get("sql") for s in sidecars), "sql pushed")
        for s in sidecars:
            assert (s.applied.eviction, s.applied.cpu_bytes) == ("lfu", 3 * GIB)
