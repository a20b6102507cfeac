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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from lorafleet.kernels.attention import paged_attention_decode
from lorafleet.kernels.lora_layout import PROJS, LoRABatch, make_lora_batch
from lorafleet.worker.adapter_image import ModelDims
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.cuda_graphs import group_by_slot
from lorafleet.worker.lora_linear import lora_linear
from lorafleet.worker.model_config import ModelConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig, kv_page_elems
from lorafleet.worker.peft_adapter import load_peft_adapter

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16

    @property
    def dims(self) -> ModelDims:
        return ModelDims(self.layers, self.hidden, self.inter, self.heads * self.head_dim, self.kv_heads * self.head_dim)

    @property
    def page_elems(self) -> int:
        return kv_page_elems(num_layers=self.layers, block_size=self.block_size, num_kv_heads=self.kv_heads,
                             head_dim=self.head_dim)

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=1024, hidden_size=self.hidden, intermediate_size=self.inter,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim, name="synthetic")


LLAMA3_8B = Shape("llama3-8b", 32, 4096, 14336, 32, 8, 128)
SMALL = Shape("small", 4, 512, 1024, 8, 2, 64)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] if xs else float("nan")


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": 1e3 * pct(xs, 50), "p99_ms": 1e3 * pct(xs, 99),
            "mean_ms": 1e3 * statistics.fmean(xs) if xs else float("nan")}


