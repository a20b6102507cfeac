"""The pure reconcile function when things go wrong: refused edits, malformed or unparsable adapters,
versions that fail to stage, a pool that is gone."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from lorafleet.operator.crd_models import InvalidAdapter, Source, parse_adapter
from lorafleet.operator.reconcile import reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

from .test_reconcile import NOW, converge, pool, workers

CANARY = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}


def body(name: str = "a", *, version: str = "v1", status: dict | None = None, deleting: bool = False,
         generation: int = 3, created: str = "2026-01-01T00:00:00Z", **spec) -> dict:
    base = {"pool": "p", "tenant": "acme", "baseModel": "smollm2-135m", "version": version,
            "source": {"uri": f"s3://adapters/{name}/{version}/"}, "warm": 2}
    base.update(spec)
    meta = {"name": name, "namespace": "ns", "generation": generation, "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    return {"metadata": meta, "spec": base, "status": status or {}}


def conditions(status: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}


def served(plan, name: str) -> dict[str, tuple]:
    """pod -> (stable, canary, warm) of ``name`` in its desired state."""
    out = {}
    for pod, desired in plan.desired.items():
        d = desired.by_name().get(name)
        if d is not None:
            out[pod] = (d.stable.version, d.canary.version if d.canary else None, d.warm)
    return out


# --- a refused edit keeps the last valid spec in force ---------------------------------------------

@pytest.mark.parametrize(("edit", "field"), [
    ({"canary": {"version": "v3", "weight": 10}}, "spec.canary.source"),
    ({"canary": {"version": "v1", "source": {"uri": "/x"}, "weight": 10}}, "spec.canary.version"),
    ({"baseModel": "smollm2-135m-typo"}, "spec.baseModel"),
    ({"source": {"uri": "http://example.com/a"}}, "spec.source.uri"),  # unparsable
    ({"source": {"uri": "s3://adapters/a/v1/", "sha256": "ABCDEF"}}, "spec.source.sha256"),  # unparsable
    ({"source": {"uri": "s3://adapters/a/v2\u00a0/"}}, "spec.source.uri"),  # a pasted no-break space
    ({"canary": {"version": "v2", "source": {"uri": "s3://adapters/a/\tv2/"}, "weight": 20}}, "spec.canary.source.uri"),
])
def test_a_refused_edit_keeps_the_last_valid_spec_serving(edit, field):
    ws = workers(2)
    plan = converge(pool(), [parse_adapter(body(canary=CANARY))], ws)
    before, st = served(plan, "a"), plan.adapter_statuses["a"]
    assert st["phase"] == "Ready" and json.loads(st["lastValidSpec"])["canary"] == CANARY

    bad = parse_adapter(body(status=st, generation=4, **{"canary": CANARY, **edit}))
    plan = reconcile_pool(pool(), [bad], ws, now=NOW)
    assert served(plan, "a") == before and plan.pushes == {}  # the workers keep exactly what they had
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Failed" and st["message"].startswith(f"{field}:")
    assert "last valid spec (version v1) stays in force" in st["message"]
    assert conditions(st) == {"Ready": "False", "Validated": "False", "CanaryActive": "True"}
    assert (st["stableVersion"], st["canaryVersion"], st["observedGeneration"]) == ("v1", "v2", 4)
    assert len(st["instances"]) == 4 and "lastValidSpec" not in st  # the remembered spec is kept as it was

    # Fixed: the new spec is served and remembered.
    fixed = parse_adapter(body(version="v3", status=st, generation=5))
    plan = converge(pool(), [fixed], ws)
    assert set(served(plan, "a").values()) == {("v3", None, True)}
    assert plan.adapter_statuses["a"]["phase"] == "Ready"
    assert json.loads(plan.adapter_statuses["a"]["lastValidSpec"])["version"] == "v3"


def test_an_edit_no_directive_can_be_built_from_keeps_the_last_valid_spec_serving(monkeypatch):
    # The worker's directive checks more than the spec's parser might: such an edit is refused alone and
    # what was serving stays, as for any refused edit (it used to be unloaded from every worker).
    from lorafleet.operator import reconcile
    from lorafleet.worker.directives import DirectiveError

    ws = workers(2)
    plan = converge(pool(), [parse_adapter(body())], ws)
    before, st = served(plan, "a"), plan.adapter_statuses["a"]
    build = reconcile._directive

    def directive(p, a, *, pod_warm):
        if a.version == "v2":
            raise DirectiveError("stable.uri: must hold no control characters")
        return build(p, a, pod_warm=pod_warm)

    monkeypatch.setattr(reconcile, "_directive", directive)
    plan = reconcile_pool(pool(), [parse_adapter(body(version="v2", status=st, generation=4))], ws, now=NOW)
    assert served(plan, "a") == before and plan.pushes == {}
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Failed" and "no worker directive can be built" in st["message"]
    assert "last valid spec (version v1) stays in force" in st["message"]


def test_an_unchanged_spec_that_stops_passing_is_unloaded_and_its_status_cleared():
    ws = workers(2)
    plan = converge(pool(), [parse_adapter(body(canary=CANARY))], ws)
    st = plan.adapter_statuses["a"]
    # The pool's baseModel changed: the adapter's own (unchanged) spec no longer fits, nothing to fall back to.
    moved = pool(baseModel="llama-3-8b")
    plan = reconcile_pool(moved, [parse_adapter(body(canary=CANARY, status=st))], ws, now=NOW)
    assert served(plan, "a") == {} and set(plan.pushes) == {"w0", "w1"}
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Failed" and st["message"].startswith("spec.baseModel:")
    assert st["stableVersion"] == "v1" and st["canaryVersion"] is None  # still reported until unloaded
    plan = converge(moved, [parse_adapter(body(canary=CANARY, status=st))], ws)
    st = plan.adapter_statuses["a"]
    assert (st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == (None, None, 0)
    assert (st["instances"], st["warmWorkers"], st["ready"]) == ([], [], "0/0")
    assert "bytes" not in st  # the last known size stays for quota admission
    assert conditions(st) == {"Ready": "False", "Validated": "False", "CanaryActive": "False"}


def test_a_refused_edit_that_moves_the_adapter_to_another_pool_serves_nothing_there():
    ws = workers(1)
    st = converge(pool(), [parse_adapter(body())], ws).adapter_statuses["a"]
    moved = parse_adapter(body(pool="q", status=st, source={"uri": "ftp://x"}))
    other = pool()
    other.name = "q"
    plan = reconcile_pool(other, [moved], ws, now=NOW)
    assert served(plan, "a") == {} and plan.adapter_statuses["a"]["message"].startswith("spec.source.uri:")


def test_an_unparsable_spec_reports_conditions_and_generation():
    bad = parse_adapter(body(generation=7, source={"uri": "http://example.com/a"},
                             status={"phase": "Ready", "stableVersion": "v0", "instances": [{"pod": "w0"}]}))
    assert isinstance(bad, InvalidAdapter) and bad.last_valid is None
    plan = reconcile_pool(pool(), [bad], workers(1), now=NOW)
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Failed" and st["message"].startswith("spec.source.uri:")
    assert st["observedGeneration"] == 7 and conditions(st)["Ready"] == "False"
    assert conditions(st)["Validated"] == "False" and st["stableVersion"] is None and st["instances"] == []
    assert served(plan, "a") == {}


# --- malformed adapters fail alone; unparsable ones are still unloaded -----------------------------

def test_a_malformed_adapter_fails_alone():
    good = parse_adapter(body("good"))
    bad = dataclasses.replace(parse_adapter(body("bad")), source=Source("s3://adapters/bad/v1/", "ABCDEF"))
    plan = reconcile_pool(pool(), [good, bad], workers(2), now=NOW)  # parse was bypassed: a second line holds
    assert plan.adapter_statuses["bad"]["phase"] == "Failed"
    assert "sha256" in plan.adapter_statuses["bad"]["message"]
    assert all(set(d.by_name()) == {"good"} for d in plan.desired.values())
    assert plan.adapter_statuses["good"]["phase"] == "Loading"


def test_an_unparsable_adapter_being_deleted_is_unloaded_by_name():
    ws = workers(2)
    converge(pool(), [parse_adapter(body(pinned=True))], ws)
    deleting = parse_adapter(body(deleting=True, source={"uri": "http://example.com/a"}))
    assert isinstance(deleting, InvalidAdapter)
    plan = reconcile_pool(pool(), [deleting], ws, now=NOW)
    assert plan.unloading == {"a": ["w0", "w1"]} and "a" not in plan.adapter_statuses
    assert all(d.adapters == [] for d in plan.pushes.values()) and set(plan.pushes) == {"w0", "w1"}
    assert converge(pool(), [deleting], ws).unloading == {"a": []}


# --- a version that failed to stage is retried, as the backoff allows ------------------------------

@pytest.mark.parametrize("failed", ["v1", "v2"])  # the stable version, the canary
def test_a_failed_version_is_re_pushed_when_the_backoff_allows(failed):
    ws = workers(2)
    ads = [parse_adapter(body(canary=CANARY))]
    plan = converge(pool(), ads, ws)
    gen = plan.desired["w0"].generation
    ws[0].reported = ReportedState(generation_applied=gen, adapters=[
        AdapterState("a", v, "none" if v == failed else "gpu", error="store unreachable" if v == failed else None)
        for v in ("v1", "v2")])
    ws[0].may_retry = False
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert plan.pushes == {} and plan.failing == ["w0"]  # converged otherwise: only the failure is drift
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Degraded" and f"w0: a@{failed}: store unreachable" in st["message"]
    ws[0].may_retry = True
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    assert set(plan.pushes) == {"w0"} and plan.pushes["w0"].generation == gen + 1


# --- the pool is gone: its workers are emptied -----------------------------------------------------

def test_without_a_pool_the_workers_given_are_drained():
    ws = workers(2)
    ads = [parse_adapter(body(warm="all", pinned=True)), parse_adapter(body("b", warm=0))]
    converge(pool(), ads, ws)
    plan = reconcile_pool(None, ads, ws, now=NOW)
    assert set(plan.pushes) == {"w0", "w1"} and all(d.adapters == [] for d in plan.pushes.values())
    assert plan.draining == ["w0", "w1"] and plan.pool_status == {}
    assert plan.adapter_statuses["a"]["phase"] == "Degraded"
    plan = converge(None, ads, ws)
    assert plan.draining == [] and plan.pushes == {}
    assert reconcile_pool(pool(), ads, ws, now=NOW).draining is None


@pytest.mark.parametrize("b_created", ["2026-01-01T00:00:01Z", "2025-12-31T00:00:00Z"])
def test_an_edit_refused_by_the_quota_keeps_the_last_valid_spec_serving(b_created):
    # b moves to tenant beta, which is full: the edit is refused and b keeps serving as acme's adapter. Also when
    # b was created before beta's adapter d: the quota's order by creation refused d instead, unloaded everywhere
    # (an adapter in force in the tenant comes before a newcomer).
    ws = workers(1)
    q = pool(tenantQuota={"maxAdapters": 1})
    ads = [parse_adapter(body("b", warm=1, created=b_created)),
           parse_adapter(body("d", warm=0, tenant="beta", created="2026-01-01T00:00:00Z"))]
    plan = converge(q, ads, ws)
    before = served(plan, "b")
    assert before == {"w0": ("v1", None, True)}
    moved = parse_adapter(body("b", warm=1, created=b_created, tenant="beta", version="v2",
                               status=plan.adapter_statuses["b"], generation=4))
    plan = reconcile_pool(q, [moved, ads[1]], ws, now=NOW)
    assert served(plan, "b") == before and plan.pushes == {}
    st = plan.adapter_statuses["b"]
    assert st["phase"] == "Failed" and st["message"].startswith("spec.tenant: tenant 'beta' is over")
    assert "last valid spec (version v1) stays in force" in st["message"] and "lastValidSpec" not in st
    assert plan.adapter_statuses["d"]["phase"] != "Failed"  # the full tenant keeps its own adapter
    # A new adapter of acme finds the slot b still holds taken.
    late = parse_adapter(body("c", warm=0, created="2026-01-01T00:00:02Z"))
    plan = reconcile_pool(q, [moved, ads[1], late], ws, now=NOW)
    assert served(plan, "b") == before and plan.adapter_statuses["c"]["message"].startswith("spec.tenant: tenant 'acme'")


def test_quota_counts_the_spec_in_force():
    # b's edit is refused, so its last valid spec still holds the tenant's second slot: c stays out.
    ws = workers(1)
    q = pool(tenantQuota={"maxAdapters": 2})
    ads = [parse_adapter(body(n, warm=0, created=f"2026-01-01T00:00:0{i}Z")) for i, n in enumerate("ab")]
    plan = converge(q, ads, ws)
    held = parse_adapter(body("b", warm=0, created="2026-01-01T00:00:01Z", status=plan.adapter_statuses["b"],
                              baseModel="typo"))
    late = parse_adapter(body("c", warm=0, created="2026-01-01T00:00:02Z"))
    plan = reconcile_pool(q, [ads[0], held, late], ws, now=NOW)
    assert {d.name for d in plan.desired["w0"].adapters} == {"a", "b"}
    assert plan.adapter_statuses["b"]["message"].startswith("spec.baseModel:")
    assert plan.adapter_statuses["c"]["message"].startswith("spec.tenant:")


def test_an_adapter_named_as_the_pools_base_model_is_refused():
    """Requests for the base model's name reach the base model: such an adapter would be reported served (and
    Ready) while no request could reach it by name."""
    plan = reconcile_pool(pool(), [parse_adapter(body("smollm2-135m")), parse_adapter(body("a"))], workers(1), now=NOW)
    st = plan.adapter_statuses["smollm2-135m"]
    assert st["phase"] == "Failed" and st["message"].startswith("metadata.name: 'smollm2-135m' is LoRAPool 'p'")
    assert [d.name for d in plan.desired["w0"].adapters] == ["a"]


def test_a_refused_edits_last_valid_spec_keeps_its_quota_place_after_an_operator_restart():
    """x serves in acme (full at one adapter) when an edit of it is refused; z, created earlier, comes in (moved
    from another pool, say). The operator that pushed x keeps it and refuses z. After a restart (no push remembered), x's held spec did
    not count as in force: the quota's order by creation took z, and x was unloaded for a typo in its edit."""
    ws = workers(1)
    q = pool(tenantQuota={"maxAdapters": 1})
    plan = converge(q, [parse_adapter(body("x", warm=1, created="2026-01-02T00:00:00Z"))], ws)
    x = parse_adapter(body("x", warm=1, created="2026-01-02T00:00:00Z", status=plan.adapter_statuses["x"],
                           baseModel="typo"))
    z = parse_adapter(body("z", warm=1, created="2026-01-01T00:00:00Z"))  # a newcomer here (from pool q, say)
    for restarted in (False, True):
        if restarted:
            ws = [dataclasses.replace(w, last_pushed=None) for w in ws]
        plan = reconcile_pool(q, [x, z], ws, now=NOW)
        assert served(plan, "x") == {"w0": ("v1", None, True)}, restarted
        assert plan.adapter_statuses["z"]["message"].startswith("spec.tenant: tenant 'acme'"), restarted


