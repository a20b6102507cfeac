"""lora_linear: one base projection plus its LoRA delta, placed where it costs the layer least.

The delta of a layer's projection reads little (the batch's adapter rows) but is a chain of small,
latency-bound kernels; the base GEMM beside it is long.

* More than OVERLAP_TOKENS tokens (prefill): the delta is written first (shrink, then the expand in
  write mode: y = delta, y not read) and the GEMM adds itself to it (`y.addmm_(x, W^T)`), so y is
  read once, in the GEMM's epilogue, instead of written by the GEMM and then read and written again
  by the expand. Tokens in no segment start from zeros.
* Up to OVERLAP_TOKENS tokens (decode) on CUDA: shrink and expand (write mode) run on a side stream
  into a buffer `d`, concurrently with the GEMM that reads the same input, and one add puts `d` into
  the GEMM's output; the chain's launch latencies overlap the GEMM's weight reads. Write mode also
  spares the expand's decode program the y tiles it would hold (the accumulating one spills
  registers: H200, T=64 over 32 adapters 59.1 vs 71.6 us, kernels_gemv_trial_20261130_h200.json).
* Without a side stream (CPU, or `ForwardContext.lora_stream` None), small batches add the delta
  after the GEMM, in place.
* The MLP's gate|up at prefill (`gate_up_act`): the delta is folded into the activation that reads
  the GEMM's output (`kernels.lora.lora_silu_mul`), so the largest delta of the layer is never stored.
  H200, T=1024 over 8 adapters, in the engine's 64-token segments (medians of 25 rounds): the layer's
  LoRA then adds 9.2% to the GEMMs and `silu_mul` (kernels_20261130_h200.json; 9.3% in the run
  before, 9.1-10.6% in four A/B runs, kernels_grouped_shrink_; 8.4-11.5% for the code before the
  grouped prefill shrink), every delta before its GEMM 10.1% (9.6-11.8% earlier). Shorter segments
  gain nothing from folding (32 tokens) or lose (16): segments of fewer than
  FUSED_ACT_MIN_SEGMENT_TOKENS tokens on average are not folded.

H200, one Llama-3-8B layer (bench/results/kernels_20261130_h200.json): at T=1024 over 8 adapters the
delta written before the GEMMs adds 64.9 us to their 643 (after them: 104.2), over 32 adapters 75.9 us
(after them: 271.5), at T=256 over 8 adapters 39.0 us to 185 (after them: 51.6). The in-layer figures
move by 10-30 us between runs (the other kernels_*_20261130_h200.json files and git history).
The side stream cuts the time a decode delta adds to the layer from 30.5 to 11.8 us at T=1 and from
66.3 to 52.7 us at T=64 over 32 adapters (lora_overlap_20261130_h200.json, commit 97b8ff2).

All forms compute y = x W^T + scale * B (A x); with 16-bit weights the delta is rounded to the model
dtype once before it meets the GEMM's result, except in the folded activation, which adds it in
float32 to the GEMM's rounded output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafleet.kernels import lora
from lorafleet.kernels.activation import silu_mul
from lorafleet.kernels.lora_act import GATE, UP
from lorafleet.kernels.lora_layout import LoRABatch
from lorafleet.worker.forward_context import ForwardContext

OVERLAP_TOKENS = 64  # at most this many tokens: the delta goes to the side stream
FUSED_ACT_MAX_RANK = 128  # gate_up_act folds the gate|up delta into the activation up to this rank
# ... and from this many tokens per segment on average (64-token segments, less a run's shorter last one).
# H200, one layer: the folded gate|up step takes longer than writing every delta first, before any
# activation, by 8.4-20.9 us at T=1024 over 8 adapters in 64-token segments (three runs), 40.9-56.0 in
# 32-token segments (T=1024 over 32, three runs), 43.5 and 46.8 in 32- and 16-token ones (over 8), and
# 12.9-19.2 at T=256 over 8 (16 or 32 tokens). The unfolded path then runs `silu_mul`: 23 us in the
# layer at T=1024, 10 us alone at T=256. So folding pays in 64-token segments only (bench/results/
# kernels_20261130_h200.json, kernels_activation_ and kernels_segments_20261130_h200.json: fused - before).
# A step mixing a prefill with decode tokens averages below this (their one-token segments count) and
# is not folded; an EngineConfig.lora_segment_len below it turns folding off.
FUSED_ACT_MIN_SEGMENT_TOKENS = 48


def _delta(x: torch.Tensor, y: torch.Tensor, ctx: ForwardContext, layer: int, proj_ids: list[int], out_offsets: list[int],
           accumulate: bool = True) -> None:
    lora.lora_delta(x=x, layout=ctx.lora_layout, layer=layer, proj_ids=proj_ids, batch=ctx.lora, y=y, out_offsets=out_offsets,
                    backend=ctx.backend, accumulate=accumulate)


def _delta_buffer(x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext, proj_ids: list[int], out_offsets: list[int]) -> torch.Tensor:
    """[T, N] for the expand's write mode: uninitialised only where it writes every element. Rows it
    does not write start from zero: tokens in no segment (a batch built by hand, as for CUDA graphs,
    may pad its token list without covering every row: only `every_token` says all rows are written),
    and so do columns outside the projections' slices."""
    covered = out_offsets[0] == 0 and (len(out_offsets) == len(proj_ids) or out_offsets[-1] == weight.shape[0])
    alloc = torch.empty if ctx.lora.every_token and covered else torch.zeros
    return alloc(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext, layer: int, proj_ids: list[int],
                out_offsets: list[int]) -> torch.Tensor:
    """y = x @ weight^T, plus scale * B (A x) in the columns of each projection for tokens with an adapter.

    x: [T, K] model dtype. weight: [N, K] (fused projections: q|k|v or gate|up). proj_ids: the P
    projections' ids (kernels.lora_layout.PROJS order); out_offsets: their P slice starts in N.
    """
    batch = ctx.lora
    if batch is None or batch.max_rank == 0 or not batch.adapts(layer, proj_ids):
        return F.linear(x, weight)
    num_tokens = x.shape[0]
    if num_tokens > OVERLAP_TOKENS:
        # The delta is written first (y not read), then the GEMM adds itself to it: y = delta + x W^T.
        y = _delta_buffer(x, weight, ctx, proj_ids, out_offsets)
        _delta(x, y, ctx, layer, proj_ids, out_offsets, accumulate=False)
        return y.addmm_(x, weight.t())
    side = ctx.lora_stream
    if side is None:
        y = F.linear(x, weight)
        _delta(x, y, ctx, layer, proj_ids, out_offsets)
        return y
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        d = _delta_buffer(x, weight, ctx, proj_ids, out_offsets)
        _delta(x, d, ctx, layer, proj_ids, out_offsets, accumulate=False)
    y = F.linear(x, weight)
    main.wait_stream(side)
    # d comes from the side stream's memory; the next side-stream work that could reuse it starts only
    # after the next fork (side.wait_stream(main)), so after this read: no record_stream needed.
    y += d
    return y


