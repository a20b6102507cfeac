"""Which worker pods a scale-down takes: the ReplicaSet controller deletes the pods of lowest
``controller.kubernetes.io/pod-deletion-cost`` first, so before the autoscaler lowers ``spec.replicas`` it
gives each pod a cost from the pool's last plan: its pinned copies first, then its warm ones. Without it the
ReplicaSet took the newest ready pods, which may hold the only copy of a pinned adapter: it was cold until a
later pass placed it elsewhere and it loaded there.

The operator marks the costs it set (``MARK``, the same value): it changes or removes only those, never a cost
someone else set on a pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorafleet.operator.reconcile import PoolPlan

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MARK = "lorafleet.io/pod-deletion-cost"  # the cost this operator set, to tell it from one set by someone else
PINNED_COST = 1000  # a pinned copy outweighs any count of warm ones a worker holds


def deletion_costs(plan: PoolPlan | None) -> dict[str, int | None] | None:
    """pod -> its cost, for every pod the plan covers: PINNED_COST per pinned copy the plan keeps on it, 1 per
    other warm copy, None for one with neither (cost 0: the operator's mark removed). Its placement counts too:
    a pod whose sidecar missed this pass's answer keeps its copies there, though nothing is pushed to it. None:
    no plan yet (a new operator before its first pass), so no pod is known to hold nothing. A pod whose sidecar
    did not answer, with no earlier answer standing in, is left out: what it holds is not known, its cost stays."""
    if plan is None:
        return None
    costs: dict[str, int | None] = dict.fromkeys(plan.desired)
    for pod, desired in plan.desired.items():
        costs[pod] = sum(PINNED_COST if d.pinned else 1 for d in desired.adapters if d.warm or d.pinned) or None
    placed: dict[str, int] = {}
    for name, pods in plan.placement.items():
        for pod in pods:
            placed[pod] = placed.get(pod, 0) + (PINNED_COST if name in plan.pinned_names else 1)
    for pod, cost in placed.items():
        costs[pod] = max(costs.get(pod) or 0, cost)
    return costs


def cost_changes(pods: Iterable[dict[str, Any]], costs: Mapping[str, int | None]) -> dict[str, int | None]:
    """pod -> the cost to write (None: remove the operator's) where it differs from what the pod has, for the
    pods of `costs` only (another pool's are its own). A pod whose cost someone else set (no MARK, or another
    value) keeps it."""
    changes: dict[str, int | None] = {}
    for p in pods:
        meta = p.get("metadata") or {}
        name, notes = meta.get("name"), meta.get("annotations") or {}
        have, ours = notes.get(DELETION_COST), notes.get(MARK)
        if name not in costs or have is not None and have != ours:
            continue
        want = costs.get(name)
        if (None if want is None else str(want)) != have:
            changes[name] = want
    return changes
