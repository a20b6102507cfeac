"""Kernel benchmark on one GPU at Llama-3-8B shapes: the LoRA delta of one decoder layer, paged attention.

    python bench/lora_kernels.py --out bench/results        # writes kernels_<date>_<gpu>.json and .png

LoRA: all seven projections of one layer (q|k|v, o, gate|up, down: four shrink/expand pairs) for T
tokens spread round-robin over A adapters (distinct adapters in the batch = min(T, A)), each adapter's
tokens cut into segments as the engine cuts a step of T tokens (16 tokens up to T=511, 32 up to 1023,
then 64: kernels.lora_layout.segment_len, bounded by --segment-len, default 64), ranks 8, 16,
64 or mixed {8, 16, 32, 64}; the delta as the engine computes it (expand in write mode, y = delta;
"triton_accumulate_us": adding into y), and for T >= 64 what it adds to the layer's GEMMs
("in_layer"); for T=64 and T=256 over 32 adapters, "graph_shaped_us": the same delta with the
batch a captured decode step replays in a pool of rank 64 (the engine's default --max-lora-rank) and
32 slots (segments are padded by the pool's slots: a pool of more slots pads more):
the rank bound and planning rank of the graph its adapters pick, segments padded to the most the step
can cut (worker/cuda_graphs.py); "graph_pool_bound_us": as graphs were before rank bounds (the
pool's rank, one segment per row). Floor = the distinct adapters' bytes / copy bandwidth measured in the same run;
moved floor = the same with the inputs each group reads and the deltas it writes (kernel_setup.activation_bytes). Triton
kernels are timed as CUDA-graph replays with the L2 flushed before each layer (the flush's own time
measured and subtracted); the baselines, for every case: the project's torch reference (gathers from the
paged layout, float32, eager: it synchronises with the host), a per-adapter loop (eager), and a torch
gather+bmm delta over slot-stacked bf16 weights (each token's A and B gathered, two bmm a projection),
timed both as a cold-L2 graph replay like the kernels and eagerly.
Base GEMMs: the layer's four fused matmuls, same method. Chain latency: eight dependent launches of
a one-load kernel (the layer's delta is eight dependent kernels), warm, with and without programmatic
dependent launch: the part of the delta no bandwidth removes. Structure floor (decode cases): the
same eight dependent kernels doing nothing but read the bytes their LoRA kernels read
(bench/kernel_floor.py), the best any eight-kernel design can do; also four kernels and one.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_io import device_tag  # same folder
from kernel_floor import chain_latency, structure_floor  # same folder
from kernel_setup import (  # same folder
    ADAPTERS,
    DIMS,
    DT,
    GROUPS,
    INTER,
    RANKS,
    TOKENS,
    LoRALayer,
    Timer,
    activation_bytes,
    adapter_bytes,
    build_layout,
    copy_bandwidth,
    recorded_command,
    widened,
)

from lorafleet.kernels.activation import silu_mul
from lorafleet.kernels.attention import paged_attention_prefill
from lorafleet.kernels.attention_triton import paged_attention_decode_triton, paged_attention_prefill_triton
from lorafleet.kernels.lora import lora_delta, lora_silu_mul, lora_xa
from lorafleet.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

ENGINE_MAX_RANK = 64  # the engine's default --max-lora-rank: the rank bound of its captured decode graphs


def torch_act(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """The MLP's activation as torch computes it: silu(gate) * up, two kernels and two roundings."""
    inter = out.shape[1]
    torch.mul(F.silu(gate_up[:, :inter]), gate_up[:, inter:], out=out)