def folds_act(batch: LoRABatch | None, num_tokens: int) -> bool:
    """Whether `gate_up_act` folds the gate|up delta into the activation for this step."""
    if batch is None or not 0 < batch.max_rank <= FUSED_ACT_MAX_RANK or num_tokens <= OVERLAP_TOKENS:
        return False
    return batch.sorted_token_ids.shape[0] >= FUSED_ACT_MIN_SEGMENT_TOKENS * batch.num_segments


def gate_up_act(x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
    """The MLP's act = silu(gate) * up, gate|up = x @ weight^T plus each token's LoRA delta.

    More than OVERLAP_TOKENS tokens (prefill) with adapters of rank <= FUSED_ACT_MAX_RANK and segments
    of FUSED_ACT_MIN_SEGMENT_TOKENS tokens or more on average: the shrink, the base GEMM, then
    `lora_silu_mul`, which computes the expand's tiles where it reads the GEMM's output: the [T, 2I]
    delta is never stored and read back (tokens without an adapter take the plain activation first).
    Otherwise `lora_linear`, then the activation. The plain activation is `kernels.activation.silu_mul`
    (float32, rounded once, as the folded kernel computes it).
    x: [T, K] model dtype. weight: [2I, K] (gate rows, then up rows). Returns [T, I].
    """
    batch, inter = ctx.lora, weight.shape[0] // 2
    if not folds_act(batch, x.shape[0]) or not batch.adapts(layer, [GATE, UP]):
        return silu_mul(lora_linear(x, weight, ctx, layer, [GATE, UP], [0, inter]), backend=ctx.backend)
    xa = lora.lora_xa(x=x, layout=ctx.lora_layout, layer=layer, proj_ids=[GATE, UP], batch=batch, backend=ctx.backend)
    gate_up = F.linear(x, weight)
    if batch.every_token:
        act = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    else:
        act = silu_mul(gate_up, backend=ctx.backend)  # rows in no segment keep this; the kernel rewrites the others
    lora.lora_silu_mul(gate_up=gate_up, xa=xa, layout=ctx.lora_layout, layer=layer, batch=batch, out=act, backend=ctx.backend)
    return act
