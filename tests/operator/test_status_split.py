"""An adapter's status says the traffic split the workers report having applied, not the one the spec asks
for: an edit of the canary's weight, its removal or its promotion is Loading until every worker applied it."""

from __future__ import annotations

from lorafleet.operator.reconcile import WorkerReport, reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

from .test_reconcile import MB, NOW, adapter, pool

CANARY = {"version": "v2", "source": {"uri": "s3://adapters/a/v2/"}}


def serving(*split: tuple[str, int]) -> list[WorkerReport]:
    """Two workers, both GPU-resident, each sending the name's users as ``split`` says ((version, percent)...)."""
    states = [AdapterState("a", v, "gpu", bytes=MB, traffic_percent=p) for v, p in split]
    return [WorkerReport(f"w{i}", ReportedState(generation_applied=1, adapters=list(states))) for i in range(2)]


def status(spec: dict, ws: list[WorkerReport], last: dict | None = None) -> dict:
    """``last``: the adapter's status before this pass."""
    return reconcile_pool(pool(), [adapter("a", warm="all", status=last, **spec)], ws, now=NOW).adapter_statuses["a"]


def canary_condition(st: dict) -> tuple[str, str]:
    c = next(c for c in st["conditions"] if c["type"] == "CanaryActive")
    return c["status"], c["message"]


def test_a_weight_edit_is_loading_until_the_workers_apply_it():
    at_50 = {"canary": CANARY | {"weight": 50}}
    st = status(at_50, serving(("v1", 80), ("v2", 20)))
    assert (st["phase"], st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("Loading", "v1", "v2", 20)
    assert st["message"].endswith("the traffic split is not applied yet on w0 (v1 80%, v2 20%), w1 (v1 80%, v2 20%), "
                                  "the spec asks v1 50%, v2 50%")
    assert canary_condition(st) == ("True", "canary v2 at 20%")
    st = status(at_50, serving(("v1", 50), ("v2", 50)))
    assert (st["phase"], st["canaryWeight"]) == ("Ready", 50) and canary_condition(st) == ("True", "canary v2 at 50%")


def test_a_removed_canary_is_reported_served_until_the_workers_stop_sending_users_to_it():
    st = status({}, serving(("v1", 80), ("v2", 20)))
    assert (st["phase"], st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("Loading", "v1", "v2", 20)
    assert canary_condition(st) == ("True", "canary v2 at 20%")
    st = status({}, serving(("v1", 100)))
    assert (st["phase"], st["canaryVersion"], st["canaryWeight"]) == ("Ready", None, 0)
    assert canary_condition(st)[0] == "False"


def test_a_promotion_is_loading_while_the_workers_still_serve_the_old_stable_version():
    st = status({"version": "v2"}, serving(("v1", 80), ("v2", 20)))
    assert (st["phase"], st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("Loading", "v1", "v2", 20)
    # A canary at 60 % promoted: the stable version is still the one the last status named.
    st = status({"version": "v2"}, serving(("v1", 40), ("v2", 60)), last={"stableVersion": "v1"})
    assert (st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("v1", "v2", 60)
    st = status({"version": "v2"}, serving(("v1", 0), ("v2", 100)))  # v1 kept until requests on it end
    assert (st["phase"], st["stableVersion"], st["canaryVersion"]) == ("Ready", "v2", None)


def test_workers_that_differ_name_the_canary_they_serve_and_one_without_splits_is_not_compared():
    """A weight edit applied on one worker only: both still send users to v2, at 20 % and 50 %. The status
    names v2 at the largest share and each worker's split, not "no canary is being served"."""
    ws = serving(("v1", 80), ("v2", 20))
    ws[1] = serving(("v1", 50), ("v2", 50))[1]
    st = status({"canary": CANARY | {"weight": 50}}, ws)
    assert st["phase"] == "Loading" and "w0 (v1 80%, v2 20%)" in st["message"] and "w1 (" not in st["message"]
    assert (st["canaryVersion"], st["canaryWeight"]) == ("v2", 50)
    assert canary_condition(st) == ("True", "canary v2 while workers differ in the split: w0 v1 80%, v2 20%; "
                                            "w1 v1 50%, v2 50%")
    quiet = [WorkerReport(w.pod, ReportedState(generation_applied=1, adapters=[
        AdapterState("a", s.version, "gpu", bytes=MB) for s in w.reported.adapters])) for w in ws]
    assert status({"canary": CANARY | {"weight": 50}}, quiet)["phase"] == "Ready"  # a sidecar without splits


def test_a_canary_at_100_percent_is_still_the_canary_while_a_lower_weight_applies():
    """Every user on the canary (v1 at 0 %): v1 is still the stable version the last status named."""
    st = status({"canary": CANARY | {"weight": 50}}, serving(("v1", 0), ("v2", 100)), last={"stableVersion": "v1"})
    assert (st["phase"], st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("Loading", "v1", "v2", 100)
    assert canary_condition(st) == ("True", "canary v2 at 100%")


def test_a_rollback_applied_on_one_worker_only_still_shows_the_canary_the_other_serves():
    ws = serving(("v1", 80), ("v2", 20))
    ws[0] = serving(("v1", 100))[0]
    st = status({}, ws, last={"stableVersion": "v1", "canaryVersion": "v2"})  # the canary removed from the spec
    assert (st["phase"], st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("Loading", "v1", "v2", 20)
    assert canary_condition(st) == ("True", "canary v2 while workers differ in the split: w0 v1 100%; w1 v1 80%, v2 20%")


def test_a_promotion_or_an_update_applied_on_one_worker_only_names_no_false_canary():
    """While workers differ, the stable version stays the one the last status named as long as a worker still
    has it, and only a canary (the spec's or the last status's) is called one: the outgoing stable version of
    a promotion or of a plain update is not shown as a canary."""
    ws = serving(("v1", 80), ("v2", 20))
    ws[0] = serving(("v2", 100))[0]
    st = status({"version": "v2"}, ws, last={"stableVersion": "v1", "canaryVersion": "v2"})  # v2 promoted
    assert (st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("v1", "v2", 100)
    ws = serving(("v1", 100))
    ws[0] = serving(("v3", 100))[0]
    st = status({"version": "v3"}, ws, last={"stableVersion": "v1"})  # v1 -> v3, no canary ever
    assert (st["phase"], st["stableVersion"], st["canaryVersion"], st["canaryWeight"]) == ("Loading", "v1", None, 0)
    assert canary_condition(st) == ("False", "no canary is being served")
