"""Pool statuses: an invalid spec's condition is stable between ticks, and its status keeps no count of the
last valid pass; with spec.scaling the reconcile leaves the autoscaler's fields alone."""

from __future__ import annotations

from lorafleet.operator.reconcile import reconcile_pool
from lorafleet.operator.status_patches import status_changes
from lorafleet.operator.statuses import invalid_pool_status

from .test_reconcile import NOW, adapter, pool, workers

LATER = "2027-01-01T00:00:00Z"


def test_invalid_pool_status_has_the_generation_and_moves_only_on_a_transition():
    first = invalid_pool_status({}, 4, "spec.workerSelector: required", now=NOW)
    assert first["observedGeneration"] == 4
    [cond] = first["conditions"]
    assert (cond["status"], cond["reason"], cond["lastTransitionTime"]) == ("False", "InvalidSpec", NOW)
    # The next tick: nothing changed, nothing to write (status_changes compares whole values).
    assert invalid_pool_status(first, 4, "spec.workerSelector: required", now=LATER) == first
    # It was Ready before: that is a transition.
    ready = reconcile_pool(pool(), [], workers(1), now=NOW).pool_status
    assert invalid_pool_status(ready, 5, "x", now=LATER)["conditions"][0]["lastTransitionTime"] == LATER


def test_an_invalid_pool_status_names_the_pods_it_holds_and_those_another_pool_owns():
    [cond] = invalid_pool_status({}, 1, "spec.eviction: bad", now=NOW, held=["w-0", "w-1"],
                                 shared_pods={"w-2": "alpha"})["conditions"]
    assert cond["message"].startswith("spec.eviction: bad; its spec.workerSelector still holds w-0, w-1")
    assert cond["message"].endswith("; spec.workerSelector also matches w-2 (owned by LoRAPool 'alpha')")


def test_with_spec_scaling_the_reconcile_leaves_kv_usage_and_the_scaling_condition_alone():
    scaling = {"target": "worker", "prometheusURL": "http://prometheus:9090", "maxReplicas": 4}
    plan = reconcile_pool(pool(scaling=scaling), [adapter("a")], workers(1), now=NOW)
    [ready] = plan.pool_status["conditions"]
    assert ready["type"] == "Ready" and ready["status"] == "True"
    assert not {"kvUsage", "hitRate", "desiredReplicas", "lastScaleTime"} & plan.pool_status.keys()
    plan = reconcile_pool(pool(), [adapter("a")], workers(1), now=NOW)
    assert [c["type"] for c in plan.pool_status["conditions"]] == ["Ready"]
    assert plan.pool_status["kvUsage"] == 0.0


def test_an_invalid_pool_status_removes_the_counts_of_the_last_valid_pass():
    """readyWorkers, adapters and kvUsage are a valid pool's pass's: the status of an invalid spec removes them
    (None, in a merge patch) rather than leave the last valid pass's standing, and writes nothing more after."""
    valid = reconcile_pool(pool(), [adapter("a")], workers(1), now=NOW).pool_status
    changes = status_changes(valid, invalid_pool_status(valid, 2, "spec.eviction: bad", now=LATER))
    assert {k: changes[k] for k in ("readyWorkers", "adapters", "kvUsage")} == \
        {"readyWorkers": None, "adapters": None, "kvUsage": None}
    written = {k: v for k, v in {**valid, **changes}.items() if v is not None}
    assert status_changes(written, invalid_pool_status(written, 2, "spec.eviction: bad", now=LATER)) == {}
