"""How many workers a pool's pinned adapters need: the autoscaler's floor (scaler.py), counted the way
``placement.place_warm`` places them.

A pinned adapter keeps a GPU-resident copy (reconcile.py's placement policy): a scale-down that leaves too few
workers, or workers with too few GPU adapter slots or bytes between them, would leave one cold, breaking the pin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec
from lorafleet.operator.placement import (
    adapter_bytes,
    canary_bytes,
    copy_slots,
    place_warm,
    reported_bytes,
    warm_count,
)
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

    def fewest(ads: list[AdapterSpec]) -> int | None:
        everywhere = [a for a in ads if a.warm == "all"]
        low = _lower_bound(ads, everywhere, room, default_capacity)
        if low > max_workers or not holds_all(1, everywhere):
            return None
        return _fewest(holds_all, ads, low, max_workers)

    if (count := fewest(pinned)) is not None:
        return PinnedNeed(len(pinned), count)
    # None up to max_workers. What no empty worker holds alone is left out: no count of workers would help.
    # Copies on every worker (warm "all") that do not fit one together, or a copy that does not fit beside them,
    # are held by no count either (raising the pool to maxReplicas would not help); else, with enough workers,
    # each other copy has a worker of its own beside them.
    placeable = [a for a in pinned if holds_all(1, [a])]
    everywhere = [a for a in placeable if a.warm == "all"]
    held = holds_all(1, everywhere) and all(holds_all(1, [*everywhere, a]) for a in placeable if a.warm != "all")
    if held and len(placeable) < len(pinned) and (count := fewest(placeable)) is not None:
        return PinnedNeed(len(pinned), count)
    return PinnedNeed(len(pinned), None, held=held)


def _lower_bound(pinned: list[AdapterSpec], everywhere: list[AdapterSpec], room: ReportedState,
                 default_capacity: int) -> int:
    """Fewer workers than this cannot hold ``pinned``: its slots and bytes over each worker's room, less what the
    copies on every worker (``everywhere``) take of it. 1 where nothing bounds it."""
    others = [a for a in pinned if a.warm != "all"]
    bound = 1
    capacity = min([b for b in (room.pool_bytes, default_capacity) if b], default=0)
    for per_worker, cost in ((room.pool_slots, copy_slots), (capacity, lambda a: adapter_bytes(a, []))):
        free = per_worker - sum(cost(a) for a in everywhere)
        if per_worker and free > 0:
            bound = max(bound, -(-sum(cost(a) for a in others) // free))
    return bound


def _fewest(holds_all: Callable[[int, list[AdapterSpec]], bool], ads: list[AdapterSpec], low: int,
            max_workers: int) -> int | None:
    """The fewest workers, from ``low`` up to ``max_workers``, that hold ``ads`` (more workers hold what fewer
    hold): from the lower bound up, by doubling steps, then by bisection; None if ``max_workers`` do not.
    Identical model workers mostly hold them at the bound: one placement, not one per bisection step on a model
    of maxReplicas workers (seconds of the operator's event loop with a thousand pins)."""
    failing, n, step = low - 1, min(low, max_workers), 1
    while not holds_all(n, ads):
        if n >= max_workers:
            return None
        failing, n, step = n, min(max_workers, n + step), 2 * step
    while failing + 1 < n:
        mid = (failing + n) // 2
        failing, n = (failing, mid) if holds_all(mid, ads) else (mid, n)
    return n


def pool_pinned_need(pool: PoolSpec | None, adapters: list[AdapterSpec], workers: list[WorkerIndex]
                     ) -> PinnedNeed | None:
    """``pinned_need`` of a pool with spec.scaling, counting up to as many workers as its target may have beside
    those it has (the others may run in other Deployments); None without spec.scaling."""
    if pool is None or pool.scaling is None:
        return None
    return pinned_need(adapters, workers, default_capacity=pool.gpu_bytes,
                       max_workers=pool.scaling.max_replicas + len(workers))