def layer_added(layer: LoRALayer, timer: Timer, rounds: int = 11) -> dict:
    """A layer's four GEMMs with and without LoRA, in sequence (what the delta adds to the layer). Two
    orders: "after" (GEMM, then the delta added into y) and "before" (the delta written first by the
    expand's write mode, then the GEMM adds itself, addmm_: y is read by the GEMM's epilogue instead of
    read and written again); "shrinks" runs only the shrinks beside the GEMMs and "addmm" the GEMMs
    adding themselves to y without a delta (a breakdown). With the MLP's activation (act = silu(gate) *
    up, as the engine computes it at prefill): "fused" is "before" except for gate|up, whose delta is
    folded into the activation (`lora_silu_mul`), against "base_act" (the GEMMs and torch's activation)
    and "base_kernel_act" (the GEMMs and `silu_mul`, the engine's activation without adapters)."""
    weights = [torch.randn(sum(w), x.shape[1], device="cuda").to(DT) for (_, w), x in zip(GROUPS, layer.xs, strict=True)]
    groups = list(zip(GROUPS, layer.xs, weights, layer.ys, layer.slices, strict=True))
    num_tokens, inter = layer.ys[2].shape[0], layer.ys[2].shape[1] // 2
    act = torch.empty(num_tokens, inter, dtype=DT, device="cuda")

    def run(mode: str) -> None:
        for g, ((proj_ids, _), x, w, y, sl) in enumerate(groups):
            lora = {"x": x, "layout": layer.layout, "layer": 0, "proj_ids": proj_ids, "batch": layer.batch}
            offsets, mlp = [a for a, _ in sl], g == 2
            if mlp and mode == "fused":  # shrink, GEMM, then the delta folded into the activation
                xa = lora_xa(**lora)
                torch.matmul(x, w.t(), out=y)
                lora_silu_mul(gate_up=y, xa=xa, layout=layer.layout, layer=0, batch=layer.batch, out=act)
            elif mode in ("before", "fused"):  # the delta written, then the GEMM adds itself
                lora_delta(**lora, y=y, out_offsets=offsets, accumulate=False)
                y.addmm_(x, w.t())
            elif mode == "addmm":  # the GEMM adding itself to y, no delta: what reading y in its epilogue costs
                y.addmm_(x, w.t())
            else:
                torch.matmul(x, w.t(), out=y)
                if mode == "after":
                    lora_delta(**lora, y=y, out_offsets=offsets)
                if mode == "shrinks":
                    lora_xa(**lora)
            if mlp and mode == "base_act":
                torch_act(y, act)
            if mlp and mode == "base_kernel_act":
                silu_mul(y, out=act)

    # The GEMMs' own time drifts between graphs (clocks, heat): the modes are timed in alternation, rounds
    # times, in reverse order every other round (a steady drift then favours no mode), and each figure is
    # a median over rounds of the difference to that round's base.
    modes = ("base", "addmm", "after", "before", "shrinks", "base_act", "base_kernel_act", "fused")
    times = {mode: [] for mode in modes}
    for i in range(rounds):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            times[mode].append(timer.graph(functools.partial(run, mode)))
    res = {mode: statistics.median(times[mode]) for mode in modes}
    res["rounds"] = times

    def added(mode: str, base: str) -> float:
        return statistics.median(t - b for t, b in zip(times[mode], times[base], strict=True))

    for mode in ("addmm", "after", "before", "shrinks"):
        res[f"{mode}_added_us"] = added(mode, "base")
        res[f"{mode}_added_fraction"] = res[f"{mode}_added_us"] / res["base"]
    # The activation's own cost differs by kernel: the fused figure is taken against the faster base.
    res["act_torch_us"], res["act_kernel_us"] = added("base_act", "base"), added("base_kernel_act", "base")
    res["fused_added_us"] = max(added("fused", "base_act"), added("fused", "base_kernel_act"))
    res["fused_added_fraction"] = res["fused_added_us"] / res["base"]
    return res


def base_gemms(num_tokens: int, timer: Timer) -> float:
    weights = [torch.randn(sum(w), DIMS[p[0]][0], device="cuda").to(DT) for p, w in GROUPS]
    xs = [torch.randn(num_tokens, w.shape[1], device="cuda").to(DT) for w in weights]
    outs = [torch.empty(num_tokens, w.shape[0], dtype=DT, device="cuda") for w in weights]

    def run() -> None:
        for x, w, o in zip(xs, weights, outs, strict=True):
            torch.matmul(x, w.t(), out=o)

    return timer.graph(run)


