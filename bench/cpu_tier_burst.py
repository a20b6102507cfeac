"""A burst of requests for distinct cold adapters while every GPU slot is busy: the host memory the CPU tier
takes and how long each request waits, with reads for the GPU paced by the CPU budget (`paced`, each
waiting tenant keeping to its share: worker/adapter_loading.py) and without (`unpaced`, every image read at
once, how the pool read them before).

A synthetic engine loop: every step (`--step-ms`) the pool is polled and every request still waiting asks for
its adapter (`acquire`, as the scheduler does for the sequences it would admit); a request that gets its slot
runs `--run-steps` steps, then gives it back. All requests arrive at once, tenant after tenant, each tenant
asking for `--per-tenant` distinct adapters. A read takes the adapter's bytes at `--disk-gbps` (a sleep: the
disk), then packs it into the pool's host arena (real, page-locked on GPU hosts), then the GPU copy. Each way
runs in a process of its own, so torch's pinned cache starts empty.

    python bench/cpu_tier_burst.py --out bench/results            # Llama-3-8B shapes (GPU host)
    python bench/cpu_tier_burst.py --small                        # a quick check, also on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from lorafleet.worker.page_pool import PagePool, PagePoolConfig  # noqa: E402
from lorafleet.worker.read_room import ReadRoom  # noqa: E402
from tests.lora_factory import random_weights  # noqa: E402


def run_one(args) -> dict:
    shape = SMALL if args.small else LLAMA3_8B
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = random_weights(0, rank=args.rank, dims=shape.dims, dtype=torch.bfloat16, std=0.01)  # one for all
    nbytes = sum(t.numel() * t.element_size() for m in weights.modules.values() for t in (m.a, m.b))
    per_adapter = -(-nbytes // (shape.page_elems * 2)) + 2 * shape.layers
    pages = PagePool(PagePoolConfig(num_pages=args.slots * per_adapter, page_elems=shape.page_elems,
                                    dtype=torch.bfloat16, device=str(device)))
    budget = int(args.budget_images * nbytes)
    pool = AdapterPool(pages, shape.dims, AdapterPoolConfig(max_slots=args.slots, max_rank=args.rank,
                                                            cpu_budget_bytes=budget, num_load_threads=2))
    if args.mode == "unpaced":  # as before the pacing (this process only): every read starts at once, and the
        ReadRoom.may_read = lambda self, group, nbytes, first_read=False: True  # trim does not count reads under way
        AdapterPool._reading_bytes = lambda self: 0
    read_s = nbytes / (args.disk_gbps * 1e9)

    def read():
        time.sleep(read_s)
        return weights

    requests = []  # (key, tenant)
    for t in range(args.tenants):
        for i in range(args.per_tenant):
            key = f"t{t}a{i}@1"
            pool.add(key, loader=read, tenant=f"t{t}")
            requests.append((key, f"t{t}"))
    start = time.perf_counter()
    waiting = dict(requests)
    running: dict[str, list] = {}  # key -> [slot, steps left]
    waited: dict[str, float] = {}
    peak = {"images": 0, "used": 0, "reserved": 0, "pinned": 0.0}
    step = 0
    while waiting or running:
        pool.poll()
        for key in list(running):
            running[key][1] -= 1
            if running[key][1] <= 0:
                pool.release(running.pop(key)[0])
        for key, tenant in list(waiting.items()):
            slot = pool.acquire(key, key, tenant=tenant)
            if slot is not None:
                running[key] = [slot, args.run_steps]
                waited[key] = time.perf_counter() - start
                del waiting[key]
        stats = pool.stats()
        peak["images"] = max(peak["images"], stats["bytes"]["cpu"])
        peak["used"] = max(peak["used"], stats["host_bytes"]["used"])
        peak["reserved"] = max(peak["reserved"], stats["host_bytes"]["reserved"])
        if device.type == "cuda":
            peak["pinned"] = max(peak["pinned"], pinned_bytes())
        step += 1
        if step % 50 == 0:
            print(f"{args.mode} step {step}: {len(waiting)} waiting, {len(running)} running, images "
                  f"{stats['bytes']['cpu'] / 2**30:.2f} GiB, reads waiting {stats['reads_waiting']}", flush=True)
        time.sleep(args.step_ms / 1000)
    total = time.perf_counter() - start
    pool.close()
    waits = sorted(waited.values())
    return {"mode": args.mode, "image_bytes": nbytes, "budget_bytes": budget, "read_s": read_s, "total_s": total,
            "steps": step, "wait_s": {"p50": statistics.median(waits), "p90": waits[int(0.9 * (len(waits) - 1))],
                                      "max": waits[-1], "mean": statistics.fmean(waits)},
            "waits": waited, "peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--per-tenant", type=int, default=12, help="distinct adapters each tenant asks for")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8, help="GPU slots")
    ap.add_argument("--budget-images", type=float, default=12.0, help="the CPU budget, in images")
    ap.add_argument("--run-steps", type=int, default=50, help="steps a request holds its adapter")
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--disk-gbps", type=float, default=2.0, help="read speed of an adapter's files")
    ap.add_argument("--small", action="store_true", help="a small model's shapes (a quick check, also on CPU)")
    ap.add_argument("--mode", choices=("paced", "unpaced"), help="run one way in this process (the script runs both)")
    ap.add_argument("--out", default=None, help="folder for the JSON")
    args = ap.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    argv = [a for k, v in vars(args).items() if k not in ("mode", "out", "small") for a in (f"--{k.replace('_', '-')}", str(v))]
    results = run_in_processes(__file__, ("unpaced", "paced"), argv + (["--small"] if args.small else []))
    mib = 1 << 20
    first = results["paced"]
    print(f"\n{args.tenants} tenants x {args.per_tenant} cold adapters (rank {args.rank}, {first['image_bytes'] / mib:.1f} MiB "
          f"each, read {first['read_s'] * 1000:.1f} ms), {args.slots} GPU slots, budget {first['budget_bytes'] / mib:.0f} MiB")
    print(f"{'reads':>8} {'images peak MiB':>16} {'host used MiB':>14} {'reserved MiB':>13} {'pinned MiB':>11} "
          f"{'wait p50 s':>11} {'p90 s':>7} {'max s':>7} {'all served s':>13}")
    for mode, r in results.items():
        p, w = r["peak_bytes"], r["wait_s"]
        print(f"{mode:>8} {p['images'] / mib:16.0f} {p['used'] / mib:14.0f} {p['reserved'] / mib:13.0f} "
              f"{p['pinned'] / mib:11.0f} {w['p50']:11.2f} {w['p90']:7.2f} {w['max']:7.2f} {r['total_s']:13.2f}")
    if args.out:
        write_gpu_run(args.out, "cpu_tier_burst", args, results)


if __name__ == "__main__":
    main()
