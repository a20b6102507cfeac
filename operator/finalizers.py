"""What the finalizers wait for, and the messages they wait with: pure, from the plans of reconcile passes.

An adapter's finalizer combines the plans of its pool and of every other pool of its namespace whose pods may
hold it (``PoolController.may_hold``): an adapter that moved from one pool to another may still be held by
the first pool's pods (one whose spec is invalid pushes nothing else), and each pool's pass unloads every
adapter of the namespace being deleted from its pods. A pool known to have given it to none of its pods,
whose pods report it nowhere, runs no pass for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lorafleet.operator.reconcile import PoolPlan


@dataclass(slots=True)
class UnloadWait:
    waiting: list[str]  # pods the adapter's finalizer still waits for
    given_up: list[str]  # pods that may still hold it, not told past the unload grace: no longer waited for
    message: str  # why it waits ("" once it waits for nothing)


def adapter_unload_wait(name: str, plans: Iterable[PoolPlan]) -> UnloadWait | None:
    """What adapter ``name``'s finalizer waits for across ``plans``; None while a pass has not seen it deleted."""
    waiting: set[str] = set()
    reported: set[str] = set()
    silent: set[str] = set()
    unknown: set[str] = set()
    overdue: set[str] = set()
    for plan in plans:
        if name not in plan.unloading:
            return None
        pods = set(plan.unloading[name])
        # Given up by the pass that could not tell it, but still waited for where another pass sees it hold the
        # adapter (a pod two pools reach: its owner, and one it was released by or held for).
        overdue |= pods & set(plan.overdue)
        pods -= set(plan.overdue)
        waiting |= pods
        reported |= pods - set(plan.silent)
        silent |= pods & set(plan.silent)
        unknown |= pods & set(plan.unreachable)
    overdue -= waiting
    parts = [holders_text(sorted(waiting), sorted(silent - reported))] if waiting else []
    if stuck := sorted(unknown):
        parts.append(f"what {', '.join(stuck)} last accepted is not known (an operator restart) and its pool's set "
                     f"cannot be pushed to it now (it is not ready, or its LoRAPool's spec is invalid): it unloads "
                     f"the adapter once it can be told (deleting the pod ends the wait)")
    if overdue:
        parts.append(f"no longer waited for: {', '.join(sorted(overdue))} (not told for longer than the unload "
                     f"grace; it is told its pool's set, which leaves the adapter out, once it can be)")
    return UnloadWait(sorted(waiting), sorted(overdue), "; ".join(parts) if waiting else "")


def holders_text(pods: list[str], silent: list[str], not_ready: list[str] = ()) -> str:
    """Which pods a finalizer waits for: those still reporting, those whose sidecar did not answer, and (a
    deleting pool) those not ready that may hold its adapters."""
    reporting = [pod for pod in pods if pod not in silent and pod not in not_ready]
    unanswered = [pod for pod in pods if pod in silent]
    parts = [f"still reported by {', '.join(reporting)}"] if reporting else []
    if unanswered:
        parts.append(f"no answer from the sidecar of {', '.join(unanswered)} (it may still serve it)")
    if not_ready:
        parts.append(f"not ready: {', '.join(not_ready)} (it may hold adapters once ready; deleting the pod ends "
                     f"the wait)")
    return "; ".join(parts)
