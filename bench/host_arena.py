"""Host memory behind the CPU tier: an adapter pool at a byte budget, loading adapters of mixed ranks in a
random order through the CPU tier to the GPU, with its images in the pool's `HostArena` (`arena`) or each
in a page-locked tensor of its own from torch's pinned allocator (`own`, how images were held before the
arena). Each way runs in a process of its own, so that torch's pinned cache starts empty.

The floor is the most image bytes the tier held at once (its budget, and an image read before the trim).
Reported: the page-locked bytes torch's allocator holds (`torch.cuda.host_memory_stats`), their peak, the
arena's own figures, and the copy bandwidth of each way (an image split over slabs is copied run by run).

    python bench/host_arena.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter_pool_setup import LLAMA3_8B, SMALL  # noqa: E402
from bench_io import run_in_processes, write_gpu_run  # noqa: E402

from lorafleet.worker.adapter_metrics import pinned_bytes  # noqa: E402
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig  # noqa: E402
from lorafleet.worker.host_arena import HostPages  # noqa: E402
from lorafleet.worker.page_pool import PagePool, PagePoolConfig  # noqa: E402
from tests.lora_factory import random_weights  # noqa: E402


def pinned_stats() -> dict[str, int]:
    """torch's pinned allocator's byte figures, as it names them, for the JSON."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {k: int(v) for k, v in stats.items() if "bytes" in k and k.endswith((".current", ".peak"))}


def run_one(args) -> dict:
    shape = SMALL if args.small else LLAMA3_8B
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = [int(r) for r in args.ranks.split(",")]
    budget = int(args.budget_gib * (1 << 30))
    max_pages = -(-2 * max(ranks) * (3 * shape.hidden + 2 * shape.kv_heads * shape.head_dim + 3 * shape.inter)
                  * shape.layers * 2 // (shape.page_elems * 2)) + 2 * shape.layers
    pages = PagePool(PagePoolConfig(num_pages=args.slots * max_pages, page_elems=shape.page_elems,
                                    dtype=torch.bfloat16, device=str(device)))
    pool = AdapterPool(pages, shape.dims, AdapterPoolConfig(max_slots=args.slots, max_rank=max(ranks),
                                                            cpu_budget_bytes=budget, num_load_threads=2))
    if args.mode == "own":  # each image in a pinned tensor of its own, as before the arena
        pool._arena.allocate = lambda n: HostPages.standalone(n, shape.page_elems, torch.bfloat16, pin=pool._pin)
    rng = random.Random(args.seed)
    names = [f"a{i}" for i in range(args.adapters)]
    rank_of = {name: ranks[i % len(ranks)] for i, name in enumerate(names)}
    cache: dict[str, object] = {}

    def loader(name: str):
        def read():
            if name not in cache:
                cache[name] = random_weights(int(name[1:]), rank=rank_of[name], dims=shape.dims, dtype=torch.bfloat16,
                                             std=0.01)
            return cache[name]
        return read

    for name in names:
        pool.add(f"{name}@1", loader=loader(name))
    rows, copies, gpu_loads = [], [], 0
    for step in range(args.loads):
        name = rng.choice(names)
        t0 = time.perf_counter()
        pool.load(f"{name}@1", timeout=600)
        entry = pool.entry(f"{name}@1")
        stats = pool.stats()
        if stats["loads"]["gpu"] > gpu_loads and entry.copy_seconds:  # this load copied it to the GPU
            copies.append(entry.gpu_bytes / entry.copy_seconds / 1e9)
        gpu_loads = stats["loads"]["gpu"]
        pinned = pinned_stats()
        rows.append({"step": step, "adapter": name, "rank": rank_of[name], "seconds": time.perf_counter() - t0,
                     "tier_bytes": stats["bytes"]["cpu"], "host_bytes": stats["host_bytes"],
                     "pinned_held": pinned_bytes(), "pinned": pinned})
        print(f"{args.mode} {step:3d} {name} r={rank_of[name]:3d} tier {stats['bytes']['cpu'] / 2**30:6.2f} GiB "
              f"pinned {pinned_bytes() / 2**30:6.2f} GiB arena {stats['host_bytes']['reserved'] / 2**30:6.2f} GiB",
              flush=True)
    pool.close()
    final = pinned_stats()
    gbps = copies
    return {"mode": args.mode, "budget_bytes": budget, "peak_tier_bytes": max(r["tier_bytes"] for r in rows),
            "pinned_held_final": pinned_bytes(), "pinned_held_peak": pinned_bytes("peak"), "pinned_final": final,
            "copy_gbps_mean": sum(gbps) / len(gbps) if gbps else None, "copies_gbps": gbps, "steps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=1.0, help="the CPU tier's byte budget")
    ap.add_argument("--ranks", default="8,16,32,64", help="the adapters' ranks, in turn")
    ap.add_argument("--adapters", type=int, default=12)
    ap.add_argument("--loads", type=int, default=40)
    ap.add_argument("--slots", type=int, default=4, help="GPU slots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a small model's shapes (a quick check, also on CPU)")
    ap.add_argument("--mode", choices=("arena", "own"), help="run one way in this process (the script runs both)")
    ap.add_argument("--out", default=None, help="folder for the JSON")
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    results = run_in_processes(__file__, ("own", "arena"), [
        "--budget-gib", str(args.budget_gib), "--ranks", args.ranks, "--adapters", str(args.adapters), "--loads",
        str(args.loads), "--slots", str(args.slots), "--seed", str(args.seed)] + (["--small"] if args.small else []))
    gib = 1 << 30
    print(f"\nbudget {args.budget_gib:g} GiB, {args.loads} loads over {args.adapters} adapters of ranks {args.ranks}")
    print(f"{'images':>8} {'peak tier GiB':>14} {'pinned now GiB':>15} {'pinned peak GiB':>16} {'x floor':>8} {'copy GB/s':>10}")
    for mode, r in results.items():
        ratio = r["pinned_held_peak"] / r["peak_tier_bytes"] if r["peak_tier_bytes"] else float("nan")
        copy = f"{r['copy_gbps_mean']:.1f}" if r["copy_gbps_mean"] else "-"
        print(f"{mode:>8} {r['peak_tier_bytes'] / gib:14.2f} {r['pinned_held_final'] / gib:15.2f} "
              f"{r['pinned_held_peak'] / gib:16.2f} {ratio:8.2f} {copy:>10}")
    if args.out:
        write_gpu_run(args.out, "host_arena", args, results)


if __name__ == "__main__":
    main()
