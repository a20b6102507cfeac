"""The MLP's activation with the gate|up LoRA delta folded in: act = silu(gate + dg) * (up + du).

At prefill the gate|up delta is the largest piece of a layer's LoRA work, and nearly all of it is
memory: written as its own [T, 2 * intermediate] tensor, it is stored once and read once more by
whatever adds it (H200, T=1024: 58.7 MB each way). Here the expand's tiles are computed where the
activation reads the GEMM's output, so the delta never reaches memory: the kernel reads gate|up and
the adapters' B rows (from L2), and writes act, which the layer writes anyway.

`silu_mul_lora_triton` is the Triton backend and `silu_mul_lora_reference` the torch one of
`kernels.lora.lora_silu_mul` (inputs checked there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lorafleet.kernels.activation import silu_mul
from lorafleet.kernels.lora_layout import LoRABatch, LoRALayout
from lorafleet.kernels.lora_reference import _segment_tokens, lora_expand_reference
from lorafleet.kernels.lora_sgmv import _load_xa
from lorafleet.kernels.lora_triton import _block_t, _num_sms, _pow2, _upcast

GATE, UP = 4, 5  # projection ids (kernels.lora_layout.PROJS)


@triton.jit
def _b_rows(b_off_ptr, meta, layout_max_rank, arange_r, rank, ALIGN: tl.constexpr):
    return tl.multiple_of(tl.load(b_off_ptr + meta.to(tl.int64) * layout_max_rank + arange_r, mask=arange_r < rank, other=0), ALIGN)


@triton.jit
def silu_mul_lora_kernel(
    gate_up_ptr,  # [T, 2 * I] model dtype: gate columns, then up columns
    xa_ptr,  # float32 [splits, 2, T, R]: the shrink's partial sums for (gate, up)
    pool_ptr,  # flat pool, model dtype
    ranks_ptr,  # int32 [L, 7, M]
    scales_ptr,  # float32 [L, 7, M]
    b_off_ptr,  # int64 [L, 7, M, max_rank]
    token_ids_ptr,  # int32 [T_lora]
    seg_starts_ptr,  # int32 [S+1]
    seg_slots_ptr,  # int32 [S]
    out_ptr,  # [T, I] model dtype
    layer,
    inter,
    cols_per_program,
    stride_gt,
    stride_ot,
    stride_xs,
    stride_xp,
    stride_xt,
    max_slots,
    layout_max_rank,
    batch_max_rank,  # ranks above it are cut to it (the xa buffer holds batch.max_rank rows)
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    ALIGN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per (segment, column range of I): the gate and up deltas of the tile from xa and the slot's
    B^T rows, added to gate_up's two halves, then silu(gate) * up written to out; the deltas are never
    stored. Launcher: silu_mul_lora_triton; meaning: kernels/lora.py lora_silu_mul."""
    seg = tl.program_id(0)
    n_lo = tl.program_id(1) * cols_per_program
    n_hi = tl.minimum(n_lo + cols_per_program, inter)
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    meta_g = (layer * 7 + 4) * max_slots + tl.maximum(slot, 0)
    meta_u = meta_g + max_slots  # UP = GATE + 1
    rank_g = tl.where(slot < 0, 0, tl.minimum(tl.load(ranks_ptr + meta_g), batch_max_rank))
    rank_u = tl.where(slot < 0, 0, tl.minimum(tl.load(ranks_ptr + meta_u), batch_max_rank))
    scale_g = tl.load(scales_ptr + meta_g)
    scale_u = tl.load(scales_ptr + meta_u)
    arange_r = tl.arange(0, BLOCK_R)
    arange_t = tl.arange(0, BLOCK_T)
    arange_n = tl.arange(0, BLOCK_N)
    mask_g, mask_u = arange_r < rank_g, arange_r < rank_u
    rows_g = _b_rows(b_off_ptr, meta_g, layout_max_rank, arange_r, rank_g, ALIGN)
    rows_u = _b_rows(b_off_ptr, meta_u, layout_max_rank, arange_r, rank_u, ALIGN)
    for t0 in range(start, end, BLOCK_T):
        t_mask = t0 + arange_t < end
        tok = tl.load(token_ids_ptr + t0 + arange_t, mask=t_mask, other=0).to(tl.int64)
        # Ranks past a module's rank (or a module the slot does not adapt) load as zeros: no delta.
        xg = _load_xa(xa_ptr, stride_xs, tok, t_mask, arange_r, mask_g, stride_xt, SPLITS)
        xu = _load_xa(xa_ptr + stride_xp, stride_xs, tok, t_mask, arange_r, mask_u, stride_xt, SPLITS)
        if not UPCAST:
            xg = xg.to(pool_ptr.dtype.element_ty)
            xu = xu.to(pool_ptr.dtype.element_ty)
        g_row = gate_up_ptr + tok[:, None] * stride_gt
        o_row = out_ptr + tok[:, None] * stride_ot
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + arange_n
            n_mask = offs_n < n_hi
            tile_mask = t_mask[:, None] & n_mask[None, :]
            bg = tl.load(pool_ptr + rows_g[:, None] + offs_n[None, :], mask=mask_g[:, None] & n_mask[None, :], other=0.0)
            bu = tl.load(pool_ptr + rows_u[:, None] + offs_n[None, :], mask=mask_u[:, None] & n_mask[None, :], other=0.0)
            g = tl.load(g_row + offs_n[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            u = tl.load(g_row + inter + offs_n[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            if UPCAST:
                g += scale_g * tl.dot(xg, bg.to(tl.float32), input_precision="ieee")
                u += scale_u * tl.dot(xu, bu.to(tl.float32), input_precision="ieee")
            else:
                g += scale_g * tl.dot(xg, bg)
                u += scale_u * tl.dot(xu, bu)
            act = g * tl.sigmoid(g) * u
            tl.store(o_row + offs_n[None, :], act.to(out_ptr.dtype.element_ty), mask=tile_mask)


def silu_mul_lora_triton(*, gate_up: Tensor, xa: Tensor, layout: LoRALayout, layer: int, batch: LoRABatch, out: Tensor,
                         block_n: int = 64, programs_per_sm: int = 2, num_warps: int | None = None) -> None:
    """Triton backend of `kernels.lora.lora_silu_mul` (inputs checked there). block_n, programs_per_sm,
    num_warps: column tile, grid size (~programs per SM) and warps per program (benchmark sweeps)."""
    if batch.num_segments == 0:
        return
    inter = out.shape[1]
    block_t = _block_t(batch)
    block_n = min(block_n, _pow2(inter, 16, 128))
    cols = inter * batch.num_segments // (programs_per_sm * _num_sms(str(out.device)))
    cols = triton.cdiv(max(block_n, min(cols, inter)), block_n) * block_n
    grid = (batch.num_segments, triton.cdiv(inter, cols))
    block_r = _pow2(batch.max_rank, 16, 128)
    # 8 warps wherever 4 spill registers (sm_90, 64-column tiles: 64-token tiles, or rank tiles of 64 and 128).
    num_warps = num_warps or (8 if block_t >= 64 or block_r >= 64 else 4)
    silu_mul_lora_kernel[grid](
        gate_up, xa, layout.pool, layout.ranks, layout.scales, layout.b_offsets, batch.sorted_token_ids, batch.seg_starts, batch.seg_slots, out,
        layer, inter, cols, gate_up.stride(0), out.stride(0), xa.stride(0), xa.stride(1), xa.stride(2), layout.max_slots, layout.max_rank,
        batch.max_rank, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_N=block_n, SPLITS=xa.shape[0], ALIGN=layout.row_align, UPCAST=_upcast(out.dtype), num_warps=num_warps,
    )  # fmt: skip


def silu_mul_lora_reference(*, gate_up: Tensor, xa: Tensor, layout: LoRALayout, layer: int, batch: LoRABatch, out: Tensor) -> None:
    """Torch backend of `kernels.lora.lora_silu_mul`: the delta through the reference expand, in float32."""
    if batch.num_segments == 0:
        return
    inter = out.shape[1]
    tok, mask = _segment_tokens(batch)
    rows = tok[mask]
    gu = gate_up[rows].float()
    if batch.max_rank:
        delta = torch.zeros(gate_up.shape, dtype=torch.float32, device=gate_up.device)
        lora_expand_reference(xa=xa, layout=layout, layer=layer, proj_ids=[GATE, UP], batch=batch, y=delta, out_slices=[(0, inter), (inter, inter)])
        gu += delta[rows]
    out[rows] = silu_mul(gu, backend="reference").to(out.dtype)
