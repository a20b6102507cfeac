"""DecodeGraphs: decode steps replayed as CUDA graphs, so a step costs one launch of host time.

An eager decode step of an 8B model launches over a thousand kernels; their Python and launch cost
(tens of milliseconds) is the step's time on a fast GPU, and any other Python thread in the process
(adapter loads) stretches it further. A captured step is replayed with one call.

A graph is captured per (batch-size bucket, rank bound, planning rank), all of them at engine start
(`capture_all`): rank bound 0 is the step without adapters, the others the rank classes of
`rank_bounds` up to the pool's largest rank, each with every class up to it as the rank the kernels
plan their grids for (a batch's mean rank: mixed ranks are not planned as if all were the largest). A
step pads its batch to its bucket, replays the graph of the smallest bound that holds its adapters'
ranks and the smallest planning rank at or above their mean, and copies every per-step input into
static buffers before the replay. The LoRA kernels size their grids and tiles for the batch's ranks
and programs for its segments: on the H200, one layer's delta for 32 rank-16 adapters took 94 us
(T=64) and 143 us (T=256) in graphs sized for the pool's rank 64 with one segment per row, against
58 and 67 us now and 54 and 58 us for the exact batch of an eager step; mixed ranks {8, 16, 32, 64}
took 141 and 210 us, now 83 and 97 us, against 83 and 88 us (planning ranks: without them, 105 and
124 us; bench/results/kernels_graph_plans_20261201_h200.json, kernels_graph_bounds_20261201_h200.json).
What makes the step capturable:

* padding rows: token 0 at position 0, `slot_mapping` -1 (writes no KV), context length 0 (attention
  returns zeros), adapter slot -1 (the LoRA kernels skip it);
* block tables always as wide as the longest sequence the engine admits;
* the LoRA batch grouped by slot on the host (`group_by_slot`, as eager steps do: one adapter's rows
  are read once for all its tokens), its segment list padded with empty segments of slot -1 (a
  program each, exiting at once) to the most a step of the bucket can cut (`graph_segments`), and the
  graph's rank bound as its max_rank: kernels stop at each slot's true rank;
* the adapter layout's tensors are updated in place by the pool; a graph remembers their addresses and
  is captured again should they ever change.

Prefill and mixed steps run eagerly (their shapes vary with every step).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.kernels.lora_layout import SEGMENT_LEN_MIN, LoRABatch, LoRALayout, segment_len
from lorafleet.worker.forward_context import ForwardContext
from lorafleet.worker.gc_pause import collections_paused
from lorafleet.worker.llama import LlamaModel


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending at max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    size = 8
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 64 else 16
    return [*sizes, max_num_seqs]


def group_by_slot(token_slots: list[int], most_segment_len: int) -> tuple[list[int], list[int], list[int]]:
    """(sorted token ids, segment starts, segment slots) of a step's tokens grouped by adapter slot.

    Tokens of one slot keep their order; slot -1 tokens are left out; a slot's run is cut into segments
    of at most `segment_len(len(token_slots), most_segment_len)` tokens (16 for a decode step, up to
    most_segment_len for a long prefill). Running example: slots [2, -1, 0, 2, 0], most 64 ->
    ids [2, 4, 0, 3], starts [0, 2, 4], slots [0, 2].
    """
    seg_len = segment_len(len(token_slots), most_segment_len)
    groups: dict[int, list[int]] = {}
    for t, s in enumerate(token_slots):
        if s >= 0:
            groups.setdefault(s, []).append(t)
    sorted_ids: list[int] = []
    seg_starts, seg_slots = [0], []
    for s in sorted(groups):
        ids = groups[s]
        sorted_ids.extend(ids)
        for start in range(0, len(ids), seg_len):
            seg_slots.append(s)
            seg_starts.append(seg_starts[-1] + min(seg_len, len(ids) - start))
    return sorted_ids, seg_starts, seg_slots


def padded_groups(token_slots: list[int], most_segment_len: int, size: int, num_segments: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """`group_by_slot` at a fixed shape for `size` rows cut into at most `num_segments` segments (default
    size): ids [size] (past the live ones never read), starts [num_segments + 1] and slots [num_segments],
    the unused segments empty (start == end) and of slot -1."""
    ids, starts, slots = group_by_slot(token_slots, most_segment_len)
    num_segments = size if num_segments is None else num_segments
    if len(slots) > num_segments:
        raise ValueError(f"padded_groups: the step cuts {len(slots)} segments, above the {num_segments} its graph holds")
    return ids + [0] * (size - len(ids)), starts + [starts[-1]] * (num_segments + 1 - len(starts)), slots + [-1] * (num_segments - len(slots))


def graph_segments(size: int, most_segment_len: int, max_slots: int) -> int:
    """The most segments `group_by_slot` cuts from a step of at most `size` tokens over `max_slots` adapter
    slots: each slot's run of n tokens gives ceil(n / L) <= n / L + 1 segments, L >= min(16, most) the
    shortest segment length (`segment_len`), so at most ceil(size / L) + the slots used, and never more
    than one per token. Running example: size 256, most 64, 16 slots -> 16 + 16 = 32 (not 256)."""
    shortest = min(most_segment_len, SEGMENT_LEN_MIN)
    return min(size, -(-size // shortest) + min(max_slots, size))


def rank_bounds(max_rank: int) -> list[int]:
    """Rank bounds of the captured LoRA graphs for a pool of rank max_rank: the kernels' rank classes 16,
    32, 64, 128... below it, then max_rank. Running example: 64 -> [16, 32, 64]; 100 -> [16, 32, 64, 100]; 8 -> [8]."""
    bounds, r = [], 16
    while r < max_rank:
        bounds.append(r)
        r *= 2
    return [*bounds, max_rank]


def graph_ranks(pool_max_rank: int, max_rank: int, mean_rank: float) -> tuple[int, int]:
    """(rank bound, planning rank) of the graph a step replays in a pool of rank pool_max_rank: the smallest
    bound at or above the step's largest rank (0, unknown: the pool's), and the smallest one at or above
    its mean rank (0: the bound). Running example, pool 64: ranks {8, 16} -> (16, 16); {8, 40}, mean 20 -> (64, 32)."""
    bounds = rank_bounds(pool_max_rank)

    def pick(rank: float) -> int:
        return bounds[min(bisect.bisect_left(bounds, rank), len(bounds) - 1)]

    bound = pick(max_rank or pool_max_rank)
    return bound, min(bound, pick(mean_rank or bound))


def layout_key(layout: LoRALayout | None) -> tuple:
    """Addresses a captured graph reads the adapter layout from."""
    if layout is None:
        return ()
    return tuple(t.data_ptr() for t in (layout.pool, layout.ranks, layout.scales, layout.a_offsets, layout.b_offsets))


@dataclass
class DecodeInputs:
    """Host-side inputs of one decode step (one token per sequence), before padding."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    token_slots: list[int]  # adapter slot per sequence, -1 = none
    max_rank: int = 0  # largest rank of the step's adapters (host-side); 0: unknown, the graph of the pool's rank
    mean_rank: float = 0.0  # their mean over the step's tokens with an adapter; 0: unknown, planned for max_rank


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # float32 [bucket, V], written by each replay
    layout_key: tuple


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
        backend: str,
        lora_layout: Callable[[], LoRALayout | None],
        lora_stream: torch.cuda.Stream | None = None,
        lora_segment_len: int = 64,
    ) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.kv_caches, self.device, self.backend = model, kv_caches, device, backend
        self.lora_layout, self.lora_stream = lora_layout, lora_stream
        self.buckets = batch_buckets(max_num_seqs)
        n = self.buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.context_lens = torch.zeros(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.token_slots = torch.full((n,), -1, **i32)
        self.sorted_ids = torch.zeros(n, **i32)
        self.seg_starts = torch.zeros(n + 1, **i32)
        self.seg_slots = torch.full((n,), -1, **i32)
        self.lora_segment_len = lora_segment_len
        self.logits_indices = torch.arange(n, **i64)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.max_blocks = max_blocks
        self.logits: torch.Tensor | None = None  # float32 [n, V]: every graph writes its rows here (one buffer for all)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}  # (bucket, rank bound, planning rank; 0, 0: no adapters) -> graph
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0  # graphs captured so far (a re-capture counts again)
        self.replays = 0
        self.replays_by_bound: collections.Counter[int] = collections.Counter()  # replays per rank bound (0: no adapters)

    def bucket(self, num_seqs: int) -> int | None:
        """The captured size a batch of num_seqs decodes pads to (None: too large, run eagerly)."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def fits(self, inputs: DecodeInputs) -> bool:
        return self.bucket(len(inputs.input_ids)) is not None and max(map(len, inputs.block_tables)) <= self.max_blocks

    def graph_key(self, inputs: DecodeInputs, size: int) -> tuple[int, int, int]:
        """(bucket, rank bound, planning rank) of the graph a step replays."""
        layout = self.lora_layout()
        if layout is None or not any(s >= 0 for s in inputs.token_slots):
            return size, 0, 0
        return size, *graph_ranks(layout.max_rank, inputs.max_rank, inputs.mean_rank)

    def _num_segments(self, size: int) -> int:
        layout = self.lora_layout()
        return graph_segments(size, self.lora_segment_len, layout.max_slots if layout is not None else size)

    def _context(self, size: int, bound: int, plan: int) -> ForwardContext:
        layout = self.lora_layout() if bound else None
        lora = None
        if bound:
            segs = self._num_segments(size)
            lora = LoRABatch(token_slots=self.token_slots[:size], sorted_token_ids=self.sorted_ids[:size],
                             seg_starts=self.seg_starts[: segs + 1], seg_slots=self.seg_slots[:segs], max_rank=bound,
                             mean_rank=float(plan))
        return ForwardContext(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size], context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1], num_decodes=size,
            logits_indices=self.logits_indices[:size], kv_caches=self.kv_caches, backend=self.backend,
            lora=lora, lora_layout=layout, lora_stream=self.lora_stream,
        )

    def _forward(self, ctx: ForwardContext, size: int) -> torch.Tensor:
        if self.logits is None:
            self.logits = torch.empty(self.buckets[-1], self.model.lm_head.shape[0], dtype=torch.float32, device=self.device)
        return self.model.compute_logits(self.model(ctx), out=self.logits[:size])

    def _capture(self, size: int, bound: int, plan: int) -> _Graph:
        self._fill(DecodeInputs([], [], [], [], [], []), size)  # padding rows only: nothing written to the KV cache
        ctx = self._context(size, bound, plan)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(ctx, size)  # compiles the Triton kernels and settles the allocator before capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture: another thread's CUDA call meanwhile (an adapter read pinning host memory while
        # a step re-captures at runtime) neither fails nor invalidates the capture, as the default global mode
        # would. And no garbage collection inside it: the graph's `__enter__` collects first, and a collection
        # triggered mid-capture could run the destructors of CUDA objects an earlier engine left.
        # (collections_paused: another thread's pause, a request body's parse, ending meanwhile must not turn
        # collections back on.)
        with collections_paused(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(ctx, size)
        self.captures += 1
        return _Graph(graph, logits, layout_key(ctx.lora_layout))

    def _fill(self, inputs: DecodeInputs, size: int) -> None:
        n = len(inputs.input_ids)
        pad = size - n
        host = torch.tensor(
            [*inputs.input_ids, *[0] * pad, *inputs.positions, *[0] * pad, *inputs.slot_mapping, *[-1] * pad],
            dtype=torch.int64,
        ).view(3, size)
        segs = self._num_segments(size)
        sorted_ids, starts, seg_slots = padded_groups(inputs.token_slots, self.lora_segment_len, size, segs)
        small = torch.tensor([*inputs.context_lens, *[0] * pad, *inputs.token_slots, *[-1] * pad, *sorted_ids, *seg_slots,
                              *starts], dtype=torch.int32)
        # Only the columns this batch's longest table uses: the kernels read a row's entries up to its context
        # only, so those past it may keep an earlier step's pages (a copy of max_blocks columns each step is
        # megabytes at long context lengths).
        width = max((len(t) for t in inputs.block_tables), default=0) or 1
        tables = np.zeros((size, width), dtype=np.int32)
        for i, t in enumerate(inputs.block_tables):
            tables[i, : len(t)] = t
        host, small, tables = host.pin_memory(), small.pin_memory(), torch.from_numpy(tables).pin_memory()
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        for i, buf in enumerate((self.context_lens, self.token_slots, self.sorted_ids)):
            buf[:size].copy_(small[i * size : (i + 1) * size], non_blocking=True)
        self.seg_slots[:segs].copy_(small[3 * size : 3 * size + segs], non_blocking=True)
        self.seg_starts[: segs + 1].copy_(small[3 * size + segs :], non_blocking=True)
        self.block_tables[:size, :width].copy_(tables, non_blocking=True)

    def _start_keys(self) -> list[tuple[int, int, int]]:
        """(bucket, rank bound, planning rank) of every graph captured at start: each bucket without
        adapters and at each bound and planning rank, the largest bucket first (its memory serves the
        smaller ones)."""
        layout = self.lora_layout()
        bounds = rank_bounds(layout.max_rank) if layout is not None else []
        ranks = [(0, 0), *((bound, plan) for bound in bounds for plan in bounds if plan <= bound)]
        return [(size, bound, plan) for size in reversed(self.buckets) for bound, plan in ranks]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every graph of `_start_keys` now (at start) rather than on first use."""
        for key in self._start_keys():
            if key not in self._graphs:
                self._graphs[key] = self._capture(*key)

    @torch.inference_mode()
    def rehearse_all(self) -> None:
        """Run the forward of every capture `capture_all` would make, eagerly and captured into nothing:
        under kernels.compile_ahead.launches_recorded this lists the Triton kernels the captures need."""
        for size, bound, plan in self._start_keys():
            self._fill(DecodeInputs([], [], [], [], [], []), size)
            self._forward(self._context(size, bound, plan), size)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """float32 logits [num_seqs, V] of one decode step (`fits(inputs)` must hold)."""
        n = len(inputs.input_ids)
        size = self.bucket(n)
        key = self.graph_key(inputs, size)
        _, bound, plan = key
        entry = self._graphs.get(key)
        if entry is not None and bound and entry.layout_key != layout_key(self.lora_layout()):
            entry = None  # the layout moved: the old graph would read stale addresses
        if entry is None:  # not captured at start, or the layout moved since
            entry = self._graphs[key] = self._capture(size, bound, plan)
        self._fill(inputs, size)
        entry.graph.replay()
        self.replays += 1
        self.replays_by_bound[bound] += 1
        return entry.logits[:n]
