"""Triton decode expand without tensor cores: y[tok] += scale * xa[tok] @ B^T for a few tokens per segment.

A decode segment holds one or two tokens. `expand_kernel` (lora_sgmv.py) feeds `tl.dot`, whose token
tile has at least 16 rows: 8x the accumulator and y registers a 2-token segment needs (at 512
columns its program spills). Here each program holds a [BLOCK_T, BLOCK_N] float32 accumulator for
exactly the segment's token tile (BLOCK_T = 1 to 8) and walks the slot's rank in chunks of 16 rows:
a [16, BLOCK_N] tile of B^T (every thread owns whole columns: BLOCK_N = VEC x 32 x warps, so the
sum over the 16 rows stays in the thread) times each token's 16 xa values, on the CUDA cores in float32.

Grid: (segment, slice, column tile). Metadata is read as in lora_sgmv.py (two round trips, before
`gdc_wait` under PDL); a slot's rank costs rank/16 chunks, so no padding to the batch's largest rank.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lorafleet.kernels.lora_sgmv import _gdc_launch_dependents, _gdc_wait, _load_xa


@triton.jit
def expand_gemv_kernel(
    xa_ptr,  # float32 [splits, P, T, R]
    pool_ptr,  # flat pool, model dtype
    ranks_ptr,  # int32 [L, 7, M]
    scales_ptr,  # float32 [L, 7, M]
    b_off_ptr,  # int64 [L, 7, M, max_rank]
    token_ids_ptr,  # int32 [T_lora]
    seg_starts_ptr,  # int32 [S+1]
    seg_slots_ptr,  # int32 [S]
    slices_ptr,  # int32 [P, 3]: proj id, first column in y, width
    y_ptr,  # [T, N] model dtype
    layer,
    stride_xs,
    stride_xp,
    stride_xt,
    stride_yt,
    max_slots,
    layout_max_rank,
    BLOCK_T: tl.constexpr,  # tokens per step: a power of two, 1 to 8
    BLOCK_N: tl.constexpr,  # columns per program: VEC x 32 x warps
    SPLITS: tl.constexpr,
    ALIGN: tl.constexpr,
    ALIGN_N: tl.constexpr,
    PDL: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # 1: y += delta; 0: y = delta (zeros where the slot does not adapt the module)
):
    seg = tl.program_id(0)
    i = tl.program_id(1)
    c = tl.program_id(2)
    _gdc_launch_dependents(PDL, 1)
    slot = tl.load(seg_slots_ptr + seg)
    proj = tl.load(slices_ptr + i * 3)
    col0 = tl.multiple_of(tl.load(slices_ptr + i * 3 + 1), ALIGN_N)
    width = tl.multiple_of(tl.load(slices_ptr + i * 3 + 2), ALIGN_N)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    meta = (layer * 7 + proj) * max_slots + tl.maximum(slot, 0)
    rank = tl.load(ranks_ptr + meta)
    scale = tl.load(scales_ptr + meta)
    b_rows = b_off_ptr + meta.to(tl.int64) * layout_max_rank
    arange_t = tl.arange(0, BLOCK_T)
    tok = tl.load(token_ids_ptr + start + arange_t, mask=start + arange_t < end, other=0)
    rank = tl.where(slot < 0, 0, rank)
    _gdc_wait(PDL)
    n_lo = c * BLOCK_N
    if n_lo < width and (rank > 0 or not ACCUMULATE):
        offs_n = n_lo + tl.arange(0, BLOCK_N)
        n_mask = offs_n < width
        arange_r = tl.arange(0, 16)
        xa_base = xa_ptr + i * stride_xp
        for t0 in range(start, end, BLOCK_T):
            t_mask = t0 + arange_t < end
            tok64 = tok.to(tl.int64)
            y_ptrs = y_ptr + col0 + tok64[:, None] * stride_yt + offs_n[None, :]
            mask = t_mask[:, None] & n_mask[None, :]
            if ACCUMULATE:  # issued first: its latency overlaps the rank loop
                y_old = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for r0 in range(0, rank, 16):
                offs_r = r0 + arange_r
                r_mask = offs_r < rank
                b_row = tl.multiple_of(tl.load(b_rows + offs_r, mask=r_mask, other=0), ALIGN)
                bt = tl.load(pool_ptr + b_row[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
                xa = _load_xa(xa_base, stride_xs, tok64, t_mask, offs_r, r_mask, stride_xt, SPLITS)  # [BLOCK_T, 16]
                for t in tl.static_range(BLOCK_T):
                    x_t = tl.sum(tl.where(arange_t[:, None] == t, xa, 0.0), axis=0)  # token t's 16 xa values
                    contrib = tl.sum(bt * x_t[:, None], axis=0)  # [BLOCK_N]: the 16 rows sum in-thread
                    acc += tl.where(arange_t[:, None] == t, contrib[None, :], 0.0)
            if ACCUMULATE:
                out = y_old + acc * scale
            else:
                out = tl.where(rank > 0, acc * scale, 0.0)
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
            _gdc_launch_dependents(PDL, 2)
            nxt = t0 + BLOCK_T + arange_t
            tok = tl.load(token_ids_ptr + nxt, mask=nxt < end, other=0)


def gemv_block_n(num_warps: int, vec: int) -> int:
    """Columns per program: vec adjacent columns for every thread, so B^T's 16 rows sum in-thread."""
    return vec * 32 * num_warps


def gemv_block_t(tokens_per_segment: float, most: int) -> int:
    """Token tile: the segments' mean token count as a power of two, at most `most` (a longer segment takes several)."""
    return max(1, min(most, triton.next_power_of_2(max(1, round(tokens_per_segment)))))
