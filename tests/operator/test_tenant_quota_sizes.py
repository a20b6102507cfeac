"""The tenant byte quota and versions whose size no worker knows yet: staged one at a time per tenant, so a
tenant cannot have every pod download more than its quota before any refusal; a canary is sized by staging
it, not guessed; creation times in the same second keep the adapter already in force."""

from __future__ import annotations

from lorafleet.operator.reconcile import WorkerReport, reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

from .test_reconcile import MB, NOW, adapter, pool, workers

QUOTA = {"maxBytes": "100Mi"}


def _apply(plan, ws: list[WorkerReport], sizes: dict[tuple[str, str], int], errors=()) -> None:
    """The workers stage what they were told: each version at its size in `sizes`, or fail on `errors`."""
    for w in ws:
        desired = plan.desired[w.pod]
        w.last_pushed = desired
        states = []
        for d in desired.adapters:
            for ref in (d.stable, d.canary):
                if ref is None:
                    continue
                if (d.name, ref.version) in errors:
                    states.append(AdapterState(d.name, ref.version, "none", error="store down"))
                else:
                    states.append(AdapterState(d.name, ref.version, "disk", bytes=sizes[(d.name, ref.version)]))
        w.reported = ReportedState(generation_applied=desired.generation, adapters=states)


def _pushed(plan) -> dict[str, set[str]]:
    return {pod: {d.name for d in desired.adapters} for pod, desired in plan.desired.items()}


def test_versions_of_unknown_size_are_staged_one_at_a_time_under_a_byte_quota():
    """Twenty adapters of 1 GiB against 100 MiB: one is pushed; once its size is known and over the quota, it
    is refused and the next one is pushed; the others wait (Pending), never downloaded all at once."""
    ws = workers(3)
    ads = [adapter(f"x{i:02d}", created=NOW) for i in range(20)]
    sizes = {(f"x{i:02d}", "v1"): 1024 * MB for i in range(20)}
    plan = reconcile_pool(pool(tenantQuota=QUOTA), ads, ws, now=NOW)
    assert all(names == {"x00"} for names in _pushed(plan).values())
    waiting = plan.adapter_statuses["x05"]
    assert waiting["phase"] == "Pending", waiting
    assert "staged one at a time; 'x00' is being sized first" in waiting["message"]
    _apply(plan, ws, sizes)
    plan = reconcile_pool(pool(tenantQuota=QUOTA), ads, ws, now=NOW)
    assert plan.adapter_statuses["x00"]["phase"] == "Failed"
    assert "spec.tenantQuota.maxBytes" in plan.adapter_statuses["x00"]["message"]
    assert all(names == {"x01"} for names in _pushed(plan).values())


def test_a_tenant_s_sized_adapters_stay_and_other_tenants_are_not_held_up():
    ws = workers(2)
    ads = [adapter("small", created="1"), adapter("next", created="2"), adapter("later", created="3"),
           adapter("theirs", created="4", tenant="beta")]
    sizes = {("small", "v1"): 10 * MB, ("next", "v1"): 20 * MB, ("later", "v1"): 30 * MB, ("theirs", "v1"): MB}
    plan = reconcile_pool(pool(tenantQuota=QUOTA), ads, ws, now=NOW)
    assert _pushed(plan)["w0"] == {"small", "theirs"}  # one of each tenant's unknown sizes
    for expected in ({"small", "next", "theirs"}, {"small", "next", "later", "theirs"}):
        _apply(plan, ws, sizes)
        plan = reconcile_pool(pool(tenantQuota=QUOTA), ads, ws, now=NOW)
        assert _pushed(plan)["w0"] == expected
    assert {st["phase"] for st in plan.adapter_statuses.values()} <= {"Loading", "Ready"}


def test_a_version_that_failed_to_stage_does_not_hold_up_the_tenant_s_others():
    ws = workers(1)
    ads = [adapter("broken", created="1"), adapter("fine", created="2")]
    plan = reconcile_pool(pool(tenantQuota=QUOTA), ads, ws, now=NOW)
    assert _pushed(plan)["w0"] == {"broken"}
    _apply(plan, ws, {}, errors={("broken", "v1")})
    plan = reconcile_pool(pool(tenantQuota=QUOTA), ads, ws, now=NOW)
    assert _pushed(plan)["w0"] == {"broken", "fine"}  # the broken one is tried again with its backoff


def test_a_small_canary_beside_a_large_stable_version_is_staged_to_learn_its_size():
    """Stable 100 MiB, canary 10 MiB, quota 150 MiB: the canary's size is learned by staging it (it was taken
    to be the stable version's, 200 MiB, and refused for ever); a canary of 60 MiB is then refused at its size."""
    canary = {"version": "v2", "source": {"uri": "s3://adapters/big/v2/"}, "weight": 10}
    ws = [WorkerReport("w0", ReportedState(generation_applied=1, adapters=[AdapterState("big", "v1", "gpu",
                                                                                       bytes=100 * MB)]))]
    quota = pool(tenantQuota={"maxBytes": "150Mi"})
    for canary_mb, phase in ((10, "Loading"), (60, "Failed")):
        a = adapter("big", warm=1, canary=canary, status={"bytes": 100 * MB, "bytesVersion": "v1"})
        plan = reconcile_pool(quota, [a], ws, now=NOW)
        assert plan.desired["w0"].adapters[0].canary is not None  # staged to be sized
        _apply(plan, ws, {("big", "v1"): 100 * MB, ("big", "v2"): canary_mb * MB})
        plan = reconcile_pool(quota, [a], ws, now=NOW)
        assert plan.adapter_statuses["big"]["phase"] == phase, plan.adapter_statuses["big"]["message"]
        assert (plan.desired["w0"].adapters[0].canary is not None) == (phase == "Loading")
        if phase == "Failed":
            assert f"{160 * MB} with this adapter and its canary" in plan.adapter_statuses["big"]["message"]


