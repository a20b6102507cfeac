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


def deletion_costs(plan: PoolPlan | None) -> dict[str, int]:
    """pod -> its cost: PINNED_COST per pinned copy the plan keeps on it, 1 per other warm copy; pods
    with neither are left out (cost 0)."""
    if plan is None:
        return {}
    costs = {}
    for pod, desired in plan.desired.items():
        cost = sum(PINNED_COST if d.pinned else 1 for d in desired.adapters if d.warm or d.pinned)
        if cost:
            costs[pod] = cost
    return costs


def cost_changes(pods: Iterable[dict[str, Any]], costs: Mapping[str, int]) -> dict[str, int | None]:
    """pod -> the cost to write (None: remove the operator's) where it differs from what the pod has. A pod
    whose cost someone else set (no MARK, or another value) keeps it."""
    changes: dict[str, int | None] = {}
    for p in pods:
        meta = p.get("metadata") or {}
        name, notes = meta.get("name"), meta.get("annotations") or {}
        have, ours = notes.get(DELETION_COST), notes.get(MARK)
        if not isinstance(name, str) or have is not None and have != ours:
            continue
        want = costs.get(name)
        if (None if want is None else str(want)) != have:
            changes[name] = want
    return changes
