"""The structure floor of a decode delta whose programs each do one projection of one segment whole.

    python bench/kernel_program_floor.py --out bench/results   # writes kernels_program_floor_<date>_<gpu>.json

A projection's delta for a segment needs no handoff between programs when one program does all of it:
y[t] = sum_j (x[t] . A[j]) * B^T[j] is a sum over the rank rows j, and each row's term needs only its own
A row, so one program reading its segment's A rows and B^T rows computes its projection's delta alone.
The layer is then four dependent kernels (one per group, its programs one per (segment, projection),
or C per projection, each reading the whole A (the C-1 repeats from L2) and 1/C of B), against eight
for shrink-then-expand. What limits it is how fast one program reads: a segment's q|k|v work is 32
programs of 256 KB (q) to 160 KB (k, v), not a grid spread over every SM.

Here each program only reads its bytes (A rows then B^T rows, contiguous, 32 adapters at rank 16 as
the bench's main case), summing them, with PDL and cold L2 as bench/kernel_floor.py: once with plain
loads (BLOCK elements, UNROLL in flight per step) and once with the Tensor Memory Accelerator
(a descriptor over the buffer as [n/16, 16], boxes of [BOX, 16], the loop pipelined NUM_STAGES deep),
which keeps many bytes in flight for one program. Also one program alone reading 1 MB: one SM's
bandwidth. If the chain of four sits near the four-kernel floor of bench/kernel_floor.py, this design
has the launch count of a fused group without its handoff.
"""

from __future__ import annotations

import datetime
import sys

import torch
import triton
import triton.language as tl
from bench_io import device_tag, write_json  # same folder
from kernel_floor import read_range, structure_floor  # same folder
from kernel_setup import DIMS, GROUPS, Timer, copy_bandwidth, cuda_bench_args, recorded_command  # same folder

from lorafleet.kernels.lora_sgmv import gdc_launch_dependents, gdc_wait
from lorafleet.kernels.lora_triton import pdl_supported

SEGMENTS, RANK = 32, 16
PLAIN = [dict(block=b, unroll=u, warps=w) for b in (1024, 2048, 4096) for u in (4, 8, 16) for w in (4, 8)]
TMA = [dict(box=b, stages=s, warps=w) for b in (128, 256) for s in (4, 8, 12, 16, 20, 24) for w in (4, 8)]


