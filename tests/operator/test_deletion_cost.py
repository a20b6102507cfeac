"""The deletion costs a scale-down ranks the pool's pods by, from the last plan: pinned copies, then warm ones."""

from __future__ import annotations

from lorafleet.operator.deletion_cost import DELETION_COST, MARK, PINNED_COST, cost_changes, deletion_costs
from lorafleet.operator.reconcile import reconcile_pool

from .test_reconcile import MB, NOW, adapter, pool, workers


def test_costs_count_each_pods_pinned_copies_above_its_warm_ones():
    ws = workers(3, pool_slots=4)
    ads = [adapter("pin", pinned=True, status={"bytes": MB}), adapter("hot", warm=2, status={"bytes": MB}),
           adapter("cold", warm=0)]
    plan = reconcile_pool(pool(), ads, ws, now=NOW)
    costs = deletion_costs(plan)
    (pinned_pod,) = plan.placement["pin"]
    assert costs[pinned_pod] >= PINNED_COST
    assert {pod: cost for pod, cost in costs.items() if pod != pinned_pod} == dict.fromkeys(
        set(plan.placement["hot"]) - {pinned_pod}, 1)
    assert sum(costs.values()) == PINNED_COST + 2
    assert deletion_costs(None) == {}


def test_only_the_operators_own_costs_are_changed():
    def pod(name: str, **notes: str) -> dict:
        return {"metadata": {"name": name, "annotations": notes}}

    pods = [pod("mine-stale", **{DELETION_COST: "3", MARK: "3"}), pod("mine-same", **{DELETION_COST: "7", MARK: "7"}),
            pod("theirs", **{DELETION_COST: "-100"}), pod("edited", **{DELETION_COST: "9", MARK: "3"}),
            pod("bare"), {"metadata": {}}]
    assert cost_changes(pods, {"mine-same": 7, "theirs": 1000, "edited": 1, "bare": 1000}) == {
        "mine-stale": None, "bare": 1000}
