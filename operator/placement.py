"""Which workers keep each adapter GPU-resident (``warm``); see reconcile.py's docstring for the policy."""

from __future__ import annotations

from lorafleet.operator.crd_models import AdapterSpec
from lorafleet.operator.reports import WorkerIndex

UNKNOWN_BYTES = 1  # an adapter no worker has reported yet still counts, so placement spreads it


def warm_count(a: AdapterSpec, num_workers: int) -> int:
    n = num_workers if a.warm == "all" else min(int(a.warm), num_workers)
    return max(n, 1 if a.pinned and num_workers else 0)


def adapter_bytes(a: AdapterSpec, workers: list[WorkerIndex]) -> int:
    reported = [s.bytes for x in workers for s in x.by_name.get(a.name, ()) if s.version == a.version]
    return max([a.known_bytes, *reported]) or UNKNOWN_BYTES


def place_warm(adapters: list[AdapterSpec], workers: list[WorkerIndex], *, default_capacity: int = 0
               ) -> dict[str, list[str]]:
    """adapter name -> pods that keep it GPU-resident (see reconcile.py's docstring for the policy)."""
    load = {w.pod: 0 for w in workers}
    # A worker's own report of its adapter pool size wins; else the pool's spec.adapterMemory.gpuBytes.
    capacity = {w.pod: w.w.reported.pool_bytes or default_capacity or None for w in workers}
    sizes = {a.name: adapter_bytes(a, workers) for a in adapters}
    order = sorted(adapters, key=lambda a: (not a.pinned, -a.priority, -sizes[a.name], a.name))
    placement: dict[str, list[str]] = {}
    for a in order:
        size, n = sizes[a.name], warm_count(a, len(workers))
        if n == 0:
            placement[a.name] = []
            continue

        def holds(w: WorkerIndex, a: AdapterSpec = a) -> bool:
            st = w.find(a.name, a.version)
            pushed = w.pushed.get(a.name)
            return (st is not None and st.tier == "gpu") or (pushed is not None and pushed.warm)

        def fits(w: WorkerIndex, size: int = size) -> bool:
            return capacity[w.pod] is None or load[w.pod] + size <= capacity[w.pod]

        candidates = sorted((w for w in workers if fits(w)), key=lambda w: (not holds(w), load[w.pod], w.pod))
        chosen = [w.pod for w in candidates[:n]]
        for pod in chosen:
            load[pod] += size
        placement[a.name] = sorted(chosen)
    return placement
