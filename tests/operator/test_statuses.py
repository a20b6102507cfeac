"""Pool statuses: an invalid spec's condition is stable between ticks; spec.scaling is said to be ignored."""

from __future__ import annotations

from lorafleet.operator.reconcile import reconcile_pool
from lorafleet.operator.statuses import SCALING_NOT_IMPLEMENTED, invalid_pool_status

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


def test_spec_scaling_is_reported_as_not_implemented():
    plan = reconcile_pool(pool(scaling={"target": "worker", "maxReplicas": 4}), [adapter("a")], workers(1), now=NOW)
    ready, scaling = plan.pool_status["conditions"]
    assert ready["type"] == "Ready" and ready["status"] == "True"
    assert (scaling["type"], scaling["status"], scaling["reason"]) == ("Scaling", "False", "NotImplemented")
    assert scaling["message"] == SCALING_NOT_IMPLEMENTED and "desiredReplicas" not in plan.pool_status
    plan = reconcile_pool(pool(), [adapter("a")], workers(1), now=NOW)
    assert [c["type"] for c in plan.pool_status["conditions"]] == ["Ready"]
