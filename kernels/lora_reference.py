"""Plain-torch LoRA shrink/expand: gather adapter rows through the layout's offsets, segment-padded bmm.

The reference backend of `kernels.lora` (the engine's backend on CPU) and the baseline the Triton
kernels are tested and benchmarked against. No Python loop over tokens, segments or requests; the
only loop is over the (at most three) projections of one fused launch.

On the CPU a whole delta of a batch of few adapters (`lora_delta_host`, at most HOST_SLOTS_MAX) goes by
adapter instead: each adapter's tokens times its A and B rows, views of the pool where a matrix's rows
lie one after another (as the pool writes them within a page), two matrix products a projection. The
gathers, masks and padded bmm of the general path cost a decode step more than its arithmetic: with the
embedded model on one core, a demo adapter's step took 1.36-2.12x the base model's with them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lorafleet.kernels.lora_layout import LoRABatch, LoRALayout

HOST_SLOTS_MAX = 4  # a CPU batch of at most this many adapters takes lora_delta_host (one core, SmolLM2's q|k|v at rank 8: 4-5x faster than the general path for one adapter, 1.6-1.8x for four, slower for eight)


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


def _host_slots(batch: LoRABatch) -> list[tuple[int, Tensor | slice]]:
    """(slot, its tokens) of a CPU batch, once for every layer's calls: a slot's segments' token ids (a slice
    where they are every token in order), slot -1 segments too (a write-mode delta zeroes their rows)."""
    memo = batch.host_memo
    if "slots" not in memo:
        starts, ids = batch.seg_starts.tolist(), batch.sorted_token_ids.long()
        spans: dict[int, list[tuple[int, int]]] = {}
        for s, slot in enumerate(batch.seg_slots.tolist()):
            run = spans.setdefault(slot, [])
            if run and run[-1][1] == starts[s]:
                run[-1] = (run[-1][0], starts[s + 1])  # the next piece of the same run of the slot's tokens
            elif starts[s + 1] > starts[s]:
                run.append((starts[s], starts[s + 1]))
        every = torch.arange(batch.num_tokens)
        memo["slots"] = []
        for slot, run in spans.items():
            if run:
                tok = torch.cat([ids[a:b] for a, b in run])
                memo["slots"].append((slot, slice(None) if torch.equal(tok, every) else tok))
    return memo["slots"]


def _rows(layout: LoRALayout, offsets: list[int], width: int) -> Tensor:
    """[len(offsets), width] rows of the pool: a view where each row follows the one before, else a copy."""
    flat, first = layout.pool.view(-1), offsets[0]
    if offsets == list(range(first, first + width * len(offsets), width)):
        return flat[first:first + width * len(offsets)].view(len(offsets), width)
    return torch.stack([flat[o:o + width] for o in offsets])


def takes_host(batch: LoRABatch) -> bool:
    """Whether a CPU batch's delta goes adapter by adapter (`lora_delta_host`): it has work, and at most
    HOST_SLOTS_MAX adapters. The others (nothing to do, write-mode zeros, many adapters) take the general path."""
    if batch.num_segments == 0 or batch.max_rank == 0 or batch.token_slots.device.type != "cpu":
        return False
    return sum(slot >= 0 for slot, _ in _host_slots(batch)) <= HOST_SLOTS_MAX


def lora_delta_host(*, x: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, y: Tensor,
                    out_slices: list[tuple[int, int]], accumulate: bool = True) -> None:
    """`kernels.lora.lora_delta` on CPU tensors, adapter by adapter, for a batch `takes_host` takes (inputs
    already checked there). The same float32 arithmetic as the general path: (x A^T) B^T times the scale, rounded
    once into y."""
    for slot, tok in _host_slots(batch):
        xs = None
        for proj, (start, width) in zip(proj_ids, out_slices, strict=True):
            cols = slice(start, start + width)
            rank = 0 if slot < 0 else min(int(layout.ranks[layer, proj, slot]), batch.max_rank)
            if rank == 0:  # no adapter, or a module the slot does not adapt: y as it is, or zeros
                if not accumulate:
                    y[tok, cols] = 0
                continue
            xs = (x[tok] if isinstance(tok, Tensor) else x).float() if xs is None else xs
            a = _rows(layout, layout.a_offsets[layer, proj, slot, :rank].tolist(), x.shape[1])
            b = _rows(layout, layout.b_offsets[layer, proj, slot, :rank].tolist(), width)
            delta = (xs @ a.float().t()) @ b.float()
            delta *= layout.scales[layer, proj, slot]
            y[tok, cols] = (y[tok, cols].float() + delta).to(y.dtype) if accumulate else delta.to(y.dtype)
