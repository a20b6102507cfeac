"""What the shape of a layer's LoRA delta costs by itself: the same chain of dependent kernels, each
doing nothing but read the bytes its LoRA kernel must read.

The decode delta is eight dependent kernels (shrink, then expand, for q|k|v, o, gate|up and down).
Here each is replaced by a kernel that reads exactly that many bytes (one contiguous buffer: easier
than the pool's scattered rows) and sums them, launched as the LoRA kernels are (programmatic
dependent launch where supported, graph replay, cold L2), tiled for speed (the best of a few grids per
kernel). Against the copy floor this says how close any design with eight (or four, or one) dependent
kernels can come; the LoRA kernels' own cost is the rest.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from kernel_setup import DIMS, GROUPS, Timer  # same folder

from lorafleet.kernels.lora_sgmv import gdc_launch_dependents, gdc_wait
from lorafleet.kernels.lora_triton import pdl_supported

# Grids tried per kernel: programs per SM, elements per load, loads in flight per loop step, warps.
VARIANTS = [dict(per_sm=p, block=2048, unroll=u, warps=8) for p, u in itertools.product((4, 8), (1, 2))]


@triton.jit
def read_range(src, lo, hi, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """The float32 sum of src[lo:hi], UNROLL loads of BLOCK elements in flight per step (the floors' one read loop)."""
    arange = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(lo, hi, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            offs = start + u * BLOCK + arange
            acc += tl.load(src + offs, mask=offs < hi, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _read_sum(src, out, n, per_program, BLOCK: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
    """out[pid] = sum of src[pid * per_program : (pid + 1) * per_program] (float32), after the previous kernel."""
    pid = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    lo = pid * per_program
    tl.store(out + pid, read_range(src, lo, tl.minimum(lo + per_program, n), BLOCK, UNROLL))


def read_sum(buf: torch.Tensor, out: torch.Tensor, *, per_sm: int, block: int, unroll: int, warps: int) -> None:
    """One reading kernel over buf (16-bit, 1-D) on about per_sm programs per SM; out holds a float per program."""
    n = buf.numel()
    sms = torch.cuda.get_device_properties(buf.device).multi_processor_count
    per_program = triton.cdiv(triton.cdiv(n, min(sms * per_sm, triton.cdiv(n, block))), block) * block
    pdl = pdl_supported(str(buf.device))
    _read_sum[(triton.cdiv(n, per_program),)](buf, out, n, per_program, BLOCK=block, UNROLL=unroll, PDL=pdl, num_warps=warps,
                                              **({"launch_pdl": True} if pdl else {}))  # fmt: skip


def kernel_bytes(ranks: list[int]) -> list[int]:
    """Bytes each of the decode delta's eight kernels must read for adapters of these ranks (16-bit
    weights): per group, the shrink reads A (rank x in per projection), the expand B (rank x out)."""
    sizes = []
    for proj_ids, _ in GROUPS:
        sizes.append(sum(2 * r * DIMS[p][0] for r in ranks for p in proj_ids))
        sizes.append(sum(2 * r * DIMS[p][1] for r in ranks for p in proj_ids))
    return sizes


def structure_floor(timer: Timer, ranks: list[int], copy_gbs: float) -> dict:
    """The chain of eight reading kernels (one per LoRA kernel), of four (one per group: a fused
    shrink+expand) and one kernel reading everything, each kernel on its fastest grid, in us and
    against the copy floor of the same bytes."""
    sizes = kernel_bytes(ranks)
    bufs = [torch.ones(s // 2, dtype=torch.bfloat16, device="cuda") for s in sizes]
    out = torch.empty(max(v["per_sm"] for v in VARIANTS) * torch.cuda.get_device_properties(0).multi_processor_count, device="cuda")

    def best(buf: torch.Tensor) -> tuple[dict, float]:
        times = [(v, timer.graph(lambda v=v: read_sum(buf, out, **v))) for v in VARIANTS]
        return min(times, key=lambda vt: vt[1])

    def chain(buffers: list[torch.Tensor]) -> float:
        grids = [best(b)[0] for b in buffers]
        return timer.graph(lambda: [read_sum(b, out, **g) for b, g in zip(buffers, grids, strict=True)])

    pairs = [torch.cat(bufs[i : i + 2]) for i in range(0, len(bufs), 2)]
    floor = sum(sizes) / (copy_gbs * 1e3)
    res = {"bytes": sum(sizes), "floor_us": floor, "kernel_bytes": sizes, "kernel_alone_us": [best(b)[1] for b in bufs],
           "chain8_us": chain(bufs), "chain4_us": chain(pairs), "one_us": best(torch.cat(bufs))[1]}  # fmt: skip
    for k in ("chain8", "chain4", "one"):
        res[f"{k}_x_floor"] = res[f"{k}_us"] / floor
    print("structure floor:", {k: round(v, 2) for k, v in res.items() if isinstance(v, float)}, flush=True)
    return res


@triton.jit
def _one_load(src, dst, PDL: tl.constexpr):
    """dst[pid] = src[pid] + 1; with PDL, after the previous kernel, letting the next one launch."""
    pid = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(dst + pid, tl.load(src + pid) + 1)


def chain_latency(timer: Timer, kernels: int = 8) -> dict:
    """What a layer's chain of dependent launches costs by itself (its delta is eight kernels, each
    needing the previous one's output): a one-load kernel launched `kernels` times from a graph, warm,
    on one program and on one per SM, with and without programmatic dependent launch."""
    buf = torch.zeros(4096, device="cuda")
    res = {}
    for pdl in (False, True) if pdl_supported("cuda") else (False,):
        for programs in (1, torch.cuda.get_device_properties(0).multi_processor_count):
            def chain(pdl=pdl, programs=programs) -> None:
                for _ in range(kernels):
                    _one_load[(programs,)](buf, buf, PDL=pdl, **({"launch_pdl": True} if pdl else {}))

            res[f"{'pdl' if pdl else 'plain'}_{programs}_programs_us"] = timer.graph(chain, cold=False)
    print(f"{kernels} dependent launches (us):", {k: round(v, 2) for k, v in res.items()}, flush=True)
    return res
