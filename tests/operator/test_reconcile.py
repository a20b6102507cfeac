"""The pure reconcile function: placement, canary, pinning, quota, deletion, drift, honest statuses."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec
from lorafleet.operator.reconcile import WorkerReport, reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

NOW = "2026-01-01T00:00:00Z"
MB = 1 << 20


def pool_body(**spec) -> dict:
    base = {"baseModel": "smollm2-135m", "workerSelector": {"matchLabels": {"app": "w"}}}
    base.update(spec)
    return {"metadata": {"name": "p", "namespace": "ns", "generation": 1}, "spec": base}


def pool(**spec) -> PoolSpec:
    return PoolSpec.parse(pool_body(**spec))


def adapter(name: str, *, version="v1", created="2026-01-01T00:00:00Z", deleting=False, status=None, **spec) -> AdapterSpec:
    base = {"pool": "p", "tenant": "acme", "baseModel": "smollm2-135m", "version": version,
            "source": {"uri": f"s3://adapters/{name}/{version}/"}}
    base.update(spec)
    meta = {"name": name, "namespace": "ns", "generation": 3, "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    return AdapterSpec.parse({"metadata": meta, "spec": base, "status": status or {}})


def report(*states: tuple, applied=0, pool_bytes=0, pool_slots=0) -> ReportedState:
    return ReportedState(generation_applied=applied, pool_bytes=pool_bytes, pool_slots=pool_slots,
                         adapters=[AdapterState(*s) for s in states])


def workers(n: int, **kw) -> list[WorkerReport]:
    return [WorkerReport(f"w{i}", report(**kw)) for i in range(n)]


def converge(p, adapters, ws, rounds=1, *, tier="gpu", bytes_of=None):
    """Simulate workers applying the pushes faithfully; returns the last plan."""
    for _ in range(rounds):
        plan = reconcile_pool(p, adapters, ws, now=NOW)
        for w in ws:
            desired = plan.desired[w.pod]
            w.last_pushed = desired
            states = []
            for d in desired.adapters:
                size = (bytes_of or {}).get(d.name, MB)
                states.append(AdapterState(d.name, d.stable.version, tier if d.warm else "disk", bytes=size))
                if d.canary:  # a warm worker prefetches the canary too
                    states.append(AdapterState(d.name, d.canary.version, tier if d.warm else "disk", bytes=size))
            w.reported = ReportedState(generation_applied=desired.generation, adapters=states)
    return reconcile_pool(p, adapters, ws, now=NOW)


# --- placement -------------------------------------------------------------------------------------

def test_warm_n_spreads_over_n_distinct_workers_and_registers_everywhere():
    ws = workers(3)
    plan = reconcile_pool(pool(), [adapter("a", warm=2), adapter("b", warm="all"), adapter("c")], ws, now=NOW)
    assert len(plan.placement["a"]) == 2 and len(set(plan.placement["a"])) == 2
    assert plan.placement["b"] == ["w0", "w1", "w2"]
    assert plan.placement["c"] == []
    for w in ws:
        assert {d.name for d in plan.desired[w.pod].adapters} == {"a", "b", "c"}
        warm = {d.name for d in plan.desired[w.pod].adapters if d.warm}
        assert ("a" in warm) == (w.pod in plan.placement["a"])


def test_warm_more_than_workers_is_clamped():
    plan = reconcile_pool(pool(), [adapter("a", warm=5)], workers(2), now=NOW)
    assert plan.placement["a"] == ["w0", "w1"]


def test_placement_balances_gpu_bytes():
    # Sizes known from status: 40, 30, 20, 10 MB on two workers -> 50/50, not 70/30.
    ads = [adapter(n, warm=1, status={"bytes": s * MB}) for n, s in (("a", 40), ("b", 30), ("c", 20), ("d", 10))]
    plan = reconcile_pool(pool(), ads, workers(2), now=NOW)
    load = {"w0": 0, "w1": 0}
    for a in ads:
        for pod in plan.placement[a.name]:
            load[pod] += a.known_bytes
    assert load["w0"] == load["w1"] == 50 * MB


def test_placement_skips_a_worker_whose_pool_would_overflow():
    ws = [WorkerReport("w0", report(pool_bytes=10 * MB)), WorkerReport("w1", report(pool_bytes=100 * MB))]
    ads = [adapter("big", warm=1, status={"bytes": 50 * MB}), adapter("small", warm=2, status={"bytes": MB})]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert plan.placement["big"] == ["w1"]
    assert plan.placement["small"] == ["w0", "w1"]


def test_placement_is_sticky_across_reconciles():
    ws = workers(3)
    ads = [adapter("a", warm=1), adapter("b", warm=1)]
    first = converge(pool(), ads, ws)
    # A new, bigger adapter arrives: the healthy placements of a and b do not move.
    ads.append(adapter("z", warm=2, status={"bytes": 64 * MB}))
    second = reconcile_pool(pool(), ads, ws, now=NOW)
    assert second.placement["a"] == first.placement["a"] and second.placement["b"] == first.placement["b"]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=12), num_workers=st.integers(1, 5),
       warms=st.lists(st.integers(0, 6), min_size=12, max_size=12))
def test_placement_properties(sizes, num_workers, warms):
    ads = [adapter(f"a{i}", warm=warms[i], status={"bytes": s * MB}) for i, s in enumerate(sizes)]
    plan = reconcile_pool(pool(), ads, workers(num_workers), now=NOW)
    load = dict.fromkeys((f"w{i}" for i in range(num_workers)), 0)
    for a in ads:
        pods = plan.placement[a.name]
        assert len(pods) == len(set(pods)) == min(a.warm, num_workers)
        for p in pods:
            load[p] += a.known_bytes
    # Largest-first greedy: the spread never exceeds one adapter's size.
    assert max(load.values()) - min(load.values()) <= max(sizes) * MB


# --- statuses come from reports --------------------------------------------------------------------

def test_not_ready_while_nothing_is_loaded():
    ws = workers(2)
    plan = reconcile_pool(pool(), [adapter("a", warm=2)], ws, now=NOW)
    st_ = plan.adapter_statuses["a"]
    assert st_["phase"] == "Loading" and st_["instances"] == [] and st_["stableVersion"] is None
    assert {c["type"]: c["status"] for c in st_["conditions"]}["Ready"] == "False"
    # Workers applied the push but report the adapter only on disk: still not Ready.
    plan = converge(pool(), [adapter("a", warm=2)], ws, tier="disk")
    assert plan.adapter_statuses["a"]["phase"] == "Loading"
    plan = converge(pool(), [adapter("a", warm=2)], ws)
    st_ = plan.adapter_statuses["a"]
    assert st_["phase"] == "Ready" and st_["ready"] == "2/2" and st_["stableVersion"] == "v1"
    assert st_["instances"] == [{"pod": "w0", "version": "v1", "tier": "gpu"},
                                {"pod": "w1", "version": "v1", "tier": "gpu"}]


def test_no_workers_is_pending_and_worker_errors_degrade():
    assert reconcile_pool(pool(), [adapter("a")], [], now=NOW).adapter_statuses["a"]["phase"] == "Pending"
    ws = [WorkerReport("w0", report(("a", "v1", "none", 0, 0, 0, False, "sha256 mismatch")))]
    st_ = reconcile_pool(pool(), [adapter("a")], ws, now=NOW).adapter_statuses["a"]
    assert st_["phase"] == "Degraded" and "w0: a@v1: sha256 mismatch" in st_["message"]


def test_unreachable_sidecar_gets_no_push_and_no_credit():
    ws = [WorkerReport("w0", None), WorkerReport("w1", report())]
    plan = reconcile_pool(pool(), [adapter("a", warm="all")], ws, now=NOW)
    assert set(plan.pushes) == {"w1"} and plan.placement["a"] == ["w1"]
    assert "no answer from the sidecar of w0" in plan.pool_status["conditions"][0]["message"]


def test_a_sidecar_missing_one_answer_keeps_its_warm_copies_placed_there():
    """One timed-out state read moved every warm and pinned copy of that pod to others (loaded and pinned there),
    then back once it answered: its last answer stands in for a short while (controller.py's grace), its copies
    stay placed on it, and no new copy goes to it (it cannot be told)."""
    ws = workers(3)
    ads = [adapter(n, warm=1) for n in "abcdef"] + [adapter("pin", pinned=True), adapter("everywhere", warm="all")]
    steady = converge(pool(), ads, ws).placement
    held = sorted(name for name, pods in steady.items() if pods == ["w0"])
    assert held
    quiet = dataclasses.replace(ws[0], reported=None, last_answer=ws[0].reported)
    plan = reconcile_pool(pool(), [*ads, adapter("new", warm="all")], [quiet, *ws[1:]], now=NOW)
    assert {name: plan.placement[name] for name in steady} == steady
    assert plan.placement["new"] == ["w1", "w2"]
    # Its statuses stand as it last said: Ready stays Ready (not Loading for a copy that did not move), and so
    # does the pool's; a new adapter is asked of the pods that answered only (not Degraded for want of room).
    assert {plan.adapter_statuses[name]["phase"] for name in steady} == {"Ready"}
    assert plan.adapter_statuses["everywhere"]["ready"] == "3/3"
    assert plan.adapter_statuses["new"]["phase"] == "Loading" and plan.pool_status["readyWorkers"] == 3
    assert plan.pool_status["conditions"][0]["status"] == "True"
    erred = dataclasses.replace(quiet, last_answer=dataclasses.replace(quiet.last_answer, error="engine unreachable"))
    ready = reconcile_pool(pool(), ads, [erred, *ws[1:]], now=NOW).pool_status["conditions"][0]
    assert ready["status"] == "False" and "w0: engine unreachable" in ready["message"]  # as it last said
    # A copy both it and a pod that answered hold stays with the one that answered.
    moved = held[0]
    next(st for st in ws[1].reported.adapters if st.name == moved).tier = "gpu"
    plan = reconcile_pool(pool(), ads, [quiet, *ws[1:]], now=NOW)
    assert plan.placement[moved] == ["w1"]
    # With no last answer (the grace is over): its copies go to the workers that answer, as for a pod gone.
    plan = reconcile_pool(pool(), ads, [WorkerReport("w0", None), *ws[1:]], now=NOW)
    assert all(plan.placement[name] and "w0" not in plan.placement[name] for name in held)


# --- canary and promotion --------------------------------------------------------------------------

def test_canary_rolls_out_with_its_weight_then_promotes():
    ws = workers(2)
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}
    ads = [adapter("a", warm=2, canary=canary)]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    d = plan.desired["w0"].by_name()["a"]
    assert (d.stable.version, d.canary.version, d.canary_weight) == ("v1", "v2", 20)
    # Not reported yet: the status does not claim the canary.
    assert plan.adapter_statuses["a"]["canaryVersion"] is None
    plan = converge(pool(), ads, ws)
    st_ = plan.adapter_statuses["a"]
    assert (st_["phase"], st_["stableVersion"], st_["canaryVersion"], st_["canaryWeight"]) == ("Ready", "v1", "v2", 20)
    assert {c["type"]: c["status"] for c in st_["conditions"]}["CanaryActive"] == "True"
    # Promote: version/source := the canary's, canary removed.
    promoted = [adapter("a", version="v2", warm=2, status=st_)]
    plan = reconcile_pool(pool(), promoted, ws, now=NOW)
    d = plan.desired["w0"].by_name()["a"]
    assert d.stable.version == "v2" and d.canary is None and d.canary_weight == 0
    plan = converge(pool(), promoted, ws)
    st_ = plan.adapter_statuses["a"]
    assert (st_["phase"], st_["stableVersion"], st_["canaryVersion"]) == ("Ready", "v2", None)
    assert {c["type"]: c["status"] for c in st_["conditions"]}["CanaryActive"] == "False"


def test_version_change_keeps_reporting_the_served_version_until_the_new_one_is_there():
    ws = workers(1)
    plan = converge(pool(), [adapter("a", warm=1)], ws)
    changed = [adapter("a", version="v2", warm=1, status=plan.adapter_statuses["a"])]
    st_ = reconcile_pool(pool(), changed, ws, now=NOW).adapter_statuses["a"]
    assert st_["phase"] == "Loading" and st_["stableVersion"] == "v1"
    assert converge(pool(), changed, ws).adapter_statuses["a"]["stableVersion"] == "v2"


# --- pinning ---------------------------------------------------------------------------------------

def test_pinned_only_where_warm_and_at_least_one_copy():
    plan = reconcile_pool(pool(), [adapter("a", pinned=True), adapter("b", warm=1)], workers(2), now=NOW)
    assert len(plan.placement["a"]) == 1
    pinned = [w for w, ds in plan.desired.items() if ds.by_name()["a"].pinned]
    assert pinned == plan.placement["a"]
    assert not any(ds.by_name()["b"].pinned for ds in plan.desired.values())


def test_pinned_adapters_are_placed_before_others_under_pressure():
    ws = [WorkerReport("w0", report(pool_bytes=10 * MB))]
    ads = [adapter("big", warm=1, priority=9, status={"bytes": 8 * MB}),
           adapter("pin", pinned=True, status={"bytes": 6 * MB})]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert plan.placement == {"pin": ["w0"], "big": []}


# --- validation and quota --------------------------------------------------------------------------

def test_validation_the_api_server_cannot_do_names_the_field():
    ads = [adapter("mismatch", baseModel="llama-3-8b"),
           adapter("nosource", canary={"version": "v2", "weight": 10}),
           adapter("same", canary={"version": "v1", "source": {"uri": "/x"}, "weight": 10}),
           adapter("ok")]
    plan = reconcile_pool(pool(), ads, workers(1), now=NOW)
    s = plan.adapter_statuses
    assert s["mismatch"]["phase"] == "Failed" and s["mismatch"]["message"].startswith("spec.baseModel:")
    assert s["nosource"]["phase"] == "Failed" and s["nosource"]["message"].startswith("spec.canary.source:")
    assert s["same"]["phase"] == "Failed" and s["same"]["message"].startswith("spec.canary.version:")
    assert {c["type"]: c["status"] for c in s["mismatch"]["conditions"]}["Validated"] == "False"
    # A refused canary leaves the stable version serving, also for an adapter never served before.
    assert {d.name: d.canary for d in plan.desired["w0"].adapters} == {"ok": None, "nosource": None, "same": None}


def test_tenant_quota_max_adapters_first_come_first_served():
    ads = [adapter(f"a{i}", created=f"2026-01-01T00:00:0{i}Z") for i in range(3)] + [adapter("other", tenant="beta")]
    plan = reconcile_pool(pool(tenantQuota={"maxAdapters": 2}), ads, workers(1), now=NOW)
    assert plan.adapter_statuses["a2"]["phase"] == "Failed"
    assert "spec.tenant" in plan.adapter_statuses["a2"]["message"]
    assert "spec.tenantQuota.maxAdapters (2)" in plan.adapter_statuses["a2"]["message"]
    assert {d.name for d in plan.desired["w0"].adapters} == {"a0", "a1", "other"}
    # Deleting one frees its slot.
    ads[0] = adapter("a0", deleting=True)
    plan = reconcile_pool(pool(tenantQuota={"maxAdapters": 2}), ads, workers(1), now=NOW)
    assert plan.adapter_statuses["a2"]["phase"] != "Failed"


def test_tenant_quota_max_bytes():
    ads = [adapter("a", status={"bytes": 300 * MB}, created="1"), adapter("b", status={"bytes": 300 * MB}, created="2"),
           adapter("c", status={"bytes": 100 * MB}, created="3")]
    plan = reconcile_pool(pool(tenantQuota={"maxBytes": "512Mi"}), ads, workers(1), now=NOW)
    assert plan.adapter_statuses["b"]["phase"] == "Failed"
    assert "spec.tenantQuota.maxBytes" in plan.adapter_statuses["b"]["message"]
    assert plan.adapter_statuses["c"]["phase"] != "Failed"


def test_tenant_quota_an_adapter_refused_for_bytes_takes_no_adapter_slot():
    ads = [adapter("a", status={"bytes": 80 * MB}, created="1"), adapter("b", status={"bytes": 80 * MB}, created="2"),
           adapter("c", status={"bytes": 10 * MB}, created="3")]
    plan = reconcile_pool(pool(tenantQuota={"maxAdapters": 2, "maxBytes": "100Mi"}), ads, workers(1), now=NOW)
    assert "spec.tenantQuota.maxBytes" in plan.adapter_statuses["b"]["message"]
    assert {d.name for d in plan.desired["w0"].adapters} == {"a", "c"}


def test_missing_pool_degrades_adapters_with_a_message():
    plan = reconcile_pool(None, [adapter("a")], [], now=NOW)
    st_ = plan.adapter_statuses["a"]
    assert st_["phase"] == "Degraded" and st_["message"].startswith("spec.pool: LoRAPool 'p' does not exist")


# --- deletion --------------------------------------------------------------------------------------

def test_deleted_adapter_is_unloaded_everywhere_before_it_goes():
    ws = workers(2)
    converge(pool(), [adapter("a", warm=2), adapter("b", warm=1)], ws)
    ads = [adapter("a", warm=2, deleting=True), adapter("b", warm=1)]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert plan.unloading["a"] == ["w0", "w1"]  # still reported: the finalizer must wait
    assert all("a" not in ds.by_name() for ds in plan.desired.values())
    assert set(plan.pushes) == {"w0", "w1"}
    plan = converge(pool(), ads, ws)
    assert plan.unloading["a"] == [] and "a" not in plan.adapter_statuses


# --- drift, restarts, generations ------------------------------------------------------------------

def test_steady_state_pushes_nothing():
    ws = workers(2)
    plan = converge(pool(), [adapter("a", warm=1)], ws, rounds=2)
    assert plan.pushes == {}


def test_worker_restart_empty_is_rewarmed():
    ws = workers(2)
    plan = converge(pool(), [adapter("a", warm=2)], ws)
    gen = plan.desired["w0"].generation
    # Engine restarted in place: the sidecar still says it applied the generation, but holds nothing.
    ws[0].reported = report(("a", "v1", "none"), applied=gen)
    plan = reconcile_pool(pool(), [adapter("a", warm=2)], ws, now=NOW)
    assert plan.pushes["w0"].generation == gen + 1 and "w1" not in plan.pushes
    assert plan.adapter_statuses["a"]["phase"] == "Loading"
    # Whole pod replaced: its sidecar reports generation 0 and nothing at all.
    ws[1].reported = report()
    plan = reconcile_pool(pool(), [adapter("a", warm=2)], ws, now=NOW)
    assert "w1" in plan.pushes and plan.pushes["w1"].by_name()["a"].warm
    assert converge(pool(), [adapter("a", warm=2)], ws).adapter_statuses["a"]["phase"] == "Ready"


def test_operator_restart_pushes_above_what_workers_applied():
    ws = workers(1)
    plan = converge(pool(), [adapter("a", warm=1)], ws, rounds=3)
    applied = ws[0].reported.generation_applied
    ws[0].last_pushed = None  # operator memory lost
    plan = reconcile_pool(pool(), [adapter("a", warm=1)], ws, now=NOW)
    assert plan.pushes["w0"].generation == applied + 1
    assert plan.adapter_statuses["a"]["phase"] == "Ready"  # from reports, unaffected by the restart


def test_a_new_version_its_stager_is_still_downloading_is_not_drift():
    """A warm adapter's new version reported at tier none is drift (the engine lost it) unless its stager says
    it is still staging it: the push is answered before the download ends, and a re-push would only start over."""
    ws = workers(1)
    converge(pool(), [adapter("a", warm=1)], ws)
    plan = reconcile_pool(pool(), [adapter("a", warm=1, version="v2")], ws, now=NOW)
    pushed = ws[0].last_pushed = plan.pushes["w0"]
    for staging in (True, False):
        ws[0].reported = ReportedState(generation_applied=pushed.generation, adapters=[
            AdapterState("a", "v1", "gpu"), AdapterState("a", "v2", "none", staging=staging)])
        plan = reconcile_pool(pool(), [adapter("a", warm=1, version="v2")], ws, now=NOW)
        assert ("w0" in plan.pushes) is not staging
        assert "w0" not in plan.failing


def test_extra_adapter_on_a_worker_is_drift():
    ws = workers(1)
    converge(pool(), [adapter("a")], ws)
    ws[0].reported.adapters.append(AdapterState("ghost", "v1", "gpu"))
    plan = reconcile_pool(pool(), [adapter("a")], ws, now=NOW)
    assert "w0" in plan.pushes


def test_a_split_other_than_pushed_is_drift_once_every_version_is_resident():
    """The worker applied the push (a alone, v1) yet splits its users 80/20 with a leftover v0: re-pushed, as no
    pass would correct it otherwise (the status would stay Loading). A version still loading (not on the GPU)
    sends its users back legitimately: no re-push then (a failing one is retried on its own backoff)."""
    ws = workers(1)
    converge(pool(), [adapter("a", warm=1)], ws)
    generation = ws[0].reported.generation_applied
    for v1_tier, error, drift in (("gpu", None, True), ("cpu", None, False)):
        ws[0].reported = ReportedState(generation_applied=generation, adapters=[
            AdapterState("a", "v1", v1_tier, traffic_percent=80, error=error),
            AdapterState("a", "v0", "gpu", traffic_percent=20)])
        plan = reconcile_pool(pool(), [adapter("a", warm=1)], ws, now=NOW)
        assert ("w0" in plan.pushes) is drift, (v1_tier, error)
    ws[0].reported = ReportedState(generation_applied=generation, adapters=[  # v0 kept for requests in flight only
        AdapterState("a", "v1", "gpu", traffic_percent=100), AdapterState("a", "v0", "gpu", traffic_percent=0,
                                                                             refcount=1)])
    assert "w0" not in reconcile_pool(pool(), [adapter("a", warm=1)], ws, now=NOW).pushes
    ws[0].reported = ReportedState(generation_applied=generation, adapters=[  # a rollback to v1, held only by a
        AdapterState("a", "v1", "gpu", traffic_percent=0, refcount=1),      # request in flight, staged again:
        AdapterState("a", "v0", "gpu", traffic_percent=100)])               # v0 serves meanwhile, no re-push storm
    assert "w0" not in reconcile_pool(pool(), [adapter("a", warm=1)], ws, now=NOW).pushes


def test_condition_transition_time_is_kept_while_unchanged():
    ws = workers(1)
    plan = converge(pool(), [adapter("a")], ws)
    st_ = dict(plan.adapter_statuses["a"])
    again = reconcile_pool(pool(), [adapter("a", status=st_)], ws, now="2027-01-01T00:00:00Z")
    assert again.adapter_statuses["a"]["conditions"] == st_["conditions"]


def test_generation_floor_keeps_a_restarted_operator_above_accepted_pushes():
    ws = workers(1)
    converge(pool(), [adapter("a", warm=1)], ws)
    ws[0].last_pushed = None
    # The receiver reports generation 0 (its engine restarted) although it accepted pushes before.
    ws[0].reported = report()
    plan = reconcile_pool(pool(), [adapter("a", warm=1)], ws, now=NOW, generation_floor=1_700_000_000_000)
    assert plan.pushes["w0"].generation == 1_700_000_000_000


def test_priority_decides_who_is_resident_under_pressure():
    ws = [WorkerReport("w0", report(pool_bytes=10 * MB))]
    ads = [adapter("free", warm=1, priority=0, status={"bytes": 6 * MB}),
           adapter("paid", warm=1, priority=5, status={"bytes": 6 * MB})]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert plan.placement == {"paid": ["w0"], "free": []}


def test_workers_disagreeing_on_the_version_is_not_ready():
    ws = workers(2)
    plan = converge(pool(), [adapter("a", warm=2)], ws)
    changed = [adapter("a", version="v2", warm=2, status=plan.adapter_statuses["a"])]
    plan = reconcile_pool(pool(), changed, ws, now=NOW)
    # Only w0 switched.
    ws[0].last_pushed = plan.desired["w0"]
    ws[0].reported = report(("a", "v2", "gpu"), applied=plan.desired["w0"].generation)
    st_ = reconcile_pool(pool(), changed, ws, now=NOW).adapter_statuses["a"]
    assert st_["phase"] == "Loading" and "registered on 1/2 workers" in st_["message"]
    assert {(i["pod"], i["version"]) for i in st_["instances"]} == {("w0", "v2"), ("w1", "v1")}


def test_invalid_pool_spec_is_named_in_adapter_status():
    plan = reconcile_pool(None, [adapter("a")], [], now=NOW, pool_error="spec.workerSelector: required")
    msg = plan.adapter_statuses["a"]["message"]
    assert plan.adapter_statuses["a"]["phase"] == "Degraded"
    assert msg.startswith("spec.pool: LoRAPool 'p' has an invalid spec") and "spec.workerSelector" in msg


def test_an_invalid_pool_leaves_its_adapters_status_saying_what_its_pods_still_serve():
    # The pool's pods keep serving: its adapters' specs were not refused (Validated Unknown, PoolInvalid),
    # and their status still names the stable version and where it is (it read "nothing served").
    ws = workers(2)
    plan = converge(pool(), [adapter("a", warm=2)], ws)
    st_ = plan.adapter_statuses["a"]
    assert st_["phase"] == "Ready" and st_["stableVersion"] == "v1"
    for w in ws:
        w.reported = report(("a", "v1", "gpu", 0, 0, MB))
    plan = reconcile_pool(None, [adapter("a", warm=2, status=st_)], [], now=NOW, pool_error="spec.workerSelector: required",
                          held=ws)
    st_ = plan.adapter_statuses["a"]
    conditions = {c["type"]: (c["status"], c["reason"]) for c in st_["conditions"]}
    assert st_["phase"] == "Degraded" and conditions["Validated"] == ("Unknown", "PoolInvalid")
    assert "its pods keep what they were last told" in st_["message"]
    assert st_["stableVersion"] == "v1" and [i["pod"] for i in st_["instances"]] == ["w0", "w1"]


def test_sidecars_that_stop_answering_are_named_not_the_worker_selector():
    # Every sidecar silent (a crash loop, a token mismatch) while the pods are ready and still serve: the
    # status sent users to debug labels ("no ready worker matches ... workerSelector") and cleared the versions.
    ws = workers(2)
    st_ = converge(pool(), [adapter("a", warm=2)], ws).adapter_statuses["a"]
    for w in ws:
        w.reported = None
    st_ = reconcile_pool(pool(), [adapter("a", warm=2, status=st_)], ws, now=NOW).adapter_statuses["a"]
    assert st_["phase"] == "Pending" and "no answer from the sidecar of w0, w1" in st_["message"]
    assert "workerSelector" not in st_["message"]
    assert st_["stableVersion"] == "v1" and {i["pod"] for i in st_["instances"]} == {"w0", "w1"}


def test_silent_sidecars_keep_the_canary_the_last_status_named_and_a_refused_edit_keeps_it_too():
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}
    ws = workers(2)
    st_ = converge(pool(), [adapter("a", warm=2, canary=canary)], ws, rounds=2).adapter_statuses["a"]
    conditions = {c["type"]: c["status"] for c in st_["conditions"]}
    assert st_["canaryVersion"] == "v2" and conditions["CanaryActive"] == "True"
    for w in ws:
        w.reported = None
    for spec in ({"canary": canary}, {"canary": canary, "baseModel": "another-base"}):  # the second is refused
        got = reconcile_pool(pool(), [adapter("a", warm=2, status=st_, **spec)], ws, now=NOW).adapter_statuses["a"]
        conditions = {c["type"]: c["status"] for c in got["conditions"]}
        assert (got["stableVersion"], got["canaryVersion"], got["canaryWeight"]) == ("v1", "v2", 20), got
        assert conditions["CanaryActive"] == "True" and len(got["instances"]) == len(st_["instances"])


def test_loading_message_says_why_a_worker_is_behind():
    ws = workers(2)
    converge(pool(), [adapter("a", warm=2)], ws)
    ws[0].reported = ReportedState(error="engine unreachable: connection refused")
    st_ = reconcile_pool(pool(), [adapter("a", warm=2)], ws, now=NOW).adapter_statuses["a"]
    assert st_["phase"] == "Loading" and "w0: engine unreachable: connection refused" in st_["message"]


def test_pods_owned_by_another_pool_are_reported():
    plan = reconcile_pool(pool(), [adapter("a")], workers(1), now=NOW, shared_pods={"w9": "alpha"})
    cond = plan.pool_status["conditions"][0]
    assert cond["status"] == "False" and "w9 (owned by LoRAPool 'alpha')" in cond["message"]


def test_pool_gpu_bytes_bound_placement_when_workers_do_not_report_a_size():
    ads = [adapter("big", warm=2, status={"bytes": 300 * MB}), adapter("small", warm=2, status={"bytes": MB})]
    plan = reconcile_pool(pool(adapterMemory={"gpuBytes": "256Mi"}), ads, workers(2), now=NOW)
    assert plan.placement == {"big": [], "small": ["w0", "w1"]}
    st_ = plan.adapter_statuses["big"]
    assert st_["phase"] == "Degraded" and st_["message"].startswith("spec.warm: 2 asks for 2 GPU-resident copies")
    assert "300.0 MiB" in st_["message"]


def test_status_messages_name_a_few_pods_of_a_large_pool_then_count_the_rest():
    """A pool of many pods, each silent or reporting an error: the adapter's and the pool's messages named every
    one of them (thousands of pods: a status the API server may refuse to store). They name three, then a count."""
    from lorafleet.operator.statuses import pool_status

    failing = ReportedState(1, [AdapterState("a", "v1", "none", error="no such file")], error="sidecar refused")
    ws = [WorkerReport(f"w{i:02d}", failing) for i in range(10)] + [WorkerReport(f"s{i:02d}", None) for i in range(10)]
    plan = reconcile_pool(pool(), [adapter("a")], ws, now=NOW)
    adapter_msg = plan.adapter_statuses["a"]["message"]
    assert "w00: a@v1: no such file; w01: a@v1: no such file; w02: a@v1: no such file and 7 more" in adapter_msg
    assert "s03" not in adapter_msg and "w03" not in adapter_msg
    msg = pool_status(pool(), 1, ws, now=NOW, shared_pods={})["conditions"][0]["message"]
    assert "no answer from the sidecar of s00, s01, s02 and 7 more" in msg, msg
    assert "w02: sidecar refused and 7 more" in msg and "w03" not in msg and "s03" not in msg
