"""lora_linear: one base projection plus its LoRA delta, the delta hidden under the base GEMM on CUDA.

The delta of a layer's projection reads little (the batch's adapter rows) but is a chain of small,
latency-bound kernels; the base GEMM beside it is long. On CUDA the delta therefore runs on a side
stream, concurrently with the GEMM that reads the same input:

* up to OVERLAP_TOKENS tokens (decode): shrink and expand both run on the side stream into a zeroed
  buffer `d`, and one add puts `d` into the GEMM's output; the chain's launch latencies overlap the
  GEMM's weight reads.
* more tokens: the delta follows the GEMM in place.

bench/lora_overlap.py (H200, one Llama-3-8B layer, bench/results/lora_overlap_20261130_h200.json): the
side stream cuts the time the delta adds to the layer from 27.8 to 9.1 us at T=1, 43.8 to 39.7 us at
T=16 and 70.2 to 68.2 us at T=64; with more tokens the GEMM holds every SM, and an earlier run of the
same bench found the side stream slowing T=256 and T=1024.

Without a side stream (CPU, or `ForwardContext.lora_stream` None) the delta follows the GEMM in place.
Both forms compute y = x W^T + scale * B (A x); with 16-bit weights the overlapped form rounds the
delta to the model dtype once before the add (it is added to an already rounded output either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafleet.kernels import lora
from lorafleet.worker.forward_context import ForwardContext

OVERLAP_TOKENS = 64  # at most this many tokens: the delta goes to the side stream


def _delta(x: torch.Tensor, y: torch.Tensor, ctx: ForwardContext, layer: int, proj_ids: list[int], out_offsets: list[int]) -> None:
    lora.lora_delta(x=x, layout=ctx.lora_layout, layer=layer, proj_ids=proj_ids, batch=ctx.lora, y=y, out_offsets=out_offsets,
                    backend=ctx.backend)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext, layer: int, proj_ids: list[int],
                out_offsets: list[int]) -> torch.Tensor:
    """y = x @ weight^T, plus scale * B (A x) in the columns of each projection for tokens with an adapter.

    x: [T, K] model dtype. weight: [N, K] (fused projections: q|k|v or gate|up). proj_ids: the P
    projections' ids (kernels.lora_layout.PROJS order); out_offsets: their P slice starts in N.
    """
    batch = ctx.lora
    if batch is None or batch.max_rank == 0:
        return F.linear(x, weight)
    num_tokens = x.shape[0]
    if num_tokens > OVERLAP_TOKENS:
        # The delta is written first (y not read), then the GEMM adds itself to it: y = delta + x W^T.
        # Tokens in no segment must start from zero.
        every = batch.sorted_token_ids.shape[0] == num_tokens
        y = (torch.empty if every else torch.zeros)(num_tokens, weight.shape[0], dtype=x.dtype, device=x.device)
        xa = lora.shrink_buffer(x=x, proj_ids=proj_ids, batch=batch, backend=ctx.backend)
        lora.lora_shrink(x=x, layout=ctx.lora_layout, layer=layer, proj_ids=proj_ids, batch=batch, out=xa, backend=ctx.backend)
        lora.lora_expand(xa=xa, layout=ctx.lora_layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_offsets=out_offsets,
                         backend=ctx.backend, accumulate=False)
        return y.addmm_(x, weight.t())
    side = ctx.lora_stream
    if side is None:
        y = F.linear(x, weight)
        _delta(x, y, ctx, layer, proj_ids, out_offsets)
        return y
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        d = torch.zeros(num_tokens, weight.shape[0], dtype=x.dtype, device=x.device)
        _delta(x, d, ctx, layer, proj_ids, out_offsets)
    y = F.linear(x, weight)
    main.wait_stream(side)
    # d comes from the side stream's memory; the next side-stream work that could reuse it starts only
    # after the next fork (side.wait_stream(main)), so after this read: no record_stream needed.
    y += d
    return y