def bench_lora(timer: Timer, copy_gbs: float, gen: torch.Generator, quick: bool, only: set | None = None, most_segment_len: int = 64) -> tuple[list, dict]:
    rows = []
    key_cases = {(64, 32, "16"), (256, 32, "16"), (1, 8, "16"), (1024, 8, "16")}
    sweep_cases = {(64, 32, "16"), (1024, 8, "16")}
    sweep, floors = {}, {}
    for rank_name in ("16", "8", "64", "mixed", "30"):
        for num_adapters in ADAPTERS:
            if (rank_name == "30" and num_adapters != 32) or (only and not any(a == num_adapters and r == rank_name for _, a, r in only)):
                continue
            ranks_by_slot = [RANKS[rank_name][s % len(RANKS[rank_name])] for s in range(num_adapters)]
            layout, dense = build_layout(ranks_by_slot, gen)
            for num_tokens in TOKENS:
                if (rank_name == "30" and num_tokens not in (64, 256)) or (only and (num_tokens, num_adapters, rank_name) not in only):
                    continue
                layer = LoRALayer(layout, dense, num_tokens, num_adapters, gen, most_segment_len=most_segment_len)
                distinct = min(num_tokens, num_adapters)
                nbytes = adapter_bytes(ranks_by_slot[:distinct])
                row = {"tokens": num_tokens, "adapters": num_adapters, "distinct": distinct, "rank": rank_name, "adapter_bytes": nbytes,
                       "segment_len": layer.segment_len}
                row["floor_us"] = nbytes / (copy_gbs * 1e3)
                row["moved_bytes"] = nbytes + activation_bytes(num_tokens)  # adapters, inputs read, deltas written
                row["moved_floor_us"] = row["moved_bytes"] / (copy_gbs * 1e3)
                row["triton_us"] = timer.graph(layer.triton)
                if num_tokens <= 256 and num_adapters in (8, 32) and rank_name in ("16", "mixed", "30"):
                    row["triton_accumulate_us"] = timer.graph(functools.partial(layer.triton, accumulate=True))
                if num_tokens == 64 and num_adapters == 32 and rank_name in ("16", "mixed", "30"):
                    row["groups"] = group_breakdown(layer, timer)
                if num_tokens in (64, 256) and num_adapters == 32 and rank_name in ("16", "mixed", "30"):
                    row["class_tiles_us"] = {n: timer.graph(functools.partial(layer.kernels, n)) for n in (2048, 4096, 8192)}
                if num_tokens >= 64 and num_adapters in (8, 32) and rank_name == "16":
                    # Prefill: the delta is ~10% of GEMMs whose time drifts by a few percent, more rounds.
                    row["in_layer"] = layer_added(layer, timer, rounds=25 if num_tokens >= 1024 else 11)
                if num_tokens in (64, 256) and num_adapters == 32 and rank_name in ("16", "mixed"):
                    # The engine's captured decode step in a pool of rank ENGINE_MAX_RANK and 32 slots (the layout's).
                    wide = widened(layout, ENGINE_MAX_RANK)
                    for shape in ("engine", "pool_bound"):
                        engine = LoRALayer(wide, dense, num_tokens, num_adapters, gen, most_segment_len=most_segment_len, graph_shaped=shape)
                        row["graph_shaped_us" if shape == "engine" else "graph_pool_bound_us"] = timer.graph(engine.triton)
                    del engine, wide
                if num_tokens <= 256 and num_tokens >= num_adapters:
                    per_token = LoRALayer(layout, dense, num_tokens, num_adapters, gen, grouped=False)
                    row["triton_per_token_us"] = timer.graph(per_token.triton)
                key = (num_tokens, num_adapters, rank_name)
                if key in key_cases and num_tokens <= 256:  # decode: what any chain of eight dependent kernels costs
                    distinct_ranks = tuple(ranks_by_slot[:distinct])
                    if distinct_ranks not in floors:
                        floors[distinct_ranks] = structure_floor(timer, list(distinct_ranks), copy_gbs)
                    row["structure_floor"] = floors[distinct_ranks]
                if rank_name != "30":  # the baselines, every case of the grid
                    row["reference_us"] = timer.eager(layer.reference)
                    # The gather+bmm baseline over slot-stacked weights: replayed (cold L2, as the kernels) and eager.
                    row["gather_bmm_us"] = timer.graph(layer.gather_bmm)
                    row["gather_bmm_eager_us"] = timer.eager(layer.gather_bmm)
                    row["loop_us"] = timer.eager(layer.loop, reps=3)
                if not quick and key in sweep_cases:
                    print(f"sweep T={num_tokens} A={num_adapters} r={rank_name}", flush=True)
                    sweep[str(key)] = sweep_case(layer, timer)
                row["bandwidth_frac"] = row["floor_us"] / row["triton_us"] if row["triton_us"] else None
                rows.append(row)
                print(json.dumps(row), flush=True)
            del layout, dense
            torch.cuda.empty_cache()
    return rows, sweep