def write_peft(path: Path, shape: Shape, rank: int, seed: int, dtype: torch.dtype, device: torch.device) -> Path:
    """A PEFT-format adapter directory (all seven projections) with random weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(shape.layers):
        for proj in PROJS:
            fan_in, fan_out = shape.dims.in_out(proj)
            base = f"base_model.model.model.layers.{layer}.{PARENT[proj]}.{proj}"
            tensors[f"{base}.lora_A.weight"] = (0.01 * torch.randn(rank, fan_in, generator=g, device=device)).to(dtype).cpu()
            tensors[f"{base}.lora_B.weight"] = (0.01 * torch.randn(fan_out, rank, generator=g, device=device)).to(dtype).cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJS), "bias": "none",
        "base_model_name_or_path": "synthetic", "task_type": "CAUSAL_LM"}))
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the pool and a synthetic decode step over it ---------------------------------------------------------
class Bench:
    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, *, num_pages: int, max_slots: int,
                 cpu_budget: int, batch: int, context: int, pool_kw: dict | None = None) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        self.page_pool = PagePool(PagePoolConfig(num_pages=num_pages, page_elems=shape.page_elems, dtype=dtype,
                                                 device=str(device)))
        self.pool = AdapterPool(self.page_pool, shape.dims, AdapterPoolConfig(
            max_slots=max_slots, max_rank=16, cpu_budget_bytes=cpu_budget, num_load_threads=2, **(pool_kw or {})))
        self.mc = shape.model_config()
        s = shape
        g = torch.Generator(device=device).manual_seed(0)

        def w(o, i):
            return (torch.randn(o, i, generator=g, device=device) / math.sqrt(i)).to(dtype)

        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        # One layer's weights, reused by every layer: the same bytes are read per layer as in a real model.
        self.w_qkv, self.w_o = w(q + 2 * kv, s.hidden), w(s.hidden, q)
        self.w_gu, self.w_down = w(2 * s.inter, s.hidden), w(s.hidden, s.inter)
        self.batch, self.context = batch, context
        blocks = -(-context // s.block_size)
        self.block_tables = torch.tensor([self.page_pool.allocate(blocks, ("kv", b)) for b in range(batch)],
                                         dtype=torch.int32, device=device)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.kv = self.page_pool.kv_caches(num_layers=s.layers, block_size=s.block_size, num_kv_heads=s.kv_heads,
                                           head_dim=s.head_dim)
        self.x0 = torch.randn(batch, s.hidden, generator=g, device=device).to(dtype)
        self._graph: torch.cuda.CUDAGraph | None = None
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None  # LoRA beside the GEMMs

    def step(self, token_slots: torch.Tensor, *, graph: bool = False) -> None:
        """One decode step of `batch` tokens; token_slots: int32 [batch] adapter slot per token.

        graph=False: eager. graph=True: replayed from a CUDA graph as the engine runs decode steps
        (worker/cuda_graphs.py: segments padded to one per token, the pool's max rank as bound).
        """
        if not graph:
            self._layers(make_lora_batch(token_slots, self.pool.layout.max_rank_by_slot(), max_segment_len=16))
        elif self.device.type != "cuda":
            raise ValueError("graph steps need a CUDA device")
        else:
            if self._graph is None:
                self._capture()
            ids, starts, seg_slots = group_by_slot(token_slots.tolist(), 16)
            n = self.batch
            host = torch.tensor([*token_slots.tolist(), *ids, *[0] * (n - len(ids)), *seg_slots, *[-1] * (n - len(seg_slots)),
                                 *starts, *[starts[-1]] * (n + 1 - len(starts))], dtype=torch.int32)
            self._lora_buf.copy_(host, non_blocking=True)
            self._graph.replay()
        sync(self.device)

    def _capture(self) -> None:
        lay = self.pool.layout
        n = self.batch
        self._lora_buf = torch.zeros(4 * n + 1, dtype=torch.int32, device=self.device)  # slots, ids, seg slots, starts
        self._lora_buf[: n].fill_(-1)
        self._lora_buf[2 * n : 3 * n].fill_(-1)
        buf = self._lora_buf
        lora = LoRABatch(token_slots=buf[:n], sorted_token_ids=buf[n : 2 * n], seg_starts=buf[3 * n :],
                         seg_slots=buf[2 * n : 3 * n], max_rank=lay.max_rank)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._layers(lora)  # compiles the kernels before capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._layers(lora)

    def _layers(self, lora: LoRABatch) -> None:
        """Every layer as the engine runs it: base GEMMs with their LoRA deltas (worker/lora_linear.py),
        paged decode attention over the pool's KV pages."""
        s = self.shape
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        ctx = SimpleNamespace(lora=lora, lora_layout=self.pool.layout, backend="auto", lora_stream=self.side)
        x = self.x0
        attn = torch.empty(self.batch, s.heads, s.head_dim, dtype=self.dtype, device=self.device)
        for layer in range(s.layers):
            qkv = lora_linear(x, self.w_qkv, ctx, layer, [0, 1, 2], [0, q_size, q_size + kv_size])
            k_cache, v_cache = self.kv[layer]
            paged_attention_decode(q=qkv[:, :q_size].reshape(self.batch, s.heads, s.head_dim), k_cache=k_cache,
                                   v_cache=v_cache, block_tables=self.block_tables, context_lens=self.context_lens,
                                   scale=s.head_dim ** -0.5, out=attn)
            x = x + lora_linear(attn.reshape(self.batch, q_size), self.w_o, ctx, layer, [3], [0])
            gu = lora_linear(x, self.w_gu, ctx, layer, [4, 5], [0, s.inter])
            act = torch.nn.functional.silu(gu[:, : s.inter]) * gu[:, s.inter :]
            x = x + lora_linear(act, self.w_down, ctx, layer, [6], [0])

    def wait_resident(self, key: str, waiter: object) -> tuple[int, float]:
        """Acquire `key`, polling like a step loop would, until resident; (slot, seconds)."""
        t0 = time.perf_counter()
        while (slot := self.pool.acquire(key, waiter=waiter)) is None:
            self.pool.wait_idle(timeout=600)
        return slot, time.perf_counter() - t0


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


def random_weights(shape: Shape, rank: int, seed: int, dtype: torch.dtype, device: torch.device):
    from lorafleet.worker.peft_adapter import LoRAWeights, ModuleLoRA

    g = torch.Generator(device=device).manual_seed(seed)
    modules = {}
    for layer in range(shape.layers):
        for proj in PROJS:
            fan_in, fan_out = shape.dims.in_out(proj)
            a = (0.01 * torch.randn(rank, fan_in, generator=g, device=device)).to(dtype).cpu()
            bm = (0.01 * torch.randn(fan_out, rank, generator=g, device=device)).to(dtype).cpu()
            modules[(layer, proj)] = ModuleLoRA(a=a, b=bm, scale=2.0)
    nbytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    return LoRAWeights(name=f"r{seed}", version="1", base_model="synthetic", modules=modules, nbytes=nbytes)


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
