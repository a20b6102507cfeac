"""How long one pure reconcile pass takes, and how evenly `warm` placement spreads GPU bytes.

    python bench/operator_reconcile.py [--adapters 1000] [--workers 16] [--repeat 5]

Adapters get Zipf-like sizes (20-100 MB) and warm counts (a few hot ones on many workers, a long tail
on demand); workers report everything converged, so the pass measures steady-state cost.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec
from lorafleet.operator.reconcile import WorkerReport, reconcile_pool
from lorafleet.worker.directives import AdapterState, ReportedState

MB = 1 << 20


def build(num_adapters: int, num_workers: int, seed: int = 0):
    rng = random.Random(seed)
    pool = PoolSpec.parse({"metadata": {"name": "p", "namespace": "ns"},
                           "spec": {"baseModel": "m", "workerSelector": {"matchLabels": {"a": "b"}}}})
    adapters = []
    for i in range(num_adapters):
        warm = max(0, int(num_workers / (1 + i) ** 0.7)) if i < num_adapters // 5 else 0
        size = rng.randint(20, 100) * MB
        adapters.append(AdapterSpec.parse({
            "metadata": {"name": f"a{i}", "namespace": "ns", "creationTimestamp": f"{i:08d}"},
            "spec": {"pool": "p", "tenant": f"t{i % 50}", "baseModel": "m", "version": "v1",
                     "source": {"uri": f"s3://b/a{i}/v1/"}, "warm": warm, "priority": rng.randint(0, 3)},
            "status": {"bytes": size}}))
    workers = [WorkerReport(f"w{j:02d}", ReportedState(pool_bytes=40 << 30)) for j in range(num_workers)]
    return pool, adapters, workers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    pool, adapters, workers = build(args.adapters, args.workers)
    plan = reconcile_pool(pool, adapters, workers, now="t")
    # Converge: every worker reports exactly what it was told.
    for w in workers:
        d = plan.desired[w.pod]
        w.last_pushed = d
        w.reported = ReportedState(generation_applied=d.generation, pool_bytes=40 << 30, adapters=[
            AdapterState(a.name, a.stable.version, "gpu" if a.warm else "disk", bytes=50 * MB) for a in d.adapters])
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        plan = reconcile_pool(pool, adapters, workers, now="t")
        times.append(time.perf_counter() - t0)
    sizes = {a.name: a.known_bytes for a in adapters}
    load = {w.pod: 0 for w in workers}
    for name, pods in plan.placement.items():
        for p in pods:
            load[p] += sizes[name]
    result = {
        "adapters": args.adapters, "workers": args.workers,
        "steady_state_pass_ms_median": round(statistics.median(times) * 1000, 1),
        "pushes_in_steady_state": len(plan.pushes),
        "warm_placements": sum(len(p) for p in plan.placement.values()),
        "gpu_bytes_per_worker_mean_mb": round(statistics.mean(load.values()) / MB, 1),
        "gpu_bytes_spread_max_minus_min_mb": round((max(load.values()) - min(load.values())) / MB, 1),
        "ready_adapters": sum(s["phase"] == "Ready" for s in plan.adapter_statuses.values()),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
