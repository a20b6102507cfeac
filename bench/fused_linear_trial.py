"""Trial: the decode LoRA expand folded into the base GEMM (one launch per projection group does the
GEMM and then the delta), the shrink launched just before it with programmatic dependent launch.

    python bench/fused_linear_trial.py --out bench/results     # H200 result: kernels_fused_linear_trial_20261201_h200.json

Result on the H200: no gain over the engine's separate kernels (T=64 over 32 adapters: 70.0 us added
against 69.9; T=256: worse, this kernel's own GEMM tiles being 1.3x cuBLAS there); the shrinks are not
overlapped with the GEMMs and the expand epilogue, run after each program's W loop, is latency-bound
(42.5 us for ~10 us of B bytes). The engine does not use this kernel.

Each program of the fused kernel streams its columns of W over K, then waits for the shrink (PDL) and
adds, for every adapter of the batch, (xa of the adapter's tokens, scaled) @ (the adapter's B rows
for its columns): the adapter's B rows are a second K range of the GEMM, read once per column tile.
What LoRA adds to the layer = (shrink + fused GEMM, four groups) - the faster of cuBLAS and the same
kernel without LoRA; the floor is the adapters' bytes / copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from lorafleet.kernels.lora import lora_delta
from lorafleet.kernels.lora_reference import lora_expand_reference, lora_shrink_reference
from lorafleet.kernels.lora_sgmv import _gdc_launch_dependents, _gdc_wait
from lorafleet.kernels.lora_triton import _INTERPRET, lora_shrink_triton

_spec = importlib.util.spec_from_file_location("kernel_setup", Path(__file__).with_name("kernel_setup.py"))
ks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ks)


@triton.jit
def fused_linear_kernel(
    x_ptr, w_ptr, y_ptr, xa_ptr, pool_ptr, ranks_ptr, tslot_ptr, vk_ptr, vk_scale_ptr, vk_slot_ptr, slices_ptr,
    T, K, num_vk, layer, max_slots, xa_rank,
    stride_xt, stride_wn, stride_yt, stride_xs, stride_xp, stride_xat, stride_vk, stride_vs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, SPC: tl.constexpr, SPLITS: tl.constexpr,
    NUM_SLICES: tl.constexpr, LORA: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr, LORA_STAGES: tl.constexpr,
):  # fmt: skip
    """y = x @ W^T (+ the LoRA delta). The LoRA rows are a second K range, "virtual K": row j of the
    projection's table (vk, num_vk rows, a multiple of SPC * BR) is rank row j % BR of the batch's
    (j // BR)-th distinct adapter: its B row's pool offset (-1: past the rank), the adapter's slot and
    scale per block of BR rows."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BM)
    pid_m, pid_n = pid % num_m, pid // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < T
    if TRIGGER == 0:
        _gdc_launch_dependents(PDL)
    if LORA:  # metadata first: nothing of it comes from the shrink
        n0 = pid_n * BN
        i = 0
        for s in tl.static_range(1, NUM_SLICES):
            i += (n0 >= tl.load(slices_ptr + 3 * s + 1)).to(tl.int32)
        proj = tl.load(slices_ptr + 3 * i)
        col = offs_n - tl.load(slices_ptr + 3 * i + 1)
        tslot = tl.load(tslot_ptr + offs_m, mask=m_mask, other=-1)
        tok_rank = tl.where(tslot < 0, 0, tl.load(ranks_ptr + (layer * 7 + proj) * max_slots + tl.maximum(tslot, 0), mask=m_mask, other=0))
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    for _ in range(0, K, BK):
        a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(w_ptrs)
        acc += tl.dot(a, b)
        x_ptrs += BK
        w_ptrs += BK
    if TRIGGER == 1:
        _gdc_launch_dependents(PDL)
    if LORA:
        offs_r = tl.arange(0, BR)
        xa_mask = (tslot >= 0)[:, None] & (offs_r[None, :] < tl.minimum(tok_rank, xa_rank)[:, None])
        xa_ptrs = xa_ptr + i * stride_xp + offs_m[:, None].to(tl.int64) * stride_xat + offs_r[None, :]
        offs_j = tl.arange(0, SPC * BR)
        offs_c = tl.arange(0, SPC)
        vk_rows = vk_ptr + i * stride_vk + offs_j
        vk_blocks = i * stride_vs + offs_c
        _gdc_wait(PDL)
        xa = tl.zeros([BM, BR], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            xa += tl.load(xa_ptrs + s * stride_xs, mask=xa_mask, other=0.0)
        for j0 in tl.range(0, num_vk, SPC * BR, num_stages=LORA_STAGES):
            boff = tl.load(vk_rows + j0)
            bt = tl.load(pool_ptr + boff[:, None] + col[None, :], mask=(boff >= 0)[:, None], other=0.0)
            c0 = j0 // BR
            sl_c = tl.load(vk_slot_ptr + offs_c + c0)
            sc_c = tl.load(vk_scale_ptr + vk_blocks + c0)
            wgt = tl.where(tslot[:, None] == sl_c[None, :], sc_c[None, :], 0.0)  # [BM, SPC]
            at = tl.reshape(wgt[:, :, None] * xa[:, None, :], [BM, SPC * BR])
            acc += tl.dot(at.to(bt.dtype), bt)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])