def group_breakdown(layer: LoRALayer, timer: Timer) -> dict:
    """Each group's shrink, expand (write mode, as the engine runs it) and the pair alone, with a cold L2
    and with the group's weights left in L2 by the previous call: how much of the layer is memory and
    how much the kernels' latency."""
    res = {}
    for g, ((proj_ids, _), x, y, xa, sl) in enumerate(zip(GROUPS, layer.xs, layer.ys, layer.xas, layer.slices, strict=True)):
        shrink = functools.partial(lora_shrink_triton, x=x, layout=layer.layout, layer=0, proj_ids=proj_ids, batch=layer.batch, out=xa)
        expand = functools.partial(lora_expand_triton, xa=xa, layout=layer.layout, layer=0, proj_ids=proj_ids, batch=layer.batch, y=y, out_slices=sl,
                                   accumulate=False)

        def pair(shrink=shrink, expand=expand) -> None:
            shrink()
            expand()

        res[g] = {f"{name}_{'cold' if cold else 'warm'}_us": timer.graph(fn, cold=cold) for name, fn in (("shrink", shrink), ("expand", expand), ("pair", pair))
                  for cold in (True, False)}  # fmt: skip
    return res


def timed(results: dict, name: str, timer: Timer, fn) -> None:
    """Time one tuning variant; a variant that does not fit the GPU (shared memory) is left out."""
    try:
        results[name] = timer.graph(fn)
    except triton.runtime.errors.OutOfResources:
        print(f"  variant {name} does not fit", flush=True)


def sweep_case(layer: LoRALayer, timer: Timer) -> dict:
    """Each group's shrink and expand alone over split/tile/warp variants; the best per kernel, and the
    layer time with every kernel at its best against the defaults."""
    from lorafleet.kernels.lora_triton import shrink_splits

    res: dict = {"shrink": {}, "expand": {}}
    best_total, default_total = 0.0, 0.0
    prefill = layer.batch.num_tokens > 4 * layer.batch.num_segments
    for g, ((proj_ids, _), x, y, xa, sl) in enumerate(zip(GROUPS, layer.xs, layer.ys, layer.xas, layer.slices, strict=True)):
        run_shrink = functools.partial(lora_shrink_triton, x=x, layout=layer.layout, layer=0, proj_ids=proj_ids, batch=layer.batch)
        run_expand = functools.partial(lora_expand_triton, xa=xa, layout=layer.layout, layer=0, proj_ids=proj_ids, batch=layer.batch, y=y, out_slices=sl,
                                       accumulate=False)
        shrink = {}
        for pps in (1, 2, 4, 8):
            splits = shrink_splits(k=x.shape[1], num_proj=len(proj_ids), batch=layer.batch, device=x.device, programs_per_sm=pps)
            out = torch.empty(splits, *xa.shape[1:], device="cuda")
            for block_k in (128, 256):
                for warps in (4, 8):
                    timed(shrink, f"s{splits}_bk{block_k}_w{warps}", timer, functools.partial(run_shrink, out=out, block_k=block_k, num_warps=warps))
        shrink["default"] = timer.graph(functools.partial(run_shrink, out=xa))
        expand = {}
        for block_n in (64, 128, 256) if prefill else (128, 256, 512):
            for pps in (0, 2, 4, 8, 16):  # 0: one column tile per program
                for warps in (4, 8):
                    walk = {"cols_per_program": block_n} if pps == 0 else {"programs_per_sm": pps}
                    timed(expand, f"bn{block_n}_pps{pps}_w{warps}", timer, functools.partial(run_expand, block_n=block_n, num_warps=warps, **walk))
        expand["default"] = timer.graph(run_expand)
        res["shrink"][g], res["expand"][g] = shrink, expand
        bs, be = min(shrink, key=shrink.get), min(expand, key=expand.get)
        best_total += shrink[bs] + expand[be]
        default_total += shrink["default"] + expand["default"]
        print(f"  group {g}: shrink best {bs} {shrink[bs]:.1f} us (default {shrink['default']:.1f}); expand best {be} {expand[be]:.1f} us (default {expand['default']:.1f})", flush=True)
    res["sum_best_us"], res["sum_default_us"] = best_total, default_total
    print(f"  kernels alone, summed: best {best_total:.1f} us, default {default_total:.1f} us", flush=True)
    return res


