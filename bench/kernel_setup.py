"""Setup of bench/lora_kernels.py: Llama-3-8B shapes, the cold-L2 graph timer, a copy-bandwidth probe, a
layer of adapters packed by the pool's rule, and one layer's LoRA inputs and outputs."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from lorafleet.kernels.lora import lora_delta, shrink_buffer
from lorafleet.kernels.lora_layout import (
    NUM_PROJS,
    LoRABatch,
    LoRALayout,
    make_lora_batch,
    place_rows,
    segment_len,
)
from lorafleet.kernels.lora_reference import lora_expand_reference, lora_shrink_reference
from lorafleet.kernels.lora_triton import lora_expand_triton, lora_shrink_triton
from lorafleet.worker.cuda_graphs import graph_ranks, graph_segments, padded_groups

HIDDEN, INTER, Q_SIZE, KV_SIZE = 4096, 14336, 4096, 1024
DIMS = {0: (HIDDEN, Q_SIZE), 1: (HIDDEN, KV_SIZE), 2: (HIDDEN, KV_SIZE), 3: (Q_SIZE, HIDDEN), 4: (HIDDEN, INTER), 5: (HIDDEN, INTER), 6: (INTER, HIDDEN)}
GROUPS = [([0, 1, 2], [Q_SIZE, KV_SIZE, KV_SIZE]), ([3], [HIDDEN]), ([4, 5], [INTER, INTER]), ([6], [HIDDEN])]
PAGE_ELEMS = 32 * 2 * 16 * 8 * 128  # one KV page of Llama-3-8B (32 layers, block 16, 8 KV heads of 128)
TOKENS = (1, 16, 64, 256, 1024)
ADAPTERS = (1, 8, 32, 64)
RANKS = {"8": [8], "16": [16], "64": [64], "mixed": [8, 16, 32, 64], "30": [30]}
DT = torch.bfloat16


def cuda_bench_args(argv: list[str] | None, doc: str, script: str):
    """A GPU benchmark's `--out` argument (parsed), or None after saying on stderr that it needs a CUDA GPU."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return None
    return args


def recorded_command() -> str:
    """This script's command line for a result file, absolute paths shown by their last part only."""
    return " ".join(["python", *(f"<{Path(a).name}>" if Path(a).is_absolute() else a for a in sys.argv)])


class Timer:
    """Cold-L2 CUDA-graph replay timing: reps x (flush, fn) minus reps x flush, median of several replays."""

    def __init__(self, reps: int = 20, replays: int = 7) -> None:
        self.reps, self.replays = reps, replays
        self.flush_buf = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        self.sink = torch.empty((), dtype=torch.int64, device="cuda")
        self.flush_us = self._graph_us(lambda: None)

    def _flush(self) -> None:
        torch.sum(self.flush_buf.view(torch.int64), dim=0, out=self.sink)  # a read: leaves the L2 clean

    def _graph_us(self, fn, cold: bool = True) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._flush()
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.reps):
                if cold:
                    self._flush()
                fn()
        graph.replay()
        times = []
        for _ in range(self.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / self.reps)
        return statistics.median(times)

    def graph(self, fn, cold: bool = True) -> float:
        """Microseconds per call of fn replayed from a graph; cold: the L2 flushed before each call, else
        fn's data left in L2 by the previous call (where it fits)."""
        return max(self._graph_us(fn) - self.flush_us, 0.0) if cold else self._graph_us(fn, cold=False)

    def eager(self, fn, reps: int = 5) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            self._flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000)
        return statistics.median(times)