def test_the_byte_quota_counts_the_canary_and_a_canary_over_it_leaves_the_stable_version_serving():
    """A canary is held beside its stable version: the quota counts both (the stable's size until a worker
    reports the canary's). A canary found too large once staged is dropped, not the adapter: before, only
    the stable version counted, so a promotion of that canary unloaded the adapter everywhere."""
    ws = workers(2)
    q = pool(tenantQuota={"maxBytes": "15Mi"})
    plan = converge(q, [parse_adapter(body(status={"bytes": 6 * 2**20}))], ws, bytes_of={"a": 6 * 2**20})
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Ready" and st["bytes"] == 6 * 2**20

    # A canary of unknown size counts as large as the stable version: 12 MiB fit.
    canary = parse_adapter(body(status=st, generation=4, canary=CANARY))
    plan = reconcile_pool(q, [canary], ws, now=NOW)
    assert served(plan, "a") == dict.fromkeys(("w0", "w1"), ("v1", "v2", True))
    # Staged, the canary reports 400 MiB: the canary is refused, v1 keeps serving.
    for w in ws:
        w.reported = ReportedState(generation_applied=plan.desired[w.pod].generation, adapters=[
            AdapterState("a", "v1", "gpu", bytes=6 * 2**20), AdapterState("a", "v2", "disk", bytes=400 * 2**20)])
    plan = reconcile_pool(q, [canary], ws, now=NOW)
    assert served(plan, "a") == dict.fromkeys(("w0", "w1"), ("v1", None, True))
    st = plan.adapter_statuses["a"]
    assert st["phase"] == "Failed" and st["canaryVersion"] is None
    assert st["message"].startswith("spec.tenant: tenant 'acme' is over LoRAPool 'p' spec.tenantQuota.maxBytes "
                                    "(15728640 bytes; 425721856 with this adapter and its canary)")
    # Another adapter of the tenant is not refused for the canary that is not served.
    other = parse_adapter(body("b", created="2026-01-01T00:00:01Z", status={"bytes": 2**20}))
    assert reconcile_pool(q, [canary, other], ws, now=NOW).adapter_statuses["b"]["phase"] != "Failed"
    assert st["canaryBytes"] == {"version": "v2", "bytes": 400 * 2**20}

    # The workers dropped v2 and report it no more: its remembered size keeps it out (no flapping back in).
    for w in ws:
        w.reported = ReportedState(generation_applied=plan.desired[w.pod].generation, adapters=[
            AdapterState("a", "v1", "gpu", bytes=6 * 2**20)])
    again = parse_adapter(body(status=st, generation=4, canary=CANARY))
    plan = reconcile_pool(q, [again], ws, now=NOW)
    assert served(plan, "a") == dict.fromkeys(("w0", "w1"), ("v1", None, True))
    assert plan.adapter_statuses["a"]["canaryBytes"] == {"version": "v2", "bytes": 400 * 2**20}
    # An edit meanwhile (the weight) is refused as well, its last valid spec served without the canary.
    edited = parse_adapter(body(status=st, generation=5, canary=CANARY | {"weight": 30}))
    plan = reconcile_pool(q, [edited], ws, now=NOW)
    assert served(plan, "a") == dict.fromkeys(("w0", "w1"), ("v1", None, True))
    assert plan.adapter_statuses["a"]["phase"] == "Failed"


