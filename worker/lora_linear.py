"""lora_linear: one base projection plus its LoRA delta, the delta hidden under the base GEMM on CUDA.

The delta of a layer's projection reads little (the batch's adapter rows) but is a chain of small,
latency-bound kernels; the base GEMM beside it is long. On CUDA the delta therefore runs on a side
stream, concurrently with the GEMM that reads the same input:

* up to OVERLAP_TOKENS tokens (decode, small mixed steps): shrink and expand both run on the side
  stream into a zeroed buffer `d`, and one add puts `d` into the GEMM's output. The whole chain hides
  under the GEMM, which at these sizes is bound by its weight reads: the step pays about the adapter
  bytes' share of the memory bandwidth, not the chain's launch latencies.
* more tokens (prefill): only the shrink runs beside the GEMM (it reads x, which the compute-bound GEMM
  reads too); the expand adds into the GEMM's output in place afterwards, as `d` would cost a write and
  a read of the whole output.

Without a side stream (CPU, or `ForwardContext.lora_stream` None) the delta follows the GEMM in place.
Both forms compute y = x W^T + scale * B (A x); with 16-bit weights the overlapped form rounds the
delta to the model dtype once before the add (it is added to an already rounded output either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafleet.kernels import lora
from lorafleet.worker.forward_context import ForwardContext

OVERLAP_TOKENS = 256  # at most this many tokens: the whole delta goes to the side stream


def _shrink(x: torch.Tensor, ctx: ForwardContext, layer: int, proj_ids: list[int]) -> torch.Tensor:
    xa = lora.shrink_buffer(x=x, proj_ids=proj_ids, batch=ctx.lora, backend=ctx.backend)
    lora.lora_shrink(x=x, layout=ctx.lora_layout, layer=layer, proj_ids=proj_ids, batch=ctx.lora, out=xa,
                     backend=ctx.backend)
    return xa


def _expand(xa: torch.Tensor, y: torch.Tensor, ctx: ForwardContext, layer: int, proj_ids: list[int],
            out_offsets: list[int]) -> None:
    lora.lora_expand(xa=xa, layout=ctx.lora_layout, layer=layer, proj_ids=proj_ids, batch=ctx.lora, y=y,
                     out_offsets=out_offsets, backend=ctx.backend)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext, layer: int, proj_ids: list[int],
                out_offsets: list[int]) -> torch.Tensor:
    """y = x @ weight^T, plus scale * B (A x) in the columns of each projection for tokens with an adapter.

    x: [T, K] model dtype. weight: [N, K] (fused projections: q|k|v or gate|up). proj_ids: the P
    projections' ids (kernels.lora_layout.PROJS order); out_offsets: their P slice starts in N.
    """
    batch = ctx.lora
    if batch is None or batch.max_rank == 0:
        return F.linear(x, weight)
    side = ctx.lora_stream
    if side is None:
        y = F.linear(x, weight)
        _expand(_shrink(x, ctx, layer, proj_ids), y, ctx, layer, proj_ids, out_offsets)
        return y
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    whole = x.shape[0] <= OVERLAP_TOKENS
    with torch.cuda.stream(side):
        xa = _shrink(x, ctx, layer, proj_ids)
        if whole:
            d = torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
            _expand(xa, d, ctx, layer, proj_ids, out_offsets)
    y = F.linear(x, weight)
    main.wait_stream(side)
    # xa and d come from the side stream's memory; the next side-stream work that could reuse it starts
    # only after the next fork (side.wait_stream(main)), so after the reads below: no record_stream needed.
    if whole:
        y += d
    else:
        _expand(xa, y, ctx, layer, proj_ids, out_offsets)
    return y
