"""Host memory the CPU tier really holds against its budget: torch's pinned allocator vs exact registrations.

    python bench/pinned_memory.py --out bench/results   # writes pinned_memory_<date>_<gpu>.json

An adapter pool with Llama-3-8B shapes in bfloat16 and a 1 GiB CPU budget loads 16 adapters of rank 13,
then 32 of rank 7 (two image sizes, as tenants' adapters are), each read into the CPU tier and copied to the
GPU. After each phase: the bytes the pool counts in its CPU tier (its metric) and what the process's
resident memory grew by since the pool was made (the floor: the budget). Each mode runs in a process of
its own: `torch` packs images with `pin_memory=True` (rounded up to a power of two, freed blocks kept for
reuse by size), `exact` with worker/pinned_memory.py (the image's own size, unmapped with it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
from types import SimpleNamespace

import torch
from bench_io import write_json  # same folder

PHASES = ((16, 13), (32, 7))  # (adapters, rank)
BUDGET = 1 << 30
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _weights(dims, seed: int, rank: int) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for layer in range(dims.num_layers):
        for proj in PROJS:
            fan_in, fan_out = dims.in_out(proj)
            modules[(layer, proj)] = SimpleNamespace(a=torch.randn(rank, fan_in, generator=gen).bfloat16(),
                                                     b=torch.randn(fan_out, rank, generator=gen).bfloat16(), scale=1.0)
    return SimpleNamespace(modules=modules, name=f"a{seed}")


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmRSS"))


def run_mode(mode: str) -> list[dict]:
    from lorafleet.worker import adapter_image
    from lorafleet.worker.adapter_image import ModelDims
    from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
    from lorafleet.worker.page_pool import PagePool, PagePoolConfig

    if mode == "torch":
        adapter_image.pinned_zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype, pin_memory=True)
    dims = ModelDims(32, 4096, 14336, 4096, 1024)
    pages = PagePool(PagePoolConfig(num_pages=20000, page_elems=16384, dtype=torch.bfloat16, device="cuda"))
    pool = AdapterPool(pages, dims, AdapterPoolConfig(max_slots=4, max_rank=64, cpu_budget_bytes=BUDGET,
                                                      num_load_threads=4))
    rows, n, baseline = [], 0, _rss_mib()
    for count, rank in PHASES:
        for _ in range(count):
            n += 1
            pool.add(f"a{n}@1", loader=functools.partial(_weights, dims, n, rank))
            pool.load(f"a{n}@1", timeout=300)
        pool.wait_idle()
        rows.append({"mode": mode, "after": f"{count} x rank {rank}", "pool_cpu_mib": pool.stats()["bytes"]["cpu"] >> 20,
                     "rss_growth_mib": _rss_mib() - baseline})
    pool.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    ap.add_argument("--mode", choices=("torch", "exact"), help=argparse.SUPPRESS)  # one mode, in a child
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode)))
        return
    rows = []
    for mode in ("torch", "exact"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, check=True)
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'mode':6} {'after':16} {'pool CPU MiB':>12} {'RSS growth MiB':>14}   (floor: the budget, {BUDGET >> 20} MiB)")
    for r in rows:
        print(f"{r['mode']:6} {r['after']:16} {r['pool_cpu_mib']:12} {r['rss_growth_mib']:14}")
    if args.out:
        name = torch.cuda.get_device_name()
        device = next((g.lower() for g in ("H200", "H100") if g in name), "gpu")
        write_json(args.out, "pinned_memory", datetime.date.today().isoformat(), device,
                   {"command": "python bench/pinned_memory.py --out bench/results", "budget_mib": BUDGET >> 20,
                    "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