def bench_activation(timer: Timer, copy_gbs: float, gen: torch.Generator) -> dict:
    """The MLP's activation without adapters at Llama-3-8B width: torch's silu(gate) * up against
    `kernels.activation.silu_mul` (the engine's), next to its floor (read gate|up, write act)."""
    res = {}
    for t in TOKENS:
        gate_up = torch.randn(t, 2 * INTER, device="cuda", generator=gen).to(DT)
        out = torch.empty(t, INTER, dtype=DT, device="cuda")
        floor = 3 * t * INTER * gate_up.element_size() / (copy_gbs * 1e3)
        res[t] = {"torch_us": timer.graph(functools.partial(torch_act, gate_up, out)),
                  "silu_mul_us": timer.graph(functools.partial(silu_mul, gate_up, out=out)), "floor_us": floor}
        print(f"activation T={t}: torch {res[t]['torch_us']:.1f} us, silu_mul {res[t]['silu_mul_us']:.1f} us, floor {floor:.1f} us", flush=True)
    return res


def bench_attention(timer: Timer, copy_gbs: float, gen: torch.Generator) -> dict:
    num_seqs, context, block_size = 64, 2048, 16
    num_pages = num_seqs * context // block_size
    pool = torch.empty(num_pages, 2 * 2 * block_size * 8 * 128, dtype=DT, device="cuda").normal_(generator=gen)
    view = pool.view(num_pages, 2, 2, block_size, 8, 128)
    k_cache, v_cache = view[:, 1, 0], view[:, 1, 1]  # strided, like one layer of the unified pool
    table = torch.randperm(num_pages, device="cuda", generator=gen).view(num_seqs, -1).to(torch.int32)
    lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(num_seqs, 32, 128, device="cuda", generator=gen).to(DT)
    out = torch.empty_like(q)
    kv_bytes = 2 * num_seqs * context * 8 * 128 * 2
    res = {"kv_bytes": kv_bytes, "floor_us": kv_bytes / (copy_gbs * 1e3), "variants": {}}
    for splits, block_n, warps in ((None, 64, 4), (2, 64, 4), (None, 128, 4), (None, 32, 4)):
        us = timer.graph(
            lambda s=splits, b=block_n, w=warps: paged_attention_decode_triton(
                q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=lens, scale=0.088, out=out, num_splits=s, block_n=b, num_warps=w
            )
        )
        res["variants"][f"splits{splits}_bn{block_n}_w{warps}"] = us
    best = min(res["variants"], key=res["variants"].get)
    res["best"], res["decode_us"] = best, res["variants"][best]
    res["default_us"] = res["variants"]["splitsNone_bn64_w4"]
    res["bandwidth_frac"] = res["floor_us"] / res["decode_us"]
    # Prefill: 8 fresh prompts of 1024 tokens, Triton over the paged cache vs torch SDPA on dense tensors.
    q_len = 1024
    qp = torch.randn(8 * q_len, 32, 128, device="cuda", generator=gen).to(DT)
    outp = torch.empty_like(qp)
    starts = torch.arange(0, 9 * q_len, q_len, dtype=torch.int32, device="cuda")
    plens = torch.full((8,), q_len, dtype=torch.int32, device="cuda")
    ptable = table[:8, : q_len // block_size].contiguous()
    res["prefill_variants"] = {}
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    kw = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
                    timed(res["prefill_variants"], f"bm{block_m}_bn{block_n}_w{warps}_s{stages}", timer, functools.partial(
                        paged_attention_prefill_triton, q=qp, k_cache=k_cache, v_cache=v_cache, block_tables=ptable, query_start_loc=starts,
                        context_lens=plens, scale=0.088, out=outp, **kw,
                    ))  # fmt: skip
    res["prefill_triton_us"] = timer.graph(
        lambda: paged_attention_prefill_triton(q=qp, k_cache=k_cache, v_cache=v_cache, block_tables=ptable, query_start_loc=starts, context_lens=plens, scale=0.088, out=outp)
    )
    best = min(res["prefill_variants"], key=res["prefill_variants"].get)
    print(f"prefill best {best} {res['prefill_variants'][best]:.1f} us, default {res['prefill_triton_us']:.1f} us", flush=True)
    want = torch.empty_like(qp)
    paged_attention_prefill(q=qp, k_cache=k_cache, v_cache=v_cache, block_tables=ptable, query_start_loc=starts, context_lens=plens, scale=0.088, out=want, backend="reference")
    res["prefill_rel_err"] = float((outp.float() - want.float()).norm() / want.float().norm())
    qd = qp.view(8, q_len, 32, 128).transpose(1, 2)
    kd = torch.randn(8, 8, q_len, 128, device="cuda", generator=gen).to(DT)
    res["prefill_sdpa_us"] = timer.graph(
        lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, kd, is_causal=True, enable_gqa=True)
    )
    return res


