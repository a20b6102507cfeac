"""Triton program of the fused LoRA delta: shrink and expand of one projection group in one launch.

The launcher is in lora_fused.py. Work is cut into units of roughly equal bytes:

* shrink unit (segment, slice i, K chunk c): xa[c, i, tok, :rank] = x[tok, chunk] @ A[:rank, chunk]^T
  for the segment's tokens, stored as a partial sum (no atomics on data);
* expand unit (segment, row j of the unit table): y[tok, cols] += scale * (sum_c xa[c, i, tok]) @ B^T[:rank, cols].

All shrink units come before all expand units in the unit order, and each program walks units
pid, pid + G, pid + 2G, ... . An expand unit waits until every shrink unit of its (segment, slice)
has arrived: each shrink unit ends with a CTA barrier and one release increment of
`sync[0, seg * P + i]`; the waiting program polls it with acquire reads, then a barrier. The last
expand unit of a (segment, slice) to leave puts both of its counters back to zero (`sync[1]` counts
departures), so the buffer is zero between launches without a fill.

No deadlock: the launcher keeps the grid within what the GPU holds at once (its occupancy), so every
program a waiter depends on is resident or will be; a program never waits before it has done all of
its own shrink units (they come first in its walk). Under Triton's interpreter programs run one
after another, so the launcher uses one program (SPIN=0: no waiting, the walk order suffices).

Ranks vary per adapter: each unit picks a rank tile of 16, 32, 64 or 128 rows from its own slot's
rank (a branch, no padding to the batch's largest rank), with a K or N tile that keeps the tile's
bytes constant.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lorafleet.kernels.lora_sgmv import _gdc_launch_dependents, _gdc_wait


@triton.jit
def _shrink_tile(
    x_ptr, pool_ptr, a_rows, tok_ids_ptr, start, end, rank, k_lo, k_hi, xa_out, stride_xt, stride_at,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """xa_out[tok, :rank] = x[tok, k_lo:k_hi] @ A[:rank, k_lo:k_hi]^T for the segment's tokens."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_row = tl.multiple_of(tl.load(a_rows + offs_r, mask=r_mask, other=0), ALIGN)
    arange_t = tl.arange(0, BLOCK_T)
    arange_k = tl.arange(0, BLOCK_K)
    for t0 in range(start, end, BLOCK_T):
        t_mask = t0 + arange_t < end
        tok = tl.load(tok_ids_ptr + t0 + arange_t, mask=t_mask, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + arange_k
            k_mask = offs_k < k_hi
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(pool_ptr + a_row[:, None] + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(at))
        tl.store(xa_out + tok[:, None] * stride_at + offs_r[None, :], acc, mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_tile(
    xa_in, stride_xc, pool_ptr, b_rows, tok_ids_ptr, start, end, rank, scale, y_ptr, n_lo, n_hi, stride_yt, stride_at,
    K_CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """y[tok, n_lo:n_hi] += scale * (sum_c xa_in[c, tok, :rank]) @ B^T[:rank, n_lo:n_hi]."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_row = tl.multiple_of(tl.load(b_rows + offs_r, mask=r_mask, other=0), ALIGN)
    arange_t = tl.arange(0, BLOCK_T)
    arange_c = tl.arange(0, K_CHUNKS)
    arange_n = tl.arange(0, BLOCK_N)
    for t0 in range(start, end, BLOCK_T):
        t_mask = t0 + arange_t < end
        tok = tl.load(tok_ids_ptr + t0 + arange_t, mask=t_mask, other=0).to(tl.int64)
        # Every K chunk's partial sum in one load ([chunks, T, R], from L2: other programs wrote them).
        ptrs = xa_in + arange_c[:, None, None] * stride_xc + tok[None, :, None] * stride_at + offs_r[None, None, :]
        parts = tl.load(ptrs, mask=t_mask[None, :, None] & r_mask[None, None, :], other=0.0, cache_modifier=".cg")
        xt = tl.sum(parts, axis=0)
        if not UPCAST:
            xt = xt.to(pool_ptr.dtype.element_ty)
        y_row = y_ptr + tok[:, None] * stride_yt
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + arange_n
            n_mask = offs_n < n_hi
            mask = t_mask[:, None] & n_mask[None, :]
            yt = tl.load(y_row + offs_n[None, :], mask=mask, other=0.0)
            bt = tl.load(pool_ptr + b_row[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(xt, bt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(xt, bt)
            tl.store(y_row + offs_n[None, :], (yt.to(tl.float32) + acc * scale).to(yt.dtype), mask=mask)


@triton.jit
def fused_kernel(
    x_ptr,  # [T, K] model dtype
    pool_ptr,  # flat pool, model dtype
    ranks_ptr,  # int32 [L, 7, M]
    scales_ptr,  # float32 [L, 7, M]
    a_off_ptr,  # int64 [L, 7, M, max_rank]
    b_off_ptr,  # int64 [L, 7, M, max_rank]
    token_ids_ptr,  # int32 [T_lora]
    seg_starts_ptr,  # int32 [S+1]
    seg_slots_ptr,  # int32 [S]
    projs_ptr,  # int32 [P] proj ids
    units_ptr,  # int32 [U, 5] expand units of a segment: slice i, its first column in y, unit's columns [lo, hi) in the slice, units of slice i
    xa_ptr,  # float32 [K_CHUNKS, P, T, R] partial sums
    sync_ptr,  # int32 [2, capacity]: arrivals, departures per (segment, slice); zero between launches
    y_ptr,  # [T, N] model dtype
    layer,
    K,
    k_chunk,
    num_segments,
    num_units,
    stride_xt,
    stride_xc,
    stride_xp,
    stride_at,
    stride_yt,
    sync_cap,
    max_slots,
    layout_max_rank,
    NUM_PROJ: tl.constexpr,
    K_CHUNKS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MAX_R: tl.constexpr,
    ALIGN: tl.constexpr,
    UPCAST: tl.constexpr,
    SPIN: tl.constexpr,
    PDL: tl.constexpr,
):
    _gdc_launch_dependents(PDL, 1)
    _gdc_wait(PDL)
    num_shrink = num_segments * NUM_PROJ * K_CHUNKS
    total = num_shrink + num_segments * num_units
    for u in range(tl.program_id(0), total, tl.num_programs(0)):
        if u < num_shrink:
            seg = u // (NUM_PROJ * K_CHUNKS)
            i = (u // K_CHUNKS) % NUM_PROJ
            c = u % K_CHUNKS
            j = 0
        else:
            c = 0
            seg = (u - num_shrink) // num_units
            j = (u - num_shrink) % num_units
            i = tl.load(units_ptr + j * 5)
        slot = tl.load(seg_slots_ptr + seg)
        start = tl.load(seg_starts_ptr + seg)
        end = tl.load(seg_starts_ptr + seg + 1)
        proj = tl.load(projs_ptr + i)
        meta = (layer * 7 + proj) * max_slots + tl.maximum(slot, 0)
        rank = tl.load(ranks_ptr + meta)
        rank = tl.where(slot < 0, 0, rank)
        arrive = sync_ptr + seg * NUM_PROJ + i
        xa_i = xa_ptr + i * stride_xp
        if rank > 0:
            if u < num_shrink:
                k_lo = c * k_chunk
                k_hi = tl.minimum(k_lo + k_chunk, K)
                a_rows = a_off_ptr + meta.to(tl.int64) * layout_max_rank
                xa_out = xa_i + c * stride_xc
                if rank <= 16:
                    _shrink_tile(x_ptr, pool_ptr, a_rows, token_ids_ptr, start, end, rank, k_lo, k_hi, xa_out, stride_xt, stride_at, BLOCK_T, 16, 256, ALIGN, UPCAST)
                elif rank <= 32:
                    if MAX_R >= 32:  # compiled only where the batch can hold such a rank
                        _shrink_tile(x_ptr, pool_ptr, a_rows, token_ids_ptr, start, end, rank, k_lo, k_hi, xa_out, stride_xt, stride_at, BLOCK_T, 32, 128, ALIGN, UPCAST)
                elif rank <= 64:
                    if MAX_R >= 64:
                        _shrink_tile(x_ptr, pool_ptr, a_rows, token_ids_ptr, start, end, rank, k_lo, k_hi, xa_out, stride_xt, stride_at, BLOCK_T, 64, 64, ALIGN, UPCAST)
                else:
                    if MAX_R >= 128:
                        _shrink_tile(x_ptr, pool_ptr, a_rows, token_ids_ptr, start, end, rank, k_lo, k_hi, xa_out, stride_xt, stride_at, BLOCK_T, 128, 32, ALIGN, UPCAST)
                if SPIN:
                    tl.debug_barrier()  # every thread's partial sums are stored before the release below
                    tl.atomic_add(arrive, 1, sem="release", scope="gpu")
            else:
                y_i = y_ptr + tl.load(units_ptr + j * 5 + 1)
                col0 = tl.load(units_ptr + j * 5 + 2)
                col1 = tl.load(units_ptr + j * 5 + 3)
                units_i = tl.load(units_ptr + j * 5 + 4)
                scale = tl.load(scales_ptr + meta)
                b_rows = b_off_ptr + meta.to(tl.int64) * layout_max_rank
                if SPIN:
                    seen = tl.atomic_add(arrive, 0, sem="acquire", scope="gpu")
                    while seen < K_CHUNKS:
                        seen = tl.atomic_add(arrive, 0, sem="acquire", scope="gpu")
                    tl.debug_barrier()
                if rank <= 16:
                    _expand_tile(xa_i, stride_xc, pool_ptr, b_rows, token_ids_ptr, start, end, rank, scale, y_i, col0, col1, stride_yt, stride_at, K_CHUNKS, BLOCK_T, 16, 256, ALIGN, UPCAST)
                elif rank <= 32:
                    if MAX_R >= 32:
                        _expand_tile(xa_i, stride_xc, pool_ptr, b_rows, token_ids_ptr, start, end, rank, scale, y_i, col0, col1, stride_yt, stride_at, K_CHUNKS, BLOCK_T, 32, 128, ALIGN, UPCAST)
                elif rank <= 64:
                    if MAX_R >= 64:
                        _expand_tile(xa_i, stride_xc, pool_ptr, b_rows, token_ids_ptr, start, end, rank, scale, y_i, col0, col1, stride_yt, stride_at, K_CHUNKS, BLOCK_T, 64, 64, ALIGN, UPCAST)
                else:
                    if MAX_R >= 128:
                        _expand_tile(xa_i, stride_xc, pool_ptr, b_rows, token_ids_ptr, start, end, rank, scale, y_i, col0, col1, stride_yt, stride_at, K_CHUNKS, BLOCK_T, 128, 32, ALIGN, UPCAST)
                if SPIN:
                    gone = tl.atomic_add(arrive + sync_cap, 1, sem="acq_rel", scope="gpu")
                    if gone == units_i - 1:  # the last reader of this (segment, slice): reset for the next launch
                        tl.atomic_xchg(arrive, 0, sem="relaxed", scope="gpu")
                        tl.atomic_xchg(arrive + sync_cap, 0, sem="relaxed", scope="gpu")