def copy_bandwidth() -> float:
    """Device copy, bytes read + written per second (GB/s), 2 GiB buffers."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    return 2 * src.numel() * 2 / seconds / 1e9


def build_layout(ranks_by_slot: list[int], gen: torch.Generator) -> tuple[LoRALayout, dict]:
    """One layer of adapters packed by the pool's rule, random weights written in place; dense copies for the loop."""
    lengths, owners = [], []
    for slot, r in enumerate(ranks_by_slot):
        for proj in range(NUM_PROJS):
            k, n = DIMS[proj]
            lengths += [k] * r + [n] * r
            owners.append((slot, proj, r))
    placements = place_rows(lengths, PAGE_ELEMS)
    num_pages = placements[-1][0] + 1
    pool = torch.empty(num_pages, PAGE_ELEMS, dtype=DT, device="cuda")
    pool.normal_(0, 0.02, generator=gen)
    num_slots, max_rank = len(ranks_by_slot), max(ranks_by_slot)
    offsets = torch.tensor([p * PAGE_ELEMS + o for p, o in placements], dtype=torch.int64)
    ranks = torch.zeros(1, NUM_PROJS, num_slots, dtype=torch.int32)
    scales = torch.zeros(1, NUM_PROJS, num_slots)
    a_off = torch.zeros(1, NUM_PROJS, num_slots, max_rank, dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    dense, cursor, flat = {}, 0, pool.view(-1)
    for slot, proj, r in owners:
        k, n = DIMS[proj]
        ranks[0, proj, slot], scales[0, proj, slot] = r, 2.0
        a_off[0, proj, slot, :r] = offsets[cursor : cursor + r]
        b_off[0, proj, slot, :r] = offsets[cursor + r : cursor + 2 * r]
        a_idx = offsets[cursor : cursor + r, None].cuda() + torch.arange(k, device="cuda")
        b_idx = offsets[cursor + r : cursor + 2 * r, None].cuda() + torch.arange(n, device="cuda")
        dense[(slot, proj)] = (flat[a_idx], flat[b_idx].t().contiguous())  # A [r, k], B [n, r]
        cursor += 2 * r
    layout = LoRALayout(pool=pool, ranks=ranks.cuda(), scales=scales.cuda(), a_offsets=a_off.cuda(), b_offsets=b_off.cuda(), row_align=8)
    return layout, dense


def widened(layout: LoRALayout, max_rank: int) -> LoRALayout:
    """The same adapters in a layout whose rank bound is max_rank, as the engine's pool holds them
    (--max-lora-rank, default 64): row offset tables padded with zeros past each slot's rank."""
    pad = max_rank - layout.max_rank
    if pad < 0:
        raise ValueError(f"widened: the layout's rank bound {layout.max_rank} is above {max_rank}")
    grow = lambda t: torch.nn.functional.pad(t, (0, pad)).contiguous()
    return LoRALayout(pool=layout.pool, ranks=layout.ranks, scales=layout.scales, a_offsets=grow(layout.a_offsets), b_offsets=grow(layout.b_offsets),
                      row_align=layout.row_align, widths=layout.widths)  # fmt: skip


def graph_batch(slots: torch.Tensor, layout: LoRALayout, most_segment_len: int, pool_bound: bool = False) -> LoRABatch:
    """The LoRA batch a captured decode step replays (worker/cuda_graphs.py): segments padded with empty
    ones of slot -1 to the most the step's size can cut, the rank bound and planning rank of the graph
    its adapters' ranks pick (`graph_ranks`).
    pool_bound: the shape graphs had before rank bounds, one segment per row and the pool's rank."""
    size = slots.shape[0]
    ranks = layout.max_rank_by_slot()[slots[slots >= 0].long()].float()
    bound, plan = graph_ranks(layout.max_rank, int(ranks.max()), float(ranks.mean())) if ranks.numel() else (0, 0)
    segs = graph_segments(size, most_segment_len, layout.max_slots)
    if pool_bound:
        bound, plan, segs = layout.max_rank, 0, size
    ids, starts, seg_slots = padded_groups(slots.tolist(), most_segment_len, size, segs)
    i32 = {"dtype": torch.int32, "device": slots.device}
    return LoRABatch(slots, torch.tensor(ids, **i32), torch.tensor(starts, **i32), torch.tensor(seg_slots, **i32), max_rank=bound,
                     mean_rank=float(plan))


def stack_adapters(dense: dict, num_slots: int) -> dict:
    """Per projection, every slot's A [S, R, k] and B [S, n, R] stacked, zero rows past a slot's rank (R: the
    largest): the slot-stacked layout a torch gather+bmm delta reads."""
    pad = torch.nn.functional.pad
    stacks = {}
    for proj in sorted({p for _, p in dense}):
        pairs = [dense[(s, proj)] for s in range(num_slots)]
        r = max(a.shape[0] for a, _ in pairs)
        stacks[proj] = (torch.stack([pad(a, (0, 0, 0, r - a.shape[0])) for a, _ in pairs]), torch.stack([pad(b, (0, r - b.shape[1])) for _, b in pairs]))
    return stacks


def gather_bmm(x: torch.Tensor, slots: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, scale: float) -> torch.Tensor:
    """One projection's delta in plain torch, Punica's BGMV as gathers and batched matmuls: each token's A and B
    gathered from the stacks ([T, R, k] and [T, n, R]), then x @ A^T @ B^T; slot -1 gives zeros."""
    idx = slots.clamp(min=0).long()
    xa = torch.bmm(x[:, None, :], a_stack[idx].transpose(1, 2))  # [T, 1, R]
    delta = torch.bmm(xa, b_stack[idx].transpose(1, 2)).squeeze(1) * scale  # [T, n]
    return torch.where((slots >= 0)[:, None], delta, 0.0)


def adapter_bytes(ranks: list[int]) -> int:
    return sum(r * (k + n) * 2 for r in ranks for k, n in DIMS.values())


def activation_bytes(num_tokens: int) -> int:
    """The other bytes a layer's delta must move: each group's input read once by its shrink (x for q|k|v and
    gate|up, the attention's output for o, the activation for down) and each group's delta written once by its
    expand (the engine's write mode). The rank-wide float32 intermediate (under 1% of these) is left out."""
    inputs = sum(DIMS[projs[0]][0] for projs, _ in GROUPS)
    outputs = sum(sum(widths) for _, widths in GROUPS)
    return num_tokens * (inputs + outputs) * torch.finfo(DT).bits // 8


class LoRALayer:
    """Inputs and outputs of one layer's four fused LoRA groups for T tokens; run with any backend."""

    def __init__(self, layout: LoRALayout, dense: dict, num_tokens: int, num_adapters: int, gen: torch.Generator, grouped: bool = True,
                 most_segment_len: int = 64, graph_shaped: str = "") -> None:  # fmt: skip
        """graph_shaped: "engine", the batch as a captured decode step holds it (`graph_batch`); "pool_bound",
        as it did before rank bounds; "": the step's exact batch, as an eager step builds it."""
        self.layout, self.dense = layout, dense
        self.slots = (torch.arange(num_tokens, device="cuda") % num_adapters).to(torch.int32)
        # Segments as the engine cuts them (16 tokens in a small step, up to most_segment_len in a long one).
        self.segment_len = segment_len(num_tokens, most_segment_len)
        if graph_shaped:
            self.batch = graph_batch(self.slots, layout, most_segment_len, pool_bound=graph_shaped == "pool_bound")
        else:
            self.batch = make_lora_batch(self.slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=self.segment_len)
        self.xs = [torch.randn(num_tokens, DIMS[p[0]][0], device="cuda", generator=gen).to(DT) for p, _ in GROUPS]
        self.ys = [torch.zeros(num_tokens, sum(w), dtype=DT, device="cuda") for _, w in GROUPS]
        self.xas = [shrink_buffer(x=x, proj_ids=p, batch=self.batch, backend="triton") for x, (p, _) in zip(self.xs, GROUPS, strict=True)]
        self.slices = [[(sum(w[:i]), w[i]) for i in range(len(w))] for _, w in GROUPS]

    def triton(self, accumulate: bool = False) -> None:
        """The engine's delta: `lora_delta` per group, shrink then expand in write mode (y = delta, y not
        read; the GEMM, or one add beside it, combines them: worker/lora_linear.py); accumulate=True adds
        the delta into y instead (y read and written)."""
        for (proj_ids, _), x, y, sl in zip(GROUPS, self.xs, self.ys, self.slices, strict=True):
            lora_delta(x=x, layout=self.layout, layer=0, proj_ids=proj_ids, batch=self.batch, y=y, out_offsets=[a for a, _ in sl], accumulate=accumulate)

    def kernels(self, class_tile_elems: int = 8192) -> None:
        """Shrink and expand (write mode) with the expand's per-rank-class tiles of class_tile_elems elements (a sweep)."""
        for (proj_ids, _), x, y, xa, sl in zip(GROUPS, self.xs, self.ys, self.xas, self.slices, strict=True):
            lora_shrink_triton(x=x, layout=self.layout, layer=0, proj_ids=proj_ids, batch=self.batch, out=xa)
            lora_expand_triton(xa=xa, layout=self.layout, layer=0, proj_ids=proj_ids, batch=self.batch, y=y, out_slices=sl, class_tile_elems=class_tile_elems,
                               accumulate=False)

    def reference(self) -> None:
        for (proj_ids, _), x, y, xa, sl in zip(GROUPS, self.xs, self.ys, self.xas, self.slices, strict=True):
            lora_shrink_reference(x=x, layout=self.layout, layer=0, proj_ids=proj_ids, batch=self.batch, out=xa)
            lora_expand_reference(xa=xa, layout=self.layout, layer=0, proj_ids=proj_ids, batch=self.batch, y=y, out_slices=sl)

    def gather_bmm(self) -> None:
        """The torch gather+bmm baseline (`gather_bmm`) over slot-stacked copies of the adapters, y = delta."""
        if not hasattr(self, "stacks"):
            self.stacks = stack_adapters(self.dense, int(self.slots.max()) + 1)
        for (proj_ids, _), x, y, sl in zip(GROUPS, self.xs, self.ys, self.slices, strict=True):
            for proj, (start, n) in zip(proj_ids, sl, strict=True):
                y[:, start : start + n] = gather_bmm(x, self.slots, *self.stacks[proj], 2.0)

    def loop(self) -> None:
        """The naive baseline: one small matmul chain per adapter and projection (each adapter once, however
        many segments its tokens take)."""
        for slot in sorted(set(self.batch.seg_slots.tolist()) - {-1}):
            idx = (self.slots == slot).nonzero().squeeze(1)
            for (proj_ids, _), x, y, sl in zip(GROUPS, self.xs, self.ys, self.slices, strict=True):
                xs = x[idx]
                for proj, (start, n) in zip(proj_ids, sl, strict=True):
                    a, b = self.dense[(slot, proj)]
                    y[idx, start : start + n] += ((xs @ a.t()) @ b.t()) * 2.0