@pytest.mark.parametrize(("edit", "served_canary"), [
    ({"canary": {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 0}}, ("v2", 0)),
    ({"canary": {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 5}}, ("v2", 5)),
    ({"canary": None}, None),
    ({}, None),  # spec.canary removed
    ({"canary": {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 50}}, ("v2", 20)),  # a raise
    ({"canary": {"version": "v3", "source": {"uri": "s3://adapters/a/v3/"}, "weight": 0}}, ("v2", 20)),
    ({"version": "v2", "source": {"uri": "s3://adapters/a/v2/", "sha256": "ABCDEF"}}, ("v2", 20)),  # a promotion
])
def test_a_canary_stopped_in_an_edit_refused_for_a_typo_elsewhere_stops(edit, served_canary):
    """An emergency rollback (canary weight 0, lowered, or removed) in an edit that also has a mistyped sha256:
    the edit is refused and its last valid spec stays in force, but with the canary cut as the edit asks. A
    raise, another canary version or a promotion waits for the edit to be valid."""
    from .test_reconcile import converge

    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}
    ws = workers(2)
    plan = converge(pool(), [parse_adapter(body(canary=canary))], ws)
    spec = {"canary": canary, "source": {"uri": "s3://adapters/a/v1/", "sha256": "ABCDEF"}, **edit}
    if "canary" not in edit and "version" not in edit:
        del spec["canary"]
    edited = parse_adapter(body(status=copy.deepcopy(plan.adapter_statuses["a"]), generation=4, **spec))
    plan = reconcile_pool(pool(), [edited], ws, now=NOW)
    assert plan.adapter_statuses["a"]["phase"] == "Failed"
    for desired in plan.desired.values():
        d = desired.by_name()["a"]
        assert d.stable.version == "v1" and d.stable.sha256 is None  # the last valid spec's
        assert (None if d.canary is None else (d.canary.version, d.canary_weight)) == served_canary


