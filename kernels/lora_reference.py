"""Plain-torch LoRA shrink/expand: gather adapter rows through the layout's offsets, segment-padded bmm.

The reference backend of `kernels.lora` (the engine's backend on CPU) and the baseline the Triton
kernels are tested and benchmarked against. No Python loop over tokens, segments or requests; the
only loop is over the (at most three) projections of one fused launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorafleet.kernels.lora_layout import LoRABatch, LoRALayout


def _segment_tokens(batch: LoRABatch) -> tuple[Tensor, Tensor]:
    """Segment-padded token ids [S, L] (L = longest segment) and their validity mask [S, L]; computed once per
    CPU batch (every layer's calls share them), afresh for device tensors (a CUDA graph may change them in place)."""
    memo = batch.host_memo if batch.token_slots.device.type == "cpu" else {}
    if "tokens" not in memo:
        memo["tokens"] = _segment_tokens_of(batch)
    return memo["tokens"]


def _segment_tokens_of(batch: LoRABatch) -> tuple[Tensor, Tensor]:
    starts = batch.seg_starts[:-1].long()
    lengths = batch.seg_starts[1:].long() - starts
    longest = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(longest, device=starts.device)
    mask = pos[None, :] < lengths[:, None]  # [S, L]
    idx = (starts[:, None] + pos[None, :]).clamp(max=max(batch.sorted_token_ids.shape[0] - 1, 0))
    if batch.sorted_token_ids.numel() == 0:
        return torch.zeros_like(idx), mask & False
    return batch.sorted_token_ids.long()[idx], mask


def _gather_rows(layout: LoRALayout, offsets: Tensor, ranks: Tensor, width: int) -> Tensor:
    """Rows of `width` elements from the pool: offsets [S, R] -> float32 [S, R, width], rows >= rank zeroed."""
    flat = layout.pool.view(-1)
    live = torch.arange(offsets.shape[1], device=offsets.device)[None, :] < ranks[:, None]  # [S, R]
    if flat.numel() < width:  # no row is live either (a module no slot adapts may be wider than the pool)
        return torch.zeros(*offsets.shape, width, device=offsets.device)
    # Every window of `width` elements of the pool, one per start offset (a view: nothing is copied), indexed by the
    # rows' offsets: one gather. A dead row reads the window at 0; a live row past the pool still raises.
    windows = flat.as_strided((flat.numel() - width + 1, width), (1, 1))
    rows = windows[torch.where(live, offsets, 0)].float()  # a copy (advanced indexing), float32
    return rows.masked_fill_(~live[..., None], 0.0)  # [S, R, width]


def _slot_meta(layout: LoRALayout, layer: int, proj: int, seg_slots: Tensor, max_rank: int):
    """Per-segment rank [S], scale [S] and clamped slot [S]; slot -1 gets rank 0."""
    valid = seg_slots >= 0
    safe = seg_slots.long().clamp(min=0)
    ranks = layout.ranks[layer, proj, safe].long().masked_fill_(~valid, 0)
    scales = layout.scales[layer, proj, safe]
    return ranks.clamp_(max=max_rank), scales, safe


def lora_shrink_reference(*, x: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, out: Tensor) -> None:
    """out[0, i, t, :r] = x[t] @ A[slot(t), layer, proj_ids[i]].T in float32, other splits zero (see kernels.lora.lora_shrink)."""
    max_rank = batch.max_rank
    if batch.num_segments == 0 or max_rank == 0:
        return
    out[1:] = 0.0
    out = out[0]
    tok, mask = _segment_tokens(batch)  # [S, L]
    xs = torch.where(mask[..., None], x[tok].float(), 0.0)  # [S, L, K]
    flat_tok = tok[mask]
    for i, proj in enumerate(proj_ids):
        ranks, _, safe = _slot_meta(layout, layer, proj, batch.seg_slots, max_rank)
        a = _gather_rows(layout, layout.a_offsets[layer, proj, safe, :max_rank], ranks, x.shape[1])  # [S, R, K]
        xa = torch.bmm(xs, a.transpose(1, 2))  # [S, L, R]
        written = (mask & (ranks[:, None] > 0))[mask]
        out[i, flat_tok[written], :max_rank] = xa[mask][written]


def lora_expand_reference(
    *, xa: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, y: Tensor, out_slices: list[tuple[int, int]],
    accumulate: bool = True,
) -> None:  # fmt: skip
    """y[t, off_i:off_i+n_i] += (or = without accumulate) scale * xa.sum(0)[i, t, :r] @ B^T[slot(t), layer, proj_ids[i]] (see kernels.lora.lora_expand)."""
    max_rank = batch.max_rank
    if batch.num_segments == 0 or max_rank == 0:
        return
    tok, mask = _segment_tokens(batch)  # [S, L]
    xa = xa.sum(0)  # the shrink's partial sums: [P, T, R]
    for i, (proj, (start, width)) in enumerate(zip(proj_ids, out_slices, strict=True)):
        ranks, scales, safe = _slot_meta(layout, layer, proj, batch.seg_slots, max_rank)
        b = _gather_rows(layout, layout.b_offsets[layer, proj, safe, :max_rank], ranks, width)  # [S, R, n]
        live = torch.arange(max_rank, device=xa.device)[None, None, :] < ranks[:, None, None]
        xs = torch.where(live & mask[..., None], xa[i][tok][..., :max_rank].float(), 0.0)  # [S, L, R]
        delta = torch.bmm(xs, b) * scales[:, None, None]  # [S, L, n]
        cols = slice(start, start + width)
        if not accumulate:  # every token of a segment gets its delta (zeros where the module is not adapted)
            y[tok[mask], cols] = delta[mask].to(y.dtype)
            continue
        keep = (mask & (ranks[:, None] > 0))  # a module the slot does not adapt leaves y untouched
        rows = tok[keep]
        y[rows, cols] = (y[rows, cols].float() + delta[keep]).to(y.dtype)
