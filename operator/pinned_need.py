"""How many workers a pool's pinned adapters need: the autoscaler's floor (scaler.py), counted the way
``placement.place_warm`` places them.

A pinned adapter keeps a GPU-resident copy (reconcile.py's placement policy): a scale-down that leaves too few
workers, or workers with too few GPU adapter slots or bytes between them, would leave one cold, breaking the pin.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec
from lorafleet.operator.placement import canary_bytes, place_warm, reported_bytes, warm_count
from lorafleet.operator.reports import WorkerIndex, WorkerReport
from lorafleet.worker.directives import ReportedState


class PinnedNeed(NamedTuple):
    """The pool's pinned adapters and the fewest workers that hold them all."""

    num_pinned: int  # pinned adapters in force
    num_workers: int | None  # None: more than the most counted (``pinned_need``'s max_workers)
    held: bool = True  # False: no number of workers holds them all (warm on every worker, together too large)


NO_PINNED = PinnedNeed(0, 0)


def pinned_need(adapters: list[AdapterSpec], workers: list[WorkerIndex], *, default_capacity: int = 0,
                max_workers: int) -> PinnedNeed | None:
    """The fewest workers, each with the room of the smallest of ``workers`` (bytes and GPU adapter slots, each
    the least one reports), on which ``place_warm`` places every pinned adapter of ``adapters`` whole (its
    ``warm_count`` copies, a canary with each), counting up to ``max_workers``. A pinned adapter that no empty
    worker could hold alone is left out: no number of workers holds it. None: pinned adapters, but no worker
    reported its room. ``default_capacity``: the pool's spec.adapterMemory.gpuBytes."""
    pinned = [a for a in adapters if a.pinned]
    if not pinned:
        return NO_PINNED
    # No more workers than copies with a count (one each) and one for those on every worker: as many as ever help.
    max_workers = min(max_workers, 1 + sum(max(1, int(a.warm)) for a in pinned if a.warm != "all"))
    if not workers:
        return None
    # The model workers report no adapter: each spec carries the sizes these workers report.
    pinned = [dataclasses.replace(a, known_bytes=max(a.known_bytes, reported_bytes(a, workers)),
                                  known_canary_bytes=canary_bytes(a, workers)) for a in pinned]
    room = ReportedState(pool_bytes=min([x.w.reported.pool_bytes for x in workers if x.w.reported.pool_bytes],
                                        default=0),
                         pool_slots=min([x.w.reported.pool_slots for x in workers if x.w.reported.pool_slots],
                                        default=0))

    def holds_all(num_workers: int, ads: list[AdapterSpec]) -> bool:
        model = [WorkerIndex(WorkerReport(f"#{i}", room), {}, {}) for i in range(num_workers)]
        placed = place_warm(ads, model, default_capacity=default_capacity)
        return all(len(placed[a.name]) == warm_count(a, num_workers) for a in ads)

    placeable = pinned if holds_all(max_workers, pinned) else [a for a in pinned if holds_all(1, [a])]
    if placeable is not pinned and not holds_all(max_workers, placeable):
        # More workers than counted, or none at all: copies on every worker (warm "all") that do not fit one
        # together are held by no count, and raising the pool to maxReplicas would not help.
        return PinnedNeed(len(pinned), None, held=holds_all(4 * max_workers + len(placeable), placeable))
    low, high = 1, max_workers  # more workers hold what fewer hold: the fewest by bisection
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds_all(mid, placeable) else (mid + 1, high)
    return PinnedNeed(len(pinned), low)


def pool_pinned_need(pool: PoolSpec | None, adapters: list[AdapterSpec], workers: list[WorkerIndex]
                     ) -> PinnedNeed | None:
    """``pinned_need`` of a pool with spec.scaling, counting up to as many workers as its target may have beside
    those it has (the others may run in other Deployments); None without spec.scaling."""
    if pool is None or pool.scaling is None:
        return None
    return pinned_need(adapters, workers, default_capacity=pool.gpu_bytes,
                       max_workers=pool.scaling.max_replicas + len(workers))