def test_a_canary_stopped_in_an_edit_that_parses_but_is_refused_stops():
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}
    ws = workers(2)
    plan = converge(pool(), [parse_adapter(body(canary=canary))], ws)
    edited = parse_adapter(body(status=copy.deepcopy(plan.adapter_statuses["a"]), generation=4, baseModel="typo",
                                canary={**canary, "weight": 0}))
    assert not isinstance(edited, InvalidAdapter)  # refused by the pool's check, not by parsing
    plan = reconcile_pool(pool(), [edited], ws, now=NOW)
    assert plan.adapter_statuses["a"]["message"].startswith("spec.baseModel:")
    assert {pod: d.by_name()["a"].canary_weight for pod, d in plan.desired.items()} == {"w0": 0, "w1": 0}


@pytest.mark.parametrize(("edit", "served_canary"), [
    ({"canary": {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 0}}, ("v2", 0)),
    ({"canary": {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 5}}, ("v2", 5)),
    ({"canary": None}, None),
    ({"canary": {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 50}}, ("v2", 20)),  # a raise
    ({"canary": {"version": "v3", "source": {"uri": "s3://adapters/a/v3/"}, "weight": 0}}, ("v2", 20)),
    ({"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "canary": None}, ("v2", 20)),  # a promotion
    ({"warm": 1, "canary": {"version": "v2", "source": {"uri": "s3://adapters/a/v2/", "sha256": "ABC"},
                            "weight": 0}}, ("v2", 0)),  # unparsable, and a cut
])
def test_the_pods_of_an_invalid_pool_take_a_canary_cut_and_nothing_else(edit, served_canary):
    """A typo in the pool must not keep a canary being rolled back serving at its old weight: the pods it
    holds are told what they last accepted with the canary cut as the adapter's spec asks (weight lowered,
    or removed), under a new generation, and nothing else of the spec (a raise, another canary version, a
    promotion, another warm count wait for the pool's spec to be fixed)."""
    canary = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}, "weight": 20}
    ws = workers(2)
    plan = converge(pool(), [parse_adapter(body(canary=canary))], ws)
    last = {w.pod: w.last_pushed for w in ws}
    edited = parse_adapter(body(status=copy.deepcopy(plan.adapter_statuses["a"]), generation=4,
                                **{"canary": canary, **edit}))
    assert isinstance(edited, InvalidAdapter) is ("warm" in edit)
    plan = reconcile_pool(None, [edited], [], now=NOW, pool_error="spec.eviction: bad", held=ws)
    if served_canary == ("v2", 20):
        assert plan.pushes == {} and plan.desired == {}
        return
    assert set(plan.pushes) == {"w0", "w1"}
    for pod, desired in plan.pushes.items():
        [d], [before] = desired.adapters, last[pod].adapters
        assert desired.generation > last[pod].generation
        assert (None if d.canary is None else (d.canary.version, d.canary_weight)) == served_canary
        assert (d.stable, d.warm, d.pinned) == (before.stable, before.warm, before.pinned)
        assert (desired.eviction, desired.cpu_bytes) == (last[pod].eviction, last[pod].cpu_bytes)
