"""The structure floor of a decode delta with one kernel per group, synchronised by Hopper clusters.

    python bench/kernel_cluster_floor.py --out bench/results   # writes kernels_cluster_floor_<date>_<gpu>.json

The layer's decode delta is eight dependent kernels (bench/kernel_floor.py measures what eight, four
and one kernels that only read the LoRA kernels' bytes cost). Four kernels, one per group, would
need each segment's shrink (a sum over K, split over several programs) finished before its expand
starts, inside one launch. A thread-block cluster gives that barrier in hardware: the programs of a
cluster are scheduled together, so none waits for a program that never runs. Here each segment (32
adapters at rank 16, one segment each) gets a cluster of C programs; program c reads its share of
the segment's A bytes, writes a partial sum, meets its cluster at `barrier.cluster`, reads the
cluster's partials, then reads its share of the segment's B bytes. Reads only, contiguous buffers,
no gathers, no tensor-core tiles: what such a design costs before any of its arithmetic. The same
kernel without the barrier (no clusters, the same two phases) and kernel_floor's chains are timed in
the same run.

Triton 3.6 compiles a kernel for one CTA and launches `num_ctas` CTAs per program as a cluster (grid
x num_ctas CTAs, cluster size num_ctas); the launcher reads num_ctas from the compiled kernel's
packed metadata, which `_as_clusters` rewrites after compiling with num_ctas=1, so that each CTA is
an independent program (program_id counts CTAs) and clusters group C consecutive ones.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_io import device_tag  # same folder
from kernel_floor import kernel_bytes, read_range, structure_floor  # same folder
from kernel_setup import Timer, copy_bandwidth, recorded_command  # same folder

from lorafleet.kernels.lora_sgmv import gdc_launch_dependents, gdc_wait
from lorafleet.kernels.lora_triton import pdl_supported

SEGMENTS, RANK = 32, 16
# (cluster size, elements per load, loads in flight per step, warps): the best per group is kept.
VARIANTS = [(c, b, u, w) for c in (4, 8, 16) for b, u in ((2048, 2), (1024, 4), (2048, 4), (4096, 2)) for w in (8, 16)]


@triton.jit
def _cluster_rank(pid):
    return tl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cluster_barrier(pid):
    """Every thread of every CTA of the cluster arrives (release) and waits (acquire)."""
    return tl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\nmov.u32 $0, 0;",
                                     "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def group_reads(a_src, b_src, part, out, a_n, b_n, a_per, b_per, C: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                PDL: tl.constexpr, SYNC: tl.constexpr, B_FIRST: tl.constexpr = False):  # fmt: skip
    """One group's reads: a_per elements of A, a partial stored; with SYNC a cluster barrier and the C
    partials of the cluster read back; then b_per elements of B. out[pid] depends on all of them. With
    B_FIRST the B elements are read before the barrier (B does not depend on the shrink: a kernel could
    hold its share in registers while its cluster finishes), so only the partials are read after it."""
    pid = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    a_sum = read_range(a_src, pid * a_per, tl.minimum(pid * a_per + a_per, a_n), BLOCK, UNROLL)
    tl.store(part + pid, a_sum)
    b_sum = 0.0
    if B_FIRST:
        b_sum = read_range(b_src, pid * b_per, tl.minimum(pid * b_per + b_per, b_n), BLOCK, UNROLL)
    if SYNC:
        rank = _cluster_rank(pid)
        _cluster_barrier(pid)
        a_sum = tl.sum(tl.load(part + (pid - rank) + tl.arange(0, C), cache_modifier=".cg"), axis=0)
    if not B_FIRST:
        b_sum = read_range(b_src, pid * b_per, tl.minimum(pid * b_per + b_per, b_n), BLOCK, UNROLL)
    tl.store(out + pid, a_sum + b_sum)


def _as_clusters(compiled, size: int) -> None:
    """Launch this compiled kernel as clusters of `size` CTAs (see the module docstring)."""
    meta = compiled.packed_metadata
    if isinstance(meta, tuple) and len(meta) == 3 and meta[1] == size:
        return
    if not (isinstance(meta, tuple) and len(meta) == 3 and meta[1] == 1):
        raise RuntimeError(f"this Triton's launcher metadata is not (num_warps, num_ctas, shared): {meta!r}")
    compiled.packed_metadata = (meta[0], size, meta[2])


def cluster_barrier_works(size: int = 4, clusters: int = 8) -> bool:
    """Each CTA sums 128 elements of A (all 2) into its partial, meets its cluster and adds up the cluster's
    partials (zero before): every out is 256 * size only if no CTA read a partial before it was written."""
    n = size * clusters
    src = torch.full((n * 128,), 2.0, dtype=torch.bfloat16, device="cuda")
    part = torch.zeros(n, device="cuda")
    out = torch.zeros_like(part)
    args = (src, src, part, out, n * 128, 0, 128, 128)  # b_n = 0: no B reads
    kw = dict(C=size, BLOCK=128, UNROLL=1, PDL=False, SYNC=True)
    _as_clusters(group_reads.warmup(*args, grid=(clusters,), **kw), size)  # compiled, not run
    group_reads[(clusters,)](*args, **kw)
    torch.cuda.synchronize()
    return bool((out == 256.0 * size).all())


def cluster_chain(timer: Timer) -> dict:
    """Each group's best variant with and without the cluster barrier, and the chain of the four."""
    sizes = kernel_bytes([RANK] * SEGMENTS)
    bufs = [torch.ones(s // 2, dtype=torch.bfloat16, device="cuda") for s in sizes]
    part = torch.zeros(SEGMENTS * 16 + 16, device="cuda")
    out = torch.zeros_like(part)
    pdl = pdl_supported("cuda")

    def launcher(group: int, size: int, block: int, unroll: int, warps: int, sync: bool, b_first: bool):
        a, b = bufs[2 * group], bufs[2 * group + 1]
        n = SEGMENTS * size
        args = (a, b, part, out, a.numel(), b.numel(), triton.cdiv(a.numel(), n), triton.cdiv(b.numel(), n))
        kw = dict(C=size, BLOCK=block, UNROLL=unroll, PDL=pdl, SYNC=sync, B_FIRST=b_first, num_warps=warps, **({"launch_pdl": True} if pdl else {}))
        grid = (SEGMENTS,) if sync else (n,)
        if sync:  # SYNC's specializations are only ever launched as clusters
            _as_clusters(group_reads.warmup(*args, grid=grid, **kw), size)
        return lambda: group_reads[grid](*args, **kw)

    res = {}
    for mode, sync, b_first in (("cluster_barrier", True, False), ("cluster_barrier_b_first", True, True), ("no_barrier", False, False)):
        best = [min((timer.graph(launcher(g, *v, sync, b_first)), v) for v in VARIANTS) for g in range(4)]
        fns = [launcher(g, *v, sync, b_first) for g, (_, v) in enumerate(best)]
        res[mode] = {"group_us": [t for t, _ in best], "variants": [list(v) for _, v in best], "chain4_us": timer.graph(lambda fns=fns: [f() for f in fns])}
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("bench/kernel_cluster_floor.py needs a Hopper-or-newer CUDA GPU", file=sys.stderr)
        return 2
    barrier_ok = cluster_barrier_works()
    print(f"cluster barrier: {'holds' if barrier_ok else 'BROKEN'}", flush=True)
    timer = Timer()
    copy_gbs = copy_bandwidth()
    floor = structure_floor(timer, [RANK] * SEGMENTS, copy_gbs)
    chains = cluster_chain(timer)
    print(f"\ncopy {copy_gbs:.0f} GB/s; floor {floor['floor_us']:.1f} us (32 adapters, r={RANK}, one layer)")
    print(f"{'design (reads only)':<44} {'us':>6} {'x floor':>8}")
    rows = [("8 dependent kernels (the engine's shape)", floor["chain8_us"]), ("4 kernels, one per group", floor["chain4_us"]),
            ("4 kernels, two phases, no barrier", chains["no_barrier"]["chain4_us"]),
            ("4 kernels, two phases, cluster barrier", chains["cluster_barrier"]["chain4_us"]),
            ("4 kernels, cluster barrier, B read before it", chains["cluster_barrier_b_first"]["chain4_us"]), ("1 kernel", floor["one_us"])]  # fmt: skip
    for name, us in rows:
        print(f"{name:<44} {us:>6.1f} {us / floor['floor_us']:>8.2f}")
    for mode, res in chains.items():
        res["x_floor"] = res["chain4_us"] / floor["floor_us"]
        print(f"{mode}: per group {[round(t, 1) for t in res['group_us']]} us, variants (cluster, block, unroll, warps) {res['variants']}")
    name = f"kernels_cluster_floor_{datetime.date.today():%Y%m%d}_{device_tag(torch.cuda.get_device_name())}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"date": f"{datetime.date.today()}", "command": recorded_command(), "device": torch.cuda.get_device_name(),
                                                 "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": copy_gbs,
                                                 "cluster_barrier_holds": barrier_ok, "structure_floor": floor, "clusters": chains}, indent=1))  # fmt: skip
    print(f"wrote {out / name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