def test_within_one_second_the_adapter_already_in_force_keeps_its_place():
    """creationTimestamp has one-second steps: `aaa`, created in the same second as `zzz` that is served, does
    not take its place under maxAdapters because its name sorts first."""
    ws = workers(1)
    zzz = adapter("zzz", created="2026-01-01T00:00:05Z")
    plan = reconcile_pool(pool(tenantQuota={"maxAdapters": 1}), [zzz], ws, now=NOW)
    _apply(plan, ws, {("zzz", "v1"): MB})
    aaa = adapter("aaa", created="2026-01-01T00:00:05Z")
    plan = reconcile_pool(pool(tenantQuota={"maxAdapters": 1}), [zzz, aaa], ws, now=NOW)
    assert _pushed(plan)["w0"] == {"zzz"}
    assert plan.adapter_statuses["aaa"]["phase"] == "Failed"
    assert "maxAdapters (1)" in plan.adapter_statuses["aaa"]["message"]


def test_a_refused_spec_with_an_unknown_canary_does_not_hold_the_tenant_s_others_for_ever():
    """x's stable version is known and puts the tenant over the quota with x's canary of unknown size: x is
    refused and never staged, so it must not be the one 'being sized'; y, new, is sized and served."""
    canary = {"version": "v2", "source": {"uri": "s3://adapters/x/v2/"}, "weight": 10}
    a = adapter("a", created="1", status={"bytes": 30 * MB, "bytesVersion": "v1"})
    x = adapter("x", created="2", canary=canary, status={"refusedBytes": {"version": "v1", "bytes": 80 * MB}})
    y = adapter("y", created="3")
    ws = workers(2)
    for _ in range(3):
        plan = reconcile_pool(pool(tenantQuota=QUOTA), [a, x, y], ws, now=NOW)
        _apply(plan, ws, {("a", "v1"): 30 * MB, ("y", "v1"): 5 * MB})
    assert plan.adapter_statuses["x"]["phase"] == "Failed" and _pushed(plan)["w0"] == {"a", "y"}
    assert plan.adapter_statuses["y"]["phase"] != "Pending"


def test_a_spec_waiting_for_its_size_keeps_its_adapter_slot():
    """maxAdapters 2: b waits while a is sized; c, newer and of known size, is not served in b's place only to
    be refused once b's turn comes."""
    ads = [adapter("a", created="1"), adapter("b", created="2"),
           adapter("c", created="3", status={"bytes": MB, "bytesVersion": "v1"})]
    ws = workers(1)
    quota = pool(tenantQuota={"maxBytes": "100Mi", "maxAdapters": 2})
    seen = []
    for _ in range(3):
        plan = reconcile_pool(quota, ads, ws, now=NOW)
        seen.append(_pushed(plan)["w0"])
        _apply(plan, ws, {(n, "v1"): MB for n in "abc"})
    assert seen == [{"a"}, {"a", "b"}, {"a", "b"}]
    assert plan.adapter_statuses["c"]["phase"] == "Failed"
    waiting = reconcile_pool(quota, ads, workers(1), now=NOW).adapter_statuses["b"]
    conditions = {c["type"]: c["status"] for c in waiting["conditions"]}
    assert waiting["phase"] == "Pending" and conditions["Validated"] == "True"  # waiting its turn is no fault


def test_a_size_learned_from_a_download_is_remembered_once_the_workers_drop_it():
    """Refused while downloading (its listed size over the quota): the next pass, before the refusal's status
    comes back through the index, still knows the size and does not push it again."""
    from lorafleet.operator.reported_sizes import ReportedSizes

    quota, spec, ws, memory = pool(tenantQuota={"maxBytes": "10Mi"}), adapter("a"), workers(2), ReportedSizes()
    for w in ws:
        w.reported = ReportedState(generation_applied=1, adapters=[
            AdapterState("a", "v1", "none", staging=True, bytes=64 * MB, bytes_done=MB)])
    memory.note(w.reported for w in ws)
    plan = reconcile_pool(quota, memory.apply([spec]), ws, now=NOW)
    assert plan.adapter_statuses["a"]["phase"] == "Failed"
    for w in ws:  # they dropped it
        w.last_pushed = plan.desired[w.pod]
        w.reported = ReportedState(generation_applied=plan.desired[w.pod].generation)
    memory.note(w.reported for w in ws)
    plan = reconcile_pool(quota, memory.apply([spec]), ws, now=NOW)
    assert plan.adapter_statuses["a"]["phase"] == "Failed" and all(not d.adapters for d in plan.desired.values())
