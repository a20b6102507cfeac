"""The deletion costs a scale-down ranks the pool's pods by, from the last plan: pinned copies, then warm ones."""

from __future__ import annotations

import dataclasses

from lorafleet.operator.deletion_cost import DELETION_COST, MARK, PINNED_COST, cost_changes, deletion_costs
from lorafleet.operator.reconcile import reconcile_pool

from .test_reconcile import MB, NOW, adapter, converge, pool, workers


def test_costs_count_each_pods_pinned_copies_above_its_warm_ones():
    ws = workers(3, pool_slots=4)
    ads = [adapter("pin", pinned=True, status={"bytes": MB}), adapter("hot", warm=2, status={"bytes": MB}),
           adapter("cold", warm=0)]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    costs = deletion_costs(plan)
    (pinned_pod,) = plan.placement["pin"]
    assert costs[pinned_pod] >= PINNED_COST
    assert {pod: cost for pod, cost in costs.items() if pod != pinned_pod and cost} == dict.fromkeys(
        set(plan.placement["hot"]) - {pinned_pod}, 1)
    assert sum(filter(None, costs.values())) == PINNED_COST + 2
    assert set(costs) == {w.pod for w in ws}  # a pod holding nothing is covered too: its old cost goes
    assert deletion_costs(None) is None  # no plan yet: nothing known, nothing to change


def test_a_pod_that_missed_its_answer_keeps_the_cost_of_the_pinned_copy_placed_on_it():
    """A pod whose sidecar missed this pass's answer keeps its copies placed (its last answer stands in) and
    counts in the pinned floor, but is pushed nothing: its cost came from the pushes alone, so a scale-down's
    ranking took its cost away and the ReplicaSet removed the one pod holding the pinned copy first."""
    ws = workers(3)
    ads = [adapter("pin", pinned=True), adapter("hot", warm=2)]
    (holder,) = converge(pool(), ads, ws).placement["pin"]
    at = [w.pod for w in ws].index(holder)
    quiet = dataclasses.replace(ws[at], reported=None, last_answer=ws[at].reported)
    plan = reconcile_pool(pool(), ads, [quiet, *ws[:at], *ws[at + 1:]], now=NOW)
    assert plan.placement["pin"] == [holder] and holder not in plan.desired
    costs = deletion_costs(plan)
    assert costs[holder] >= PINNED_COST
    ranked = {DELETION_COST: str(costs[holder]), MARK: str(costs[holder])}
    assert holder not in cost_changes([{"metadata": {"name": holder, "annotations": ranked}}], costs)


def test_a_pod_that_did_not_answer_with_no_answer_before_keeps_its_cost():
    """After an operator restart (or past the grace of a quiet pod) a pod whose sidecar does not answer has no
    answer standing in: what it holds is not known, so the cost set before (maybe its pinned copy's) stays."""
    from lorafleet.operator.reconcile import PoolPlan

    costs = deletion_costs(PoolPlan(silent=["pod-b"]))
    ranked = {"metadata": {"name": "pod-b", "annotations": {DELETION_COST: "1000", MARK: "1000"}}}
    assert "pod-b" not in costs and cost_changes([ranked], costs) == {}


def test_only_the_operators_own_costs_are_changed():
    def pod(name: str, **notes: str) -> dict:
        return {"metadata": {"name": name, "annotations": notes}}

    pods = [pod("mine-stale", **{DELETION_COST: "3", MARK: "3"}), pod("mine-same", **{DELETION_COST: "7", MARK: "7"}),
            pod("theirs", **{DELETION_COST: "-100"}), pod("edited", **{DELETION_COST: "9", MARK: "3"}),
            pod("bare"), {"metadata": {}}]
    costs = {"mine-stale": None, "mine-same": 7, "theirs": 1000, "edited": 1, "bare": 1000}
    assert cost_changes(pods, costs) == {"mine-stale": None, "bare": 1000}
    # Pods the plan does not cover (another pool's, in a namespace that pools share) are left as they are.
    assert cost_changes(pods, {"bare": 1000}) == {"bare": 1000}