def _floor_summary(floor: dict) -> dict:
    return {k: v for k, v in floor.items() if k.startswith(("chain", "one"))}


def summarize(rows: list, base: dict, attn: dict, copy_gbs: float) -> dict:
    """The issue's target figures, for the cases that were run."""
    by_key = {(r["tokens"], r["adapters"], r["rank"]): r for r in rows}
    out = {}
    for t in (64, 256):
        if row := by_key.get((t, 32, "16")):
            out[f"decode_T{t}_32x_r16"] = {
                "triton_us": row["triton_us"], "floor_us": row["floor_us"],
                "x_floor": row["triton_us"] / row["floor_us"], "target_x_floor": 1.6, "base_gemm_us": base[t],
                "moved_floor_us": row["moved_floor_us"], "x_moved_floor": row["triton_us"] / row["moved_floor_us"],
            }  # fmt: skip
            if "triton_accumulate_us" in row:
                out[f"decode_T{t}_32x_r16"]["accumulate_us"] = row["triton_accumulate_us"]
            if "graph_shaped_us" in row:
                out[f"decode_T{t}_32x_r16"].update(graph_shaped_us=row["graph_shaped_us"], graph_shaped_x_floor=row["graph_shaped_us"] / row["floor_us"],
                                                   graph_pool_bound_us=row["graph_pool_bound_us"])  # fmt: skip
            if "in_layer" in row:
                out[f"decode_T{t}_32x_r16"]["in_layer"] = {k: v for k, v in row["in_layer"].items() if k != "rounds"}
            if "structure_floor" in row:
                out[f"decode_T{t}_32x_r16"]["structure_floor"] = _floor_summary(row["structure_floor"])
            if "reference_us" in row:
                out[f"decode_T{t}_32x_r16"].update(vs_reference=row["reference_us"] / row["triton_us"],
                                                   gather_bmm_us=row["gather_bmm_us"], gather_bmm_eager_us=row["gather_bmm_eager_us"],
                                                   vs_gather_bmm=row["gather_bmm_us"] / row["triton_us"],
                                                   vs_gather_bmm_eager=row["gather_bmm_eager_us"] / row["triton_us"], target_vs_gather_bmm=20,
                                                   vs_loop=row["loop_us"] / row["triton_us"], target_vs_loop=200)  # fmt: skip
        mixed, mean = by_key.get((t, 32, "mixed")), by_key.get((t, 32, "30"))
        if mixed and mean:
            out[f"mixed_ranks_T{t}"] = {"mixed_us": mixed["triton_us"], "mean_rank_30_us": mean["triton_us"], "ratio": mixed["triton_us"] / mean["triton_us"], "target_ratio": 1.15}
    if pre := by_key.get((1024, 8, "16")):
        out["prefill_T1024_8x_r16"] = {"triton_us": pre["triton_us"], "base_gemm_us": base[1024], "fraction_of_base": pre["triton_us"] / base[1024],
                                       "in_layer": pre.get("in_layer"), "target_fraction": 0.10}  # fmt: skip
    if t1 := by_key.get((1, 8, "16")):
        out["decode_T1_8x_r16"] = {"triton_us": t1["triton_us"], "floor_us": t1["floor_us"], "base_gemm_us": base[1]}
        if "structure_floor" in t1:
            out["decode_T1_8x_r16"]["structure_floor"] = _floor_summary(t1["structure_floor"])
    out["attention_decode_B64_ctx2048"] = {"us": attn["decode_us"], "floor_us": attn["floor_us"], "bandwidth_frac": attn["bandwidth_frac"], "target_frac": 0.70}
    out["copy_gbs"] = copy_gbs
    return out