def vk_tables(layout, layer, proj_ids, dslots, br, spc):
    """Per projection of a group: the virtual-K B row offsets (-1 past a rank), and per block of br rows
    the adapter's slot and scale (-1 / 0 for padding); num rows a multiple of spc * br."""
    nd = dslots.shape[0]
    blocks = max(spc, -(-nd // spc) * spc)
    slots = torch.full((blocks,), -1, dtype=torch.int64, device=dslots.device)
    slots[:nd] = dslots.long()
    r = torch.arange(br, device=dslots.device)
    offs, scales = [], []
    for p in proj_ids:
        s0 = slots.clamp(min=0)
        rk = torch.where(slots >= 0, layout.ranks[layer, p, s0].long(), 0)
        bo = layout.b_offsets[layer, p, s0][:, :br] if layout.max_rank >= br else torch.nn.functional.pad(layout.b_offsets[layer, p, s0], (0, br - layout.max_rank))
        offs.append(torch.where(r[None, :] < rk[:, None], bo, -1).reshape(-1))
        scales.append(torch.where(slots >= 0, layout.scales[layer, p, s0], 0.0))
    return torch.stack(offs).contiguous(), torch.stack(scales).contiguous(), slots.to(torch.int32).contiguous()


def fused_linear(x, w, y, cfg, *, lora=None, trigger=1, lora_stages=3):
    """y = x @ w^T, plus the LoRA delta of lora = (xa, layout, slices table, num slices, batch, vk tables)."""
    T, K = x.shape
    N = w.shape[0]
    bm, bn, bk, stages, warps = cfg
    assert K % bk == 0 and N % bn == 0
    grid = (triton.cdiv(T, bm) * (N // bn),)
    if lora is None:
        fused_linear_kernel[grid](x, w, y, y, y, y, y, y, y, y, y, T, K, 0, 0, 1, 1, x.stride(0), w.stride(0), y.stride(0), 0, 0, 0, 0, 0,
                                  BM=bm, BN=bn, BK=bk, BR=16, SPC=8, SPLITS=1, NUM_SLICES=1, LORA=False, PDL=False, TRIGGER=2, LORA_STAGES=1,
                                  num_warps=warps, num_stages=stages)  # fmt: skip
        return
    xa, layout, slices, num_slices, batch, (vk, vk_scale, vk_slot), br, spc = lora
    fused_linear_kernel[grid](
        x, w, y, xa, layout.pool, layout.ranks, batch.token_slots, vk, vk_scale, vk_slot, slices,
        T, K, vk.shape[1], 0, layout.max_slots, xa.shape[3],
        x.stride(0), w.stride(0), y.stride(0), xa.stride(0), xa.stride(1), xa.stride(2), vk.stride(0), vk_scale.stride(0),
        BM=bm, BN=bn, BK=bk, BR=br, SPC=spc, SPLITS=xa.shape[0], NUM_SLICES=num_slices, LORA=True, PDL=not _INTERPRET, TRIGGER=trigger,
        LORA_STAGES=lora_stages, num_warps=warps, num_stages=stages, **({} if _INTERPRET else {"launch_pdl": True}),
    )  # fmt: skip


CONFIGS = {
    64: [(64, 64, 128, 4, 4), (64, 32, 128, 6, 4), (64, 128, 128, 4, 4), (64, 32, 256, 4, 4), (64, 64, 128, 3, 4), (64, 32, 128, 4, 4), (64, 64, 64, 4, 4)],
    256: [(256, 64, 64, 4, 8), (256, 32, 128, 3, 8), (256, 64, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 128, 4, 8), (256, 128, 64, 3, 8)],
}


def run_case(num_tokens: int, layout, dense, timer, gen: torch.Generator, floor_us: float) -> dict:
    """One token count: the GEMM sweep, the fused kernel's errors, per-group fused sweep and the layer's variants."""
    layer = ks.LoRALayer(layout, dense, num_tokens, 32, gen)
    batch = layer.batch
    dslots = torch.unique(batch.seg_slots[batch.seg_slots >= 0]).to(torch.int32)
    weights = [(torch.randn(sum(w), x.shape[1], device="cuda", generator=gen) * 0.02).to(ks.DT) for (_, w), x in zip(ks.GROUPS, layer.xs, strict=True)]
    loras = []
    for (proj_ids, _widths), xa, sl in zip(ks.GROUPS, layer.xas, layer.slices, strict=True):
        table = torch.tensor([v for i, (start, _) in enumerate(sl) for v in (proj_ids[i], start, 0)], dtype=torch.int32, device="cuda")
        br = max(16, triton.next_power_of_2(batch.max_rank))
        spc = max(1, 128 // br)
        loras.append((xa, layout, table, len(proj_ids), batch, vk_tables(layout, 0, proj_ids, dslots, br, spc), br, spc))
    case = {"groups": {}}
    # 1. Each group's GEMM alone: cuBLAS vs this kernel per config; the best config per group.
    best = []
    for g, (x, w, y) in enumerate(zip(layer.xs, weights, layer.ys, strict=True)):
        row = {"cublas_us": timer.graph(lambda x=x, w=w, y=y: torch.matmul(x, w.t(), out=y)), "own_us": {}}
        for cfg in CONFIGS[num_tokens]:
            try:
                row["own_us"][str(cfg)] = timer.graph(lambda x=x, w=w, y=y, cfg=cfg: fused_linear(x, w, y, cfg))
            except Exception as exc:  # a config that does not compile or fit: recorded
                row["own_us"][str(cfg)] = repr(exc)[:200]
        ok = {k: v for k, v in row["own_us"].items() if isinstance(v, float)}
        ranked = sorted(ok, key=ok.get)
        best.append([eval(k) for k in ranked[:3]])
        case["groups"][str(g)] = row
        print(f"T={num_tokens} group {g}: cuBLAS {row['cublas_us']:.1f} us, own best {ranked[0]} {ok[ranked[0]]:.1f} us", flush=True)
    # 2. Correctness of the fused kernel: against cuBLAS + the reference delta.
    errs = []
    for g, ((proj_ids, _), x, w, y, xa, sl, lo) in enumerate(zip(ks.GROUPS, layer.xs, weights, layer.ys, layer.xas, layer.slices, loras, strict=True)):
        ref = torch.matmul(x, w.t()).float()
        xa_ref = torch.zeros(1, *xa.shape[1:], device="cuda")
        lora_shrink_reference(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=xa_ref)
        yd = torch.zeros_like(y)
        lora_expand_reference(xa=xa_ref, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=yd, out_slices=sl)
        ref += yd.float()
        delta = yd.float()
        y.fill_(float("nan"))
        lora_shrink_triton(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=xa)
        fused_linear(x, w, y, best[g][0], lora=lo)
        torch.cuda.synchronize()
        errs.append({"rel_err": float((y.float() - ref).norm() / ref.norm()), "delta_rel_err": float(((y.float() - ref).norm()) / delta.norm()),
                     "nan": bool(torch.isnan(y).any())})  # fmt: skip
    case["errors"] = errs
    print("errors", errs, flush=True)

    # 3. Each group's shrink + fused GEMM per config: the best config per group for the fused kernel.
    fused_best = []
    for g, ((proj_ids, _), x, w, y, xa, lo) in enumerate(zip(ks.GROUPS, layer.xs, weights, layer.ys, layer.xas, loras, strict=True)):
        row = {}
        for cfg in CONFIGS[num_tokens]:
            def pair(cfg=cfg, proj_ids=proj_ids, x=x, w=w, y=y, xa=xa, lo=lo):
                lora_shrink_triton(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=xa)
                fused_linear(x, w, y, cfg, lora=lo)
            try:
                row[str(cfg)] = timer.graph(pair)
            except Exception as exc:
                row[str(cfg)] = repr(exc)[:200]
        ok = {k: v for k, v in row.items() if isinstance(v, float)}
        fused_best.append(eval(min(ok, key=ok.get)))
        case["groups"][str(g)]["fused_us"] = row
        print(f"T={num_tokens} group {g}: shrink + fused best {fused_best[-1]} {min(ok.values()):.1f} us", flush=True)

    # 4. The layer: four groups in sequence.
    def run(mode, cfgs=None, trigger=1, lora_stages=3):
        for g, ((proj_ids, _), x, w, y, xa, sl, lo) in enumerate(zip(ks.GROUPS, layer.xs, weights, layer.ys, layer.xas, layer.slices, loras, strict=True)):
            if mode == "cublas":
                torch.matmul(x, w.t(), out=y)
            elif mode == "own":
                fused_linear(x, w, y, cfgs[g])
            elif mode == "after":  # the engine's serial path: GEMM, then the delta added
                torch.matmul(x, w.t(), out=y)
                lora_delta(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=y, out_offsets=[a for a, _ in sl])
            elif mode == "shrinks":
                lora_shrink_triton(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=xa)
            elif mode == "epilogue":  # the fused GEMM alone, xa left by an earlier run: what the expand part costs
                fused_linear(x, w, y, cfgs[g], lora=lo, trigger=trigger, lora_stages=lora_stages)
            else:
                lora_shrink_triton(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=xa)
                fused_linear(x, w, y, cfgs[g], lora=lo, trigger=trigger, lora_stages=lora_stages)

    variants = {"own_best": ("own", [b[0] for b in best], 1, 3), "fused_best": ("fused", fused_best, 1, 3),
                "fused_base_cfg": ("fused", [b[0] for b in best], 1, 3), "fused_best_t0": ("fused", fused_best, 0, 3),
                "fused_best_ls1": ("fused", fused_best, 1, 1), "shrinks_only": ("shrinks", None, 1, 3),
                "fused_no_shrink": ("epilogue", fused_best, 1, 3), "own_fused_cfg": ("own", fused_best, 1, 3)}  # fmt: skip
    times = {name: [] for name in ["cublas", "after", *variants]}
    for rnd in range(7):
        names = list(times) if rnd % 2 == 0 else list(times)[::-1]
        for name in names:
            mode, cfgs, trig, ls = variants.get(name, (name, None, 1, 3))
            times[name].append(timer.graph(lambda mode=mode, cfgs=cfgs, trig=trig, ls=ls: run(mode, cfgs, trig, ls)))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = min(med["cublas"], med["own_best"])
    case["layer_us"] = med
    case["base_us"] = base
    case["added_us"] = {k: med[k] - base for k in med if k not in ("cublas", "own_best", "own_fused_cfg")}
    case["added_over_floor"] = {k: v / floor_us for k, v in case["added_us"].items()}
    case["best_cfgs"] = [[list(c) for c in b] for b in best]
    case["fused_best_cfgs"] = [list(c) for c in fused_best]
    print(f"T={num_tokens}: layer {json.dumps({k: round(v, 1) for k, v in med.items()})}", flush=True)
    print(f"T={num_tokens}: added (us) {json.dumps({k: round(v, 1) for k, v in case['added_us'].items()})}; floor {floor_us:.1f} us", flush=True)
    return case


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", default="64,256")
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = ks.Timer()
    copy_gbs = ks.copy_bandwidth()
    layout, dense = ks.build_layout([16] * 32, gen)
    floor_us = ks.adapter_bytes([16] * 32) / (copy_gbs * 1e9) * 1e6
    out = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_gbs": copy_gbs, "floor_us": floor_us, "command": ks.recorded_command(), "cases": {}}  # fmt: skip
    for num_tokens in map(int, args.tokens.split(",")):
        out["cases"][str(num_tokens)] = run_case(num_tokens, layout, dense, timer, gen, floor_us)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"kernels_fused_linear_trial_{out['date'].replace('-', '')}_h200.json"
        path.write_text(json.dumps(out, indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
