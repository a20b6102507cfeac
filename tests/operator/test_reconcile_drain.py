"""reconcile_pool: an adapter removed from a pool that the engine still reports only for the requests in
flight on it (held, no traffic share) is on its way out, not drift: the pod is not pushed again under a
new generation every pass while those requests run. One it still serves is drift, and is pushed."""

from __future__ import annotations

import pytest

from lorafleet.operator.reconcile import WorkerReport, reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState
from tests.operator.test_reconcile import NOW, adapter, pool


@pytest.mark.parametrize(("removed", "pushes"), [
    (AdapterState("b", "v1", "gpu", refcount=2, bytes=10, traffic_percent=0), 0),  # draining
    (AdapterState("b", "v1", "gpu", refcount=2, bytes=10), 5),  # no share reported: it may still be served
    (AdapterState("b", "v1", "gpu", refcount=0, bytes=10, traffic_percent=100), 5),  # still served: pushed
])
def test_a_removed_adapter_held_by_requests_in_flight_is_not_pushed_away_every_pass(removed, pushes):
    w = WorkerReport("w0", ReportedState(generation_applied=0, adapters=[]))
    plan = reconcile_pool(pool(), [adapter("a")], [w], now=NOW)
    generations = []
    for _ in range(5):
        w.last_pushed = plan.desired["w0"]
        w.reported = ReportedState(generation_applied=w.last_pushed.generation, adapters=[
            AdapterState("a", "v1", "disk", bytes=10, traffic_percent=100), removed])
        plan = reconcile_pool(pool(), [adapter("a")], [w], now=NOW)
        generations.append(plan.pushes["w0"].generation if "w0" in plan.pushes else None)
    assert sum(g is not None for g in generations) == pushes, generations
