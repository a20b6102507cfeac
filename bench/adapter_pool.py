"""Adapter pool benchmark: tier load latencies, a Zipf workload, and what loads cost the decode step.

    python bench/adapter_pool.py                        # GPU: Llama-3-8B shapes; CPU: a small model
    python bench/adapter_pool.py --out bench/results    # also writes adapter_pool_<date>_<device>.json

Sections (figures, not assertions):
* h2d: copy bandwidth of one 84 MB buffer host->device from pinned and from pageable memory.
* warm_load: an 84 MB adapter (Llama-3-8B shape, r=16, all seven projections) already in the pinned
  CPU tier copied into the page pool (pages contiguous, and scattered over a fragmented pool): copy
  time from CUDA events on the side stream, and acquire-to-resident wall time; bandwidth / pinned h2d.
* cold_load: the same adapter from a PEFT directory on local disk (parse + pack into pinned pages).
* zipf: requests over 64 adapters (Zipf s=1.1, ranks 8/16, all projections), GPU slots and a CPU
  tier that hold a fraction; per tier (hot / warm / cold at arrival) P50/P99 of arrival-to-slot time
  and hit rates. Each tick runs one decode step, as the engine's step loop would.
* decode_step: a synthetic decode step (every layer's base GEMMs, the LoRA kernels over the pool's
  layout for 64 tokens of 8 adapters, paged attention over the same pool's KV pages) timed alone
  and while cold and warm loads run in the background (loader threads + side-stream copies); on a GPU
  both replayed from a CUDA graph, as the engine runs decode steps, and eagerly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from adapter_pool_setup import LLAMA3_8B, SMALL, Bench, random_weights, write_peft  # same folder

from lorafleet.worker.adapter_pool import AdapterPool
from lorafleet.worker.peft_adapter import load_peft_adapter


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] if xs else float("nan")


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": 1e3 * pct(xs, 50), "p99_ms": 1e3 * pct(xs, 99),
            "mean_ms": 1e3 * statistics.fmean(xs) if xs else float("nan")}


# ---- sections ---------------------------------------------------------------------------------------------
def bench_h2d(nbytes: int, device: torch.device, reps: int = 10) -> dict:
    if device.type != "cuda":
        return {}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for kind, src in (("pinned", torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)),
                      ("pageable", torch.ones(nbytes, dtype=torch.uint8))):
        times = []
        for i in range(reps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
        out[kind] = {"bytes": nbytes, "median_s": statistics.median(times),
                     "GBps": nbytes / statistics.median(times) / 1e9}
    return out


def bench_warm_load(b: Bench, weights, reps: int = 10) -> dict:
    pool = b.pool
    pool.add("warm84@1", weights)  # packed into the pinned CPU tier now
    image = pool.entry("warm84@1").image
    res = {"adapter_bytes": image.nbytes, "pages": image.num_pages, "fragmentation": 1 - image.used_elems / (
        image.num_pages * b.page_pool.page_elems)}
    for layout in ("contiguous", "scattered"):
        hold = []
        if layout == "scattered":  # fragment the pool: every other free page taken by a KV owner
            free = b.page_pool.num_free
            for i in range(min(free // 2, image.num_pages + 8)):
                hold += b.page_pool.allocate(1, ("kv", f"frag{i}"))
                b.page_pool.allocate(1, ("kv", f"frag-gap{i}"))
            for i in range(min(free // 2, image.num_pages + 8)):
                b.page_pool.free_owner(("kv", f"frag-gap{i}"))
        copies, walls, runs = [], [], []
        for rep in range(reps + 1):
            slot, wall = b.wait_resident("warm84@1", waiter=f"{layout}{rep}")
            e = pool.entry("warm84@1")
            runs.append(len(_runs(e.page_ids)))
            if rep:
                copies.append(e.copy_seconds)
                walls.append(wall)
            pool.release(slot)
            pool.evict("warm84@1", "gpu")
        for pid in hold:
            b.page_pool.free([pid])
        copy_s = statistics.median(copies)
        res[layout] = {"copy_median_s": copy_s, "copy_GBps": image.nbytes / copy_s / 1e9,
                       "acquire_to_resident": summary(walls), "copy_runs": statistics.median(runs)}
    return res


def _runs(page_ids: list[int]) -> list[int]:
    return [p for i, p in enumerate(page_ids) if i == 0 or page_ids[i - 1] + 1 != p]


def bench_cold_load(b: Bench, path: Path, reps: int = 3) -> dict:
    pool, mc = b.pool, b.mc
    walls, parse = [], []
    for rep in range(reps):
        key = f"cold{rep}@1"
        pool.add(key, loader=lambda: load_peft_adapter(path, mc, dtype=b.dtype, strict_base="off"))
        slot, wall = b.wait_resident(key, waiter=key)
        walls.append(wall)
        parse.append(pool.entry(key).load_seconds)
        pool.release(slot)
        pool.unregister(f"cold{rep}")
    return {"acquire_to_resident": summary(walls), "disk_to_pinned_cpu": summary(parse)}


def bench_zipf(b: Bench, dirs: list[Path], *, num_adapters: int, num_requests: int, hold_ticks: int) -> dict:
    pool, mc = b.pool, b.mc
    for i in range(num_adapters):
        d = dirs[i % len(dirs)]
        pool.add(f"z{i}@1", loader=lambda d=d: load_peft_adapter(d, mc, dtype=b.dtype, strict_base="off"))
    rng = random.Random(0)
    weights = [1.0 / (k + 1) ** 1.1 for k in range(num_adapters)]
    perm = list(range(num_adapters))
    rng.shuffle(perm)
    picks = [perm[k] for k in rng.choices(range(num_adapters), weights=weights, k=num_requests)]
    before = pool.stats()
    latency: dict[str, list[float]] = {"hot": [], "warm": [], "cold": []}
    waiting: list[tuple[str, int, str, float]] = []
    running: list[tuple[int, int]] = []
    base_slots = torch.full((b.batch,), -1, dtype=torch.int32, device=b.device)
    for tick in range(num_requests + 10_000):
        if tick < num_requests:
            key = f"z{picks[tick]}@1"
            e = pool.entry(key)
            tier = "hot" if e.resident else ("warm" if e.image is not None or e.copying is not None else "cold")
            waiting.append((key, tick, tier, time.perf_counter()))
        still = []
        for key, rid, tier, t0 in waiting:
            slot = pool.acquire(key, waiter=rid)
            if slot is None:
                still.append((key, rid, tier, t0))
            else:
                latency[tier].append(time.perf_counter() - t0)
                running.append((slot, hold_ticks))
        waiting = still
        b.step(base_slots)  # the step loop's time passes while loads run
        for slot, _ in [r for r in running if r[1] == 1]:
            pool.release(slot)
        running = [(s, n - 1) for s, n in running if n > 1]
        if tick >= num_requests and not waiting:
            break
    for slot, _ in running:
        pool.release(slot)
    after = pool.stats()
    hits = {t: after["hits"][t] - before["hits"][t] for t in ("gpu", "cpu")}
    misses = {t: after["misses"][t] - before["misses"][t] for t in ("gpu", "cpu")}
    return {
        "num_adapters": num_adapters, "num_requests": num_requests, "gpu_slots": pool.config.max_slots,
        "cpu_budget_bytes": pool.config.cpu_budget_bytes,
        "hit_rate": {t: hits[t] / max(1, hits[t] + misses[t]) for t in hits},
        "requests_by_tier": {t: len(v) for t, v in latency.items()},
        "arrival_to_slot": {t: summary(v) for t, v in latency.items()},
        "pool_load_seconds": {"cpu": summary(_loads(pool, "cpu")), "gpu": summary(_loads(pool, "gpu"))},
        "evictions": after["evictions"],
    }


def _loads(pool: AdapterPool, tier: str) -> list[float]:
    return [e.load_seconds if tier == "cpu" else e.copy_seconds for e in (pool.entry(k) for k in pool.registered())
            if (e.load_seconds if tier == "cpu" else e.copy_seconds) > 0]


def bench_decode_step(b: Bench, weights16, cold_dir: Path, *, steps: int, num_step_adapters: int, min_loads: int = 3) -> dict:
    pool, mc = b.pool, b.mc
    step_keys = [f"step{i}@1" for i in range(num_step_adapters)]
    for i, key in enumerate(step_keys):
        pool.add(key, weights16[i % len(weights16)], pinned=True)
        pool.load(key)
    slots = [pool.acquire(k) for k in step_keys]
    token_slots = torch.tensor([slots[t % len(slots)] for t in range(b.batch)], dtype=torch.int32, device=b.device)
    bg = []
    for i in range(2):
        pool.add(f"bgwarm{i}@1", weights16[(i + 1) % len(weights16)])
        bg.append((f"bgwarm{i}@1", "warm"))
        pool.add(f"bgcold{i}@1", loader=lambda: load_peft_adapter(cold_dir, mc, dtype=b.dtype, strict_base="off"))
        bg.append((f"bgcold{i}@1", "cold"))
    for _ in range(5):
        b.step(token_slots)

    def run(with_loads: bool, graph: bool) -> tuple[list[float], dict]:
        """`steps` steps; with loads, on until `min_loads` warm and `min_loads` cold loads completed."""
        times, done, k = [], {"warm": 0, "cold": 0}, 0
        current = None
        while len(times) < steps or (with_loads and min(done.values()) < min_loads and len(times) < 100 * steps):
            t0 = time.perf_counter()
            pool.poll()  # what the engine's scheduler does each step (acquire polls)
            if with_loads:
                if current is not None and pool.entry(current[0]).resident:
                    done[current[1]] += 1
                    key, kind = current
                    pool.evict(key, "gpu")
                    if kind == "cold":
                        pool.evict(key, "cpu")
                    current = None
                if current is None:
                    current = bg[k % len(bg)]
                    k += 1
                    pool.prefetch(current[0], "gpu")
            b.step(token_slots, graph=graph)
            times.append(time.perf_counter() - t0)
        if current is not None:  # let the last background load finish before the next measurement
            while not pool.entry(current[0]).resident:
                pool.wait_idle(timeout=60)
                pool.poll()
            pool.evict(current[0], "gpu")
        return times, done

    out = {"batch_tokens": b.batch, "adapters_in_batch": num_step_adapters, "context": b.context}
    for mode in ("cuda_graph", "eager") if b.device.type == "cuda" else ("eager",):
        graph = mode == "cuda_graph"
        for _ in range(30):  # the GPU's clocks settle before the first timed step
            b.step(token_slots, graph=graph)
        base, _ = run(False, graph)
        loaded, done = run(True, graph)
        base2, _ = run(False, graph)  # again, so drift of the machine shows
        baseline = base + base2
        out[mode] = {
            "without_loads": summary(baseline), "with_loads": summary(loaded), "loads_completed": done,
            "ratio_mean": statistics.fmean(loaded) / statistics.fmean(baseline),
            "ratio_p50": pct(loaded, 50) / pct(baseline, 50),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="directory for the JSON result")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--zipf-requests", type=int, default=300)
    parser.add_argument("--only", choices=["all", "decode"], default="all",
                        help="decode: only the decode-step section, once per loader setting")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = LLAMA3_8B if cuda else SMALL
    dtype = torch.bfloat16 if cuda else torch.float32
    batch, context = (64, 512) if cuda else (8, 64)
    t_start = time.perf_counter()
    result: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                    "shape": shape.__dict__, "dtype": str(dtype)}
    w16 = [random_weights(shape, 16, s, dtype, device) for s in range(3)]
    adapter_bytes = w16[0].nbytes
    result["adapter_r16_all7_bytes"] = adapter_bytes
    result["h2d"] = bench_h2d(adapter_bytes, device)
    print(json.dumps({"h2d": result["h2d"]}), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_peft(Path(tmp) / f"a{i}", shape, (8, 16)[i % 2], i, dtype, device) for i in range(6)]
        per_page = shape.page_elems * torch.tensor([], dtype=dtype).element_size()
        adapter_pages = -(-adapter_bytes // per_page) + 2
        kv_pages = batch * -(-context // shape.block_size)
        if args.only == "decode":
            result["decode_step_by_loader_setting"] = {}
            variants = {"loader_cpu_threads=all": ({"loader_cpu_threads": None}, None),
                        "loader_cpu_threads=1": ({"loader_cpu_threads": 1}, None),
                        "loader_cpu_threads=1,switchinterval=0.2ms": ({"loader_cpu_threads": 1}, 2e-4)}
            default_interval = sys.getswitchinterval()
            for name, (pool_kw, interval) in variants.items():
                sys.setswitchinterval(interval or default_interval)
                b = Bench(shape, device, dtype, num_pages=kv_pages + 14 * adapter_pages, max_slots=13,
                          cpu_budget=12 * adapter_bytes, batch=batch, context=context, pool_kw=pool_kw)
                res = bench_decode_step(b, w16, dirs[1], steps=args.steps, num_step_adapters=8)
                res["main_thread_torch_threads"] = torch.get_num_threads()
                result["decode_step_by_loader_setting"][name] = res
                print(json.dumps({name: res}), flush=True)
                for key in list(b.pool.registered()):
                    b.pool.unpin(key)
                b.pool.close()
                del b
            sys.setswitchinterval(default_interval)
            return _write(result, args, cuda, device, t_start)
        b = Bench(shape, device, dtype, num_pages=kv_pages + 14 * adapter_pages, max_slots=13,
                  cpu_budget=12 * adapter_bytes, batch=batch, context=context)
        result["page_pool"] = {"num_pages": b.page_pool.num_pages, "page_bytes": per_page, "kv_pages": kv_pages}
        result["warm_load"] = bench_warm_load(b, w16[0])
        if cuda:
            pinned = result["h2d"]["pinned"]["GBps"]
            for layout in ("contiguous", "scattered"):
                result["warm_load"][layout]["fraction_of_pinned_h2d"] = result["warm_load"][layout]["copy_GBps"] / pinned
        print(json.dumps({"warm_load": result["warm_load"]}), flush=True)
        result["cold_load"] = bench_cold_load(b, dirs[1])
        print(json.dumps({"cold_load": result["cold_load"]}), flush=True)
        result["decode_step"] = bench_decode_step(b, w16, dirs[1], steps=args.steps, num_step_adapters=8)
        print(json.dumps({"decode_step": result["decode_step"]}), flush=True)
        for key in list(b.pool.registered()):
            b.pool.unpin(key)
        b.pool.close()
        del b
        z = Bench(shape, device, dtype, num_pages=kv_pages + 12 * adapter_pages, max_slots=12,
                  cpu_budget=10 * adapter_bytes, batch=batch, context=context)
        result["zipf"] = bench_zipf(z, dirs, num_adapters=64, num_requests=args.zipf_requests, hold_ticks=8)
        print(json.dumps({"zipf": result["zipf"]}), flush=True)
        z.pool.close()
    _write(result, args, cuda, device, t_start)


def _write(result: dict, args, cuda: bool, device: torch.device, t_start: float) -> None:
    result["wall_s"] = time.perf_counter() - t_start
    if args.out:
        name = "h200" if cuda and "H200" in result["device"] else device.type
        suffix = "" if args.only == "all" else f"_{args.only}"
        path = Path(args.out) / f"adapter_pool_{datetime.date.today().isoformat()}_{name}{suffix}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
