"""DecodeGraphs: decode steps replayed as CUDA graphs, so a step costs one launch of host time.

An eager decode step of an 8B model launches over a thousand kernels; their Python and launch cost
(tens of milliseconds) is the step's time on a fast GPU, and any other Python thread in the process
(adapter loads) stretches it further. A captured step is replayed with one call.

A graph is captured per (batch-size bucket, with or without adapters), all of them at engine start
(`capture_all`); a step pads its batch to its bucket and copies every per-step input into static
buffers before the replay. What makes the step capturable:

* padding rows: token 0 at position 0, `slot_mapping` -1 (writes no KV), context length 0 (attention
  returns zeros), adapter slot -1 (the LoRA kernels skip it);
* block tables always as wide as the longest sequence the engine admits;
* the LoRA batch grouped by slot on the host (`group_by_slot`, as eager steps do: one adapter's rows
  are read once for all its tokens), its segment list padded to one per row with empty segments of
  slot -1 (a program each, exiting at once), and the pool's largest rank as its rank bound: kernels
  stop at each slot's true rank;
* the adapter layout's tensors are updated in place by the pool; a graph remembers their addresses and
  is captured again should they ever change.

Prefill and mixed steps run eagerly (their shapes vary with every step).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.kernels.lora_layout import LoRABatch, LoRALayout, segment_len
from lorafleet.worker.forward_context import ForwardContext
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


def padded_groups(token_slots: list[int], most_segment_len: int, size: int) -> tuple[list[int], list[int], list[int]]:
    """`group_by_slot` at a fixed shape for `size` rows: ids [size] (past the live ones never read),
    starts [size + 1] and slots [size], the unused segments empty (start == end) and of slot -1."""
    ids, starts, slots = group_by_slot(token_slots, most_segment_len)
    return ids + [0] * (size - len(ids)), starts + [starts[-1]] * (size + 1 - len(starts)), slots + [-1] * (size - len(slots))


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
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0  # graphs captured so far (a re-capture counts again)
        self.replays = 0

    def bucket(self, num_seqs: int) -> int | None:
        """The captured size a batch of num_seqs decodes pads to (None: too large, run eagerly)."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def fits(self, inputs: DecodeInputs) -> bool:
        return self.bucket(len(inputs.input_ids)) is not None and max(map(len, inputs.block_tables)) <= self.max_blocks

    def _context(self, size: int, with_lora: bool) -> ForwardContext:
        layout = self.lora_layout() if with_lora else None
        lora = None
        if with_lora:
            lora = LoRABatch(token_slots=self.token_slots[:size], sorted_token_ids=self.sorted_ids[:size],
                             seg_starts=self.seg_starts[: size + 1], seg_slots=self.seg_slots[:size], max_rank=layout.max_rank)
        return ForwardContext(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size], context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1], num_decodes=size,
            logits_indices=self.logits_indices[:size], kv_caches=self.kv_caches, backend=self.backend,
            lora=lora, lora_layout=layout, lora_stream=self.lora_stream,
        )

    def _forward(self, ctx: ForwardContext) -> torch.Tensor:
        return self.model.compute_logits(self.model(ctx))

    def _capture(self, size: int, with_lora: bool) -> _Graph:
        self._fill(DecodeInputs([], [], [], [], [], []), size)  # padding rows only: nothing written to the KV cache
        ctx = self._context(size, with_lora)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(ctx)  # compiles the Triton kernels and settles the allocator before capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(ctx)
        self.captures += 1
        return _Graph(graph, logits, layout_key(ctx.lora_layout))

    def _fill(self, inputs: DecodeInputs, size: int) -> None:
        n = len(inputs.input_ids)
        pad = size - n
        width = self.max_blocks
        host = torch.tensor(
            [*inputs.input_ids, *[0] * pad, *inputs.positions, *[0] * pad, *inputs.slot_mapping, *[-1] * pad],
            dtype=torch.int64,
        ).view(3, size)
        sorted_ids, starts, seg_slots = padded_groups(inputs.token_slots, self.lora_segment_len, size)
        small = torch.tensor([*inputs.context_lens, *[0] * pad, *inputs.token_slots, *[-1] * pad, *sorted_ids, *seg_slots,
                              *starts], dtype=torch.int32)
        tables = np.zeros((size, width), dtype=np.int32)
        for i, t in enumerate(inputs.block_tables):
            tables[i, : len(t)] = t
        host, small, tables = host.pin_memory(), small.pin_memory(), torch.from_numpy(tables).pin_memory()
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        for i, buf in enumerate((self.context_lens, self.token_slots, self.sorted_ids, self.seg_slots)):
            buf[:size].copy_(small[i * size : (i + 1) * size], non_blocking=True)
        self.seg_starts[: size + 1].copy_(small[4 * size :], non_blocking=True)
        self.block_tables[:size].copy_(tables, non_blocking=True)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, with and without adapters, now (at start) rather than on first use."""
        for size in reversed(self.buckets):  # the largest first: its memory serves the smaller ones
            for with_lora in (False, True):
                if (size, with_lora) not in self._graphs:
                    self._graphs[(size, with_lora)] = self._capture(size, with_lora)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """float32 logits [num_seqs, V] of one decode step (`fits(inputs)` must hold)."""
        n = len(inputs.input_ids)
        size = self.bucket(n)
        with_lora = any(s >= 0 for s in inputs.token_slots)
        key = (size, with_lora)
        entry = self._graphs.get(key)
        if entry is not None and with_lora and entry.layout_key != layout_key(self.lora_layout()):
            entry = None  # the layout moved: the old graph would read stale addresses
        if entry is None:  # not captured at start, or the layout moved since
            entry = self._graphs[key] = self._capture(size, with_lora)
        self._fill(inputs, size)
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:n]