def plot(rows: list, base: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for num_adapters in ADAPTERS:
        sel = [r for r in rows if r["adapters"] == num_adapters and r["rank"] == "16"]
        axes[0].plot([r["tokens"] for r in sel], [r["triton_us"] for r in sel], marker="o", label=f"LoRA delta, {num_adapters} adapters")
        axes[0].plot([r["tokens"] for r in sel], [r["floor_us"] for r in sel], ls=":", color=axes[0].lines[-1].get_color())
    axes[0].plot(list(base), list(base.values()), color="k", lw=2, label="base GEMMs of the layer")
    axes[0].set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs per layer", title="Llama-3-8B layer, r=16 (dotted: floor)")
    axes[0].legend(fontsize=7)
    for rank_name in ("8", "16", "64", "mixed"):
        sel = [r for r in rows if r["rank"] == rank_name and r["tokens"] == 64]
        axes[1].plot([r["adapters"] for r in sel], [100 * r["bandwidth_frac"] for r in sel], marker="o", label=f"r={rank_name}")
    axes[1].set(xscale="log", xlabel="adapters in batch", ylabel="% of copy bandwidth on adapter bytes", title="T=64 decode")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="skip the tuning sweeps")
    parser.add_argument("--segment-len", type=int, default=64,
                        help="most tokens of one adapter per kernel segment; each case's own grows from 16 with T as the engine's (EngineConfig.lora_segment_len)")
    parser.add_argument("--cases", default="", help="only these LoRA cases, T:A:rank comma-separated (for example 64:32:16,64:32:mixed)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/lora_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    timer = Timer()
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; L2 flush {timer.flush_us:.1f} us", flush=True)
    base = {t: base_gemms(t, timer) for t in TOKENS}
    print("base GEMMs (us):", {t: round(v, 1) for t, v in base.items()}, flush=True)
    attn = bench_attention(timer, copy_gbs, gen)
    act = bench_activation(timer, copy_gbs, gen)
    chain = chain_latency(timer)
    print("attention:", json.dumps({k: v for k, v in attn.items() if k != "variants"}), flush=True)
    only = {(int(t), int(a), r) for t, a, r in (c.split(":") for c in args.cases.split(",") if c)}
    rows, sweep = bench_lora(timer, copy_gbs, gen, args.quick, only, args.segment_len)
    summary = summarize(rows, base, attn, copy_gbs)
    summary["chain_of_8_launches_us"] = chain
    print(f"\n{'T':>5} {'A':>3} {'rank':>5} {'triton us':>10} {'floor us':>9} {'moved fl':>9} {'% copy bw':>9} {'per-token':>9} {'ref us':>8} {'g+bmm us':>9} {'loop us':>9} {'base us':>8}")
    for r in rows:
        print(
            f"{r['tokens']:>5} {r['adapters']:>3} {r['rank']:>5} {r['triton_us']:>10.1f} {r['floor_us']:>9.1f} {r['moved_floor_us']:>9.1f} {100 * r['bandwidth_frac']:>8.0f}% "
            f"{r.get('triton_per_token_us', float('nan')):>9.1f} {r.get('reference_us', float('nan')):>8.0f} {r.get('gather_bmm_us', float('nan')):>9.1f} {r.get('loop_us', float('nan')):>9.0f} {base[r['tokens']]:>8.1f}"
        )
    print(json.dumps(summary, indent=1))
    name = f"kernels_{datetime.date.today():%Y%m%d}_{device_tag(torch.cuda.get_device_name())}"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"date": f"{datetime.date.today()}", "command": recorded_command(), "segment_len": args.segment_len,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_gbs": copy_gbs, "base_gemm_us": base,
              "lora": rows, "sweeps": sweep, "attention": attn, "activation": act, "chain_latency": chain, "summary": summary}  # fmt: skip
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(rows, base, out_dir / f"{name}.png")
    print(f"wrote {out_dir / name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
