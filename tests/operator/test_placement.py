"""Warm placement against worker capacity: stability when adapters arrive, canary bytes, pinned copies."""

from __future__ import annotations

from lorafleet.operator.reconcile import WorkerReport, reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

from .test_reconcile import MB, NOW, adapter, converge, pool, report, workers

CANARY = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}


def test_a_new_adapter_of_the_same_rank_does_not_displace_resident_ones():
    full = pool(adapterMemory={"gpuBytes": "100Mi"})
    ws = workers(2)
    ads = [adapter("a", warm=1, status={"bytes": 60 * MB}), adapter("b", warm=1, status={"bytes": 60 * MB})]
    before = converge(full, ads, ws, bytes_of={"a": 60 * MB, "b": 60 * MB}).placement
    assert sorted(before["a"] + before["b"]) == ["w0", "w1"]
    # A bigger adapter of the same priority arrives: it waits for room instead of pushing a or b out.
    plan = reconcile_pool(full, [*ads, adapter("z", warm=1, status={"bytes": 70 * MB})], ws, now=NOW)
    assert plan.placement["a"] == before["a"] and plan.placement["b"] == before["b"] and plan.placement["z"] == []
    for pod, desired in plan.desired.items():  # z is registered everywhere; nothing warm moves
        assert {d.name for d in desired.adapters if d.warm} == {n for n in ("a", "b") if pod in before[n]}
    assert plan.adapter_statuses["z"]["message"].startswith("spec.warm: 1 asks for 1 GPU-resident copies")


def test_a_new_adapter_of_a_higher_priority_still_takes_the_room():
    full = pool(adapterMemory={"gpuBytes": "100Mi"})
    ws = workers(1)
    ads = [adapter("a", warm=1, status={"bytes": 60 * MB})]
    assert converge(full, ads, ws, bytes_of={"a": 60 * MB}).placement["a"] == ["w0"]
    plan = reconcile_pool(full, [*ads, adapter("paid", warm=1, priority=5, status={"bytes": 60 * MB})], ws, now=NOW)
    assert plan.placement == {"a": [], "paid": ["w0"]}


def test_a_warm_copy_counts_its_canary_bytes():
    # A warm worker prefetches the canary beside the stable version: 50 + 50 + 40 MiB do not fit in 128 MiB.
    ws = [WorkerReport("w0", report(("a", "v1", "gpu", 0, 0, 50 * MB), ("a", "v2", "disk", 0, 0, 50 * MB),
                                    pool_bytes=128 * MB))]
    ads = [adapter("a", warm=1, canary=CANARY, status={"bytes": 50 * MB}),
           adapter("b", warm=1, status={"bytes": 40 * MB})]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert plan.placement == {"a": ["w0"], "b": []}


def test_a_canary_not_reported_yet_is_taken_to_be_the_stable_size():
    ads = [adapter("a", warm=1, canary=CANARY, status={"bytes": 50 * MB}),
           adapter("b", warm=1, status={"bytes": 40 * MB})]
    plan = reconcile_pool(pool(adapterMemory={"gpuBytes": "128Mi"}), ads, workers(1), now=NOW)
    assert plan.placement == {"a": ["w0"], "b": []}
    st_ = plan.adapter_statuses["a"]
    assert st_["phase"] != "Degraded"


def test_a_pinned_adapter_without_room_names_spec_pinned():
    plan = reconcile_pool(pool(adapterMemory={"gpuBytes": "10Mi"}),
                          [adapter("a", pinned=True, status={"bytes": 20 * MB})], workers(1), now=NOW)
    st_ = plan.adapter_statuses["a"]
    assert st_["phase"] == "Degraded" and plan.placement["a"] == []
    assert st_["message"].startswith("spec.pinned: true (with warm: 0) asks for 1 GPU-resident copy but only 0")


def test_a_canary_takes_a_second_slot_and_an_adapter_out_of_slots_is_degraded():
    ws = workers(1, pool_bytes=1024 * MB, pool_slots=2)
    ads = [adapter("a", warm=1, canary=CANARY, status={"bytes": 8 * MB}),
           adapter("b", warm=1, status={"bytes": 8 * MB})]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert plan.placement == {"a": ["w0"], "b": []}
    message = plan.adapter_statuses["b"]["message"]
    assert plan.adapter_statuses["b"]["phase"] == "Degraded"
    assert "only 0 workers have room for its 8.0 MiB and 1 adapter slot (their --max-loras)" in message