@triton.jit
def _plain_program(src, out, a_lo_ptr, a_n_ptr, b_lo_ptr, b_n_ptr, BLOCK: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    a_lo, a_n = tl.load(a_lo_ptr + pid), tl.load(a_n_ptr + pid)
    b_lo, b_n = tl.load(b_lo_ptr + pid), tl.load(b_n_ptr + pid)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    s = read_range(src, a_lo, a_lo + a_n, BLOCK, UNROLL) + read_range(src, b_lo, b_lo + b_n, BLOCK, UNROLL)
    tl.store(out + pid, s)


@triton.jit
def _tma_range(desc, lo_row, n_rows, BOX: tl.constexpr, STAGES: tl.constexpr):
    acc = tl.zeros([BOX, 16], dtype=tl.float32)
    for r in tl.range(0, n_rows, BOX, num_stages=STAGES):
        acc += desc.load([lo_row + r, 0]).to(tl.float32)
    return tl.sum(tl.sum(acc, axis=1), axis=0)


@triton.jit
def _tma_program(desc, out, a_lo_ptr, a_n_ptr, b_lo_ptr, b_n_ptr, BOX: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Rows of the [n/16, 16] view: a_lo / 16 .. + a_n / 16, then the B range."""
    pid = tl.program_id(0)
    a_lo, a_n = tl.load(a_lo_ptr + pid).to(tl.int32), tl.load(a_n_ptr + pid).to(tl.int32)
    b_lo, b_n = tl.load(b_lo_ptr + pid).to(tl.int32), tl.load(b_n_ptr + pid).to(tl.int32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    s = _tma_range(desc, a_lo // 16, a_n // 16, BOX, STAGES) + _tma_range(desc, b_lo // 16, b_n // 16, BOX, STAGES)
    tl.store(out + pid, s)


def _group_plan(group: int, split: int) -> tuple[list[int], list[int], list[int], list[int], int]:
    """(A elements, B elements, A starts, B starts per program, elements of the group's buffer): programs
    (segment, projection, column split); A rows of a projection are read by each of its splits."""
    proj_ids, _ = GROUPS[group]
    a_lo, b_lo, a_n, b_n = [], [], [], []
    base = 0
    for _ in range(SEGMENTS):
        for p in proj_ids:
            k, n = DIMS[p]
            a_elems, b_elems = RANK * k, RANK * n
            for c in range(split):
                a_lo.append(base)
                b_lo.append(base + a_elems + c * (b_elems // split))
                a_n.append(a_elems)
                b_n.append(b_elems // split)
            base += a_elems + b_elems
    return a_n, b_n, a_lo, b_lo, base


def group_launcher(group: int, split: int, tma: bool, cfg: dict, pdl: bool, device: str = "cuda"):
    a_n, b_n, a_lo, b_lo, total = _group_plan(group, split)
    buf = torch.ones(total, dtype=torch.bfloat16, device=device)
    a_lo_t, a_n_t, b_lo_t, b_n_t = (torch.tensor(v, dtype=torch.int64, device=device) for v in (a_lo, a_n, b_lo, b_n))
    out = torch.empty(len(a_lo), device=device)
    kw = {"launch_pdl": True} if pdl else {}
    grid = (len(a_lo),)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor(buf.view(-1, 16), block_shape=[cfg["box"], 16])
        return lambda: _tma_program[grid](desc, out, a_lo_t, a_n_t, b_lo_t, b_n_t, BOX=cfg["box"], STAGES=cfg["stages"], PDL=pdl,
                                          num_warps=cfg["warps"], **kw)  # fmt: skip
    return lambda: _plain_program[grid](buf, out, a_lo_t, a_n_t, b_lo_t, b_n_t, BLOCK=cfg["block"], UNROLL=cfg["unroll"], PDL=pdl,
                                        num_warps=cfg["warps"], **kw)  # fmt: skip


def one_sm(timer: Timer, tma: bool, cfg: dict) -> float:
    """GB/s of one program reading 1 MB."""
    n = 1 << 19
    buf = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    lo = torch.zeros(1, dtype=torch.int64, device="cuda")
    count, none = torch.full((1,), n, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    out = torch.empty(1, device="cuda")
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor(buf.view(-1, 16), block_shape=[cfg["box"], 16])
        fn = lambda: _tma_program[(1,)](desc, out, lo, count, lo, none, BOX=cfg["box"], STAGES=cfg["stages"], PDL=False, num_warps=cfg["warps"])  # noqa: E731
    else:
        fn = lambda: _plain_program[(1,)](buf, out, lo, count, lo, none, BLOCK=cfg["block"], UNROLL=cfg["unroll"], PDL=False, num_warps=cfg["warps"])  # noqa: E731
    return 2 * n / (timer.graph(fn) * 1e3)


def main(argv: list[str] | None = None) -> int:
    args = cuda_bench_args(argv, __doc__, "bench/kernel_program_floor.py")
    if args is None:
        return 2
    torch.manual_seed(0)
    timer = Timer()
    copy_gbs = copy_bandwidth()
    pdl = pdl_supported("cuda")
    floor = structure_floor(timer, [RANK] * SEGMENTS, copy_gbs)
    res = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "command": recorded_command(), "copy_gbs": copy_gbs, "structure_floor": floor}  # fmt: skip
    res["one_program_gbs"] = {"plain": max(one_sm(timer, False, c) for c in PLAIN), "tma": max(one_sm(timer, True, c) for c in TMA)}
    print("one program reading 1 MB (GB/s):", {k: round(v, 1) for k, v in res["one_program_gbs"].items()}, flush=True)
    for tma, cfgs in ((False, PLAIN), (True, TMA)):
        name = "tma" if tma else "plain"
        for split in (1, 2, 4):
            best = []
            for g in range(4):
                times = [(timer.graph(group_launcher(g, split, tma, c, pdl)), c) for c in cfgs]
                best.append(min(times, key=lambda tc: tc[0]))
            fns = [group_launcher(g, split, tma, c, pdl) for g, (_, c) in enumerate(best)]
            chain = timer.graph(lambda fns=fns: [f() for f in fns])
            res[f"{name}_split{split}"] = {"group_us": [t for t, _ in best], "configs": [c for _, c in best], "chain4_us": chain,
                                           "chain4_x_floor": chain / floor["floor_us"]}  # fmt: skip
            print(f"{name} split {split}: groups {[round(t, 2) for t, _ in best]} us, chain of 4 {chain:.2f} us = "
                  f"{chain / floor['floor_us']:.2f}x the floor {floor['floor_us']:.2f} us", flush=True)
    write_json(args.out, "kernels_program_floor", res["date"], device_tag(torch.cuda.get_device_name()), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