def test_a_worker_that_does_not_say_its_slots_is_placed_by_bytes_alone():
    ws = workers(1, pool_bytes=1024 * MB)  # an older worker: pool_slots absent
    ads = [adapter(f"s{i}", warm=1, status={"bytes": MB}) for i in range(40)]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert all(pods == ["w0"] for pods in plan.placement.values())


def test_the_pools_gpu_bytes_bound_placement_below_what_a_worker_reports():
    # The worker's pages are shared with its KV cache: spec.adapterMemory.gpuBytes is the budget asked for.
    ws = workers(1, pool_bytes=1024 * MB)
    ads = [adapter("a", warm=1, status={"bytes": 60 * MB}), adapter("b", warm=1, status={"bytes": 60 * MB})]
    plan = reconcile_pool(pool(adapterMemory={"gpuBytes": "100Mi"}), ads, ws, now=NOW)
    assert sorted(plan.placement.values()) == [[], ["w0"]]
    ws = workers(1, pool_bytes=100 * MB)  # and a worker's smaller report bounds a larger budget
    plan = reconcile_pool(pool(adapterMemory={"gpuBytes": "1Gi"}), ads, ws, now=NOW)
    assert sorted(plan.placement.values()) == [[], ["w0"]]


def _held(names, *, slots):
    from lorafleet.worker.directives import AdapterState, ReportedState

    return ReportedState(pool_bytes=1024 * MB, pool_slots=slots,
                         adapters=[AdapterState(n, "v1", "gpu", bytes=8 * MB, pinned=True) for n in names])


def test_a_warm_adapter_that_gains_a_canary_keeps_its_stable_copy_where_one_slot_is_left():
    # Its worker has the stable version's slot and no other: the warm canary is prefetched only into free room
    # there, so the stable version keeps its copy (it lost it, for want of the canary's slot).
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 10}
    ws = [WorkerReport("w0", _held(["a", "p1", "p2"], slots=3))]
    others = [adapter(n, pinned=True, status={"bytes": 100 * MB}) for n in ("p1", "p2")]
    plan = reconcile_pool(pool(), [adapter("a", warm=1, canary=canary, status={"bytes": 8 * MB}), *others],
                          ws, now=NOW)
    assert plan.placement == {"a": ["w0"], "p1": ["w0"], "p2": ["w0"]}
    assert plan.desired["w0"].by_name()["a"].warm


def test_a_pinned_adapter_with_a_canary_takes_two_slots():
    # A pinned copy pins its canary too (the worker does): counted whole, never over a worker's slots. Here a's
    # new canary does not fit beside b on w0, where both were held: a moves whole to w1's free slots, b stays.
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 10}
    ws = [WorkerReport("w0", _held(["a", "b"], slots=2)), WorkerReport("w1", _held([], slots=2))]
    b = adapter("b", pinned=True, tenant="other", status={"bytes": 8 * MB})
    plan = reconcile_pool(pool(), [adapter("a", pinned=True, canary=canary, status={"bytes": 8 * MB}), b], ws, now=NOW)
    assert plan.placement == {"a": ["w1"], "b": ["w0"]}


def test_a_canary_on_one_pinned_adapter_does_not_unpin_another():
    # With nowhere else to go, a (larger with its canary, ranked first) took both of w0's slots and b, pinned and
    # resident, was pushed unpinned: a canary added to one adapter never moves another of its rank.
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 5}
    ws = [WorkerReport("w0", _held(["a", "b"], slots=2))]
    b = adapter("b", pinned=True, status={"bytes": 8 * MB})
    plan = reconcile_pool(pool(), [adapter("a", pinned=True, canary=canary, status={"bytes": 8 * MB}), b], ws, now=NOW)
    assert plan.placement == {"a": [], "b": ["w0"]}
    assert plan.desired["w0"].by_name()["b"].pinned


def test_a_canary_added_to_one_held_warm_adapter_moves_no_other_held_adapter():
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 10}
    ws = [WorkerReport("w0", _held(["a", "b"], slots=2)), WorkerReport("w1", _held([], slots=2))]
    b = adapter("b", warm=1, tenant="other", status={"bytes": 8 * MB})
    plan = reconcile_pool(pool(), [adapter("a", warm=1, canary=canary, status={"bytes": 8 * MB}), b], ws, now=NOW)
    assert plan.placement == {"a": ["w0"], "b": ["w0"]}


def test_placement_balances_unknown_sizes_by_raw_counts():
    # During an upgrade one worker says its pool size and slots, the other neither: it counted as empty
    # forever and took nearly every copy.
    from lorafleet.worker.directives import ReportedState

    ws = [WorkerReport("w0", ReportedState(pool_bytes=1024 * MB, pool_slots=16)), WorkerReport("w1", ReportedState())]
    plan = reconcile_pool(pool(), [adapter(f"s{i:02d}", warm=1, status={"bytes": MB}) for i in range(12)], ws, now=NOW)
    per_pod = [sum(pod in pods for pods in plan.placement.values()) for pod in ("w0", "w1")]
    assert per_pod == [6, 6]


def test_placement_balances_slots_as_well_as_bytes():
    # One big adapter on w0 by bytes used to send every small one to w1 until its 16 slots were all pinned
    # (every other adapter's request there then refused), with w0's slots free.
    ws = workers(2, pool_bytes=1024 * MB, pool_slots=16)
    ads = [adapter("big", pinned=True, status={"bytes": 200 * MB})]
    ads += [adapter(f"s{i:02d}", pinned=True, status={"bytes": 8 * MB}) for i in range(20)]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    per_pod = {pod: sum(pod in pods for pods in plan.placement.values()) for pod in ("w0", "w1")}
    assert sum(per_pod.values()) == 21 and max(per_pod.values()) <= 11
    assert all(len(pods) == 1 for pods in plan.placement.values())
    assert all(st_["phase"] != "Degraded" for st_ in plan.adapter_statuses.values())


def test_a_warm_copy_kept_for_its_stable_version_alone_is_ready_with_its_canary_on_demand():
    """One GPU slot: placement keeps the warm copy for the stable version and the canary loads on demand (the
    worker prefetches it into free room only). The status is Ready and says so, not Loading for ever."""
    a = adapter("a", warm=1, canary=CANARY)
    for slots, phase in ((1, "Ready"), (4, "Loading")):
        ws = [WorkerReport("w0", ReportedState(pool_slots=slots, pool_bytes=1 << 30))]
        for _ in range(2):  # the worker applies the push: the stable version on the GPU, the canary on CPU
            plan = reconcile_pool(pool(), [a], ws, now=NOW)
            ws[0].last_pushed = plan.desired["w0"]
            ws[0].reported = ReportedState(generation_applied=plan.desired["w0"].generation, pool_slots=slots,
                                           pool_bytes=1 << 30, adapters=[
                AdapterState("a", "v1", "gpu", bytes=10 * MB, traffic_percent=80),
                AdapterState("a", "v2", "cpu", bytes=10 * MB, traffic_percent=20)])
        st = reconcile_pool(pool(), [a], ws, now=NOW).adapter_statuses["a"]
        assert st["phase"] == phase, st["message"]
        if slots == 1:
            assert "canary v2 at 20%, loaded on demand on w0 (no GPU room beside the stable copy)" in st["message"]
        else:  # room for both: the canary is expected GPU-resident too
            assert "GPU-resident on 0/1 warm workers with room for it" in st["message"]


def test_the_room_a_worker_gave_one_canary_is_not_planned_for_another():
    """Three slots, two warm adapters with canaries: the worker put a's canary into the room left beside both
    stable versions (the push's order). Placement, ordered by size, gave that room to the larger b's canary:
    b stayed Loading for good (its canary only ever goes into free room), a's status said its canary loaded on
    demand while it sat on the GPU."""
    b_canary = {"version": "v2", "source": {"uri": "s3://adapters/b/v2/"}, "weight": 20}
    held = ReportedState(pool_bytes=1024 * MB, pool_slots=3, adapters=[
        AdapterState("a", "v1", "gpu", bytes=8 * MB), AdapterState("a", "v2", "gpu", bytes=8 * MB),
        AdapterState("b", "v1", "gpu", bytes=12 * MB), AdapterState("b", "v2", "cpu", bytes=12 * MB)])
    ads = [adapter("a", warm=1, canary=CANARY, status={"bytes": 8 * MB}),
           adapter("b", warm=1, canary=b_canary, status={"bytes": 12 * MB})]
    plan = reconcile_pool(pool(), ads, [WorkerReport("w0", held)], now=NOW)
    assert plan.placement == {"a": ["w0"], "b": ["w0"]}
    assert plan.placement.canary_pods == {"a": {"w0"}, "b": set()}
    assert "loaded on demand on w0" in plan.adapter_statuses["b"]["message"]
    assert "on demand" not in plan.adapter_statuses["a"]["message"]
