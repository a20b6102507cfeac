"""Triton SGMV: segmented-gather LoRA shrink and expand over the unified page pool.

One launch serves every segment (tokens of one adapter slot) and every projection of a fused group
(q|k|v, gate|up). Each program reads its adapter's rows through `LoRALayout`'s offsets (a row is
contiguous in the pool), covers the slot's *true* rank in chunks of 16 rows (no padding to the
batch's largest rank: chunks past a slot's rank exit, masked loads fetch nothing), and skips at once a
segment with slot -1 or a module the slot does not adapt. The adapter rows of a segment are read once
and reused by all its tokens; `make_lora_batch` cuts long runs into segments of at most 64 tokens so
one adapter's prefill still spreads over many programs.

Grids: shrink (segment, projection x rank chunk of 16 rows, K split; split-K adds atomically into a
zeroed output); expand (segment, projection, column range): each program holds the whole rank (up to
128) in one tile and walks its column tiles with y read two tiles ahead. Loads are upcast
to float32 under Triton's interpreter (its bf16/fp16 arithmetic is wrong) and for float32 models;
on a GPU, 16-bit operands go to the tensor cores with float32 accumulation.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from lorafleet.kernels.lora_layout import NUM_PROJS, LoRABatch, LoRALayout

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K] model dtype
    pool_ptr,  # flat pool, model dtype
    ranks_ptr,  # int32 [L, 7, M]
    a_off_ptr,  # int64 [L, 7, M, max_rank]
    token_ids_ptr,  # int32 [T_lora]
    seg_starts_ptr,  # int32 [S+1]
    seg_slots_ptr,  # int32 [S]
    proj_ids_ptr,  # int32 [P]
    out_ptr,  # float32 [P, T, R]
    layer,
    K,
    k_per_split,
    num_r_chunks,
    stride_xt,
    stride_op,
    stride_ot,
    max_slots,
    layout_max_rank,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALIGN: tl.constexpr,
    ATOMIC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    i = tl.program_id(1) // num_r_chunks
    r0 = (tl.program_id(1) % num_r_chunks) * BLOCK_R
    split = tl.program_id(2)
    # Independent metadata loads first, so their latencies overlap.
    slot = tl.load(seg_slots_ptr + seg)
    proj = tl.load(proj_ids_ptr + i)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    if slot < 0:
        return
    meta = (layer * 7 + proj) * max_slots + slot
    offs_r = r0 + tl.arange(0, BLOCK_R)
    # The row offsets are loaded alongside the rank (not after it): one memory latency less per program.
    rank = tl.load(ranks_ptr + meta)
    a_row = tl.load(a_off_ptr + meta.to(tl.int64) * layout_max_rank + offs_r, mask=offs_r < layout_max_rank, other=0)
    a_row = tl.multiple_of(a_row, ALIGN)
    if r0 >= rank:  # also a module the slot does not adapt (rank 0): no adapter bytes read
        return
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    r_mask = offs_r < rank
    arange_t = tl.arange(0, BLOCK_T)
    arange_k = tl.arange(0, BLOCK_K)
    for t0 in range(start, end, BLOCK_T):
        t_mask = t0 + arange_t < end
        tok = tl.load(token_ids_ptr + t0 + arange_t, mask=t_mask, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + arange_k
            k_mask = offs_k < k_hi
            # x tile [BLOCK_T, BLOCK_K]: gathered token rows; A tile [BLOCK_R, BLOCK_K]: pool rows, contiguous along K.
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(pool_ptr + a_row[:, None] + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(at))
        ptrs = out_ptr + i * stride_op + tok[:, None] * stride_ot + offs_r[None, :]
        mask = t_mask[:, None] & r_mask[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=mask)
        else:
            tl.store(ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(
    xa_ptr,  # float32 [P, T, R]
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
    stride_xp,
    stride_xt,
    stride_yt,
    max_slots,
    layout_max_rank,
    cols_per_program,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
    MULTI_CHUNK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    i = tl.program_id(1)
    n_lo = tl.program_id(2) * cols_per_program
    # Independent metadata loads first, so their latencies overlap.
    slot = tl.load(seg_slots_ptr + seg)
    width = tl.load(slices_ptr + i * 3 + 2)
    proj = tl.load(slices_ptr + i * 3)
    col0 = tl.load(slices_ptr + i * 3 + 1)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    if slot < 0:
        return
    if n_lo >= width:
        return
    meta = (layer * 7 + proj) * max_slots + slot
    arange_r = tl.arange(0, BLOCK_R)
    # The first rank chunk's row offsets are loaded alongside the rank: one memory latency less.
    rank = tl.load(ranks_ptr + meta)
    scale = tl.load(scales_ptr + meta)
    b_rows = b_off_ptr + meta.to(tl.int64) * layout_max_rank
    b_row0 = tl.load(b_rows + arange_r, mask=arange_r < layout_max_rank, other=0)
    if rank == 0:
        return
    n_hi = tl.minimum(n_lo + cols_per_program, width)
    arange_t = tl.arange(0, BLOCK_T)
    arange_n = tl.arange(0, BLOCK_N)
    xa_base = xa_ptr + i * stride_xp
    r_mask0 = arange_r < rank
    b_row0 = tl.multiple_of(b_row0, ALIGN)
    for t0 in range(start, end, BLOCK_T):
        t_mask = t0 + arange_t < end
        tok = tl.load(token_ids_ptr + t0 + arange_t, mask=t_mask, other=0).to(tl.int64)
        # The first rank tile of xa is the same for every column tile: loaded once.
        xt0 = tl.load(xa_base + tok[:, None] * stride_xt + arange_r[None, :], mask=t_mask[:, None] & r_mask0[None, :], other=0.0)
        if not UPCAST:
            xt0 = xt0.to(pool_ptr.dtype.element_ty)
        # y tiles are read two column tiles ahead: their loads are not dot operands, so the compiler's
        # pipelining does not cover them, and a program walking many tiles would wait a full memory
        # latency per tile.
        y_row = y_ptr + tok[:, None] * stride_yt + col0
        ya = tl.load(y_row + (n_lo + arange_n)[None, :], mask=t_mask[:, None] & (n_lo + arange_n < n_hi)[None, :], other=0.0)
        yb = tl.load(y_row + (n_lo + BLOCK_N + arange_n)[None, :], mask=t_mask[:, None] & (n_lo + BLOCK_N + arange_n < n_hi)[None, :], other=0.0)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            ahead = n0 + 2 * BLOCK_N + arange_n
            yc = tl.load(y_row + ahead[None, :], mask=t_mask[:, None] & (ahead < n_hi)[None, :], other=0.0)
            offs_n = n0 + arange_n
            n_mask = offs_n < n_hi
            bt = tl.load(pool_ptr + b_row0[:, None] + offs_n[None, :], mask=r_mask0[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(xt0, bt.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(xt0, bt)
            if MULTI_CHUNK:  # ranks above BLOCK_R
                for r0 in range(BLOCK_R, rank, BLOCK_R):
                    b_row = tl.load(b_rows + r0 + arange_r, mask=r0 + arange_r < rank, other=0)
                    acc = _expand_chunk(acc, xa_base, pool_ptr, b_row, tok, t_mask, stride_xt, r0, rank, offs_n, n_mask, BLOCK_R, ALIGN, UPCAST)
            tl.store(y_row + offs_n[None, :], (ya.to(tl.float32) + acc * scale).to(ya.dtype), mask=t_mask[:, None] & n_mask[None, :])
            ya = yb
            yb = yc


@triton.jit
def _expand_chunk(acc, xa_base, pool_ptr, b_row, tok, t_mask, stride_xt, r0, rank, offs_n, n_mask, BLOCK_R: tl.constexpr, ALIGN: tl.constexpr, UPCAST: tl.constexpr):
    """acc += xa[tok, r0:r0+BLOCK_R] @ B^T[r0:r0+BLOCK_R, offs_n] for the rows below rank."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_row = tl.multiple_of(b_row, ALIGN)
    # B^T tile [BLOCK_R, BLOCK_N]: each row contiguous in the pool; xa tile [BLOCK_T, BLOCK_R].
    bt = tl.load(pool_ptr + b_row[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    xt = tl.load(xa_base + tok[:, None] * stride_xt + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST:
        acc += tl.dot(xt, bt.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(xt.to(bt.dtype), bt)
    return acc


@functools.lru_cache(maxsize=256)
def _device_ints(values: tuple[int, ...], device: str) -> Tensor:
    """A small int32 tensor, made once per (values, device): no host-to-device copy per call (graph-safe)."""
    return torch.tensor(values, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=8)
def _num_sms(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def _block_t(batch: LoRABatch) -> int:
    """Token tile: a decode batch has ~1 token per segment, a prefill batch many."""
    per_segment = batch.num_tokens / max(batch.num_segments, 1)
    return _pow2(int(per_segment), 16, 64)


def _upcast(dtype: torch.dtype) -> bool:
    return _INTERPRET or dtype == torch.float32


def lora_shrink_triton(
    *,
    x: Tensor,
    layout: LoRALayout,
    layer: int,
    proj_ids: list[int],
    batch: LoRABatch,
    out: Tensor,
    split_k: int | None = None,
    block_k: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> None:
    """Triton backend of `kernels.lora.lora_shrink` (inputs already checked there).

    Semantics: out[i, t, j] = sum_k x[t, k] * A[slot(t), layer, proj_ids[i]][j, k] for j < rank(slot(t)).

    x: [T, K] model dtype. out: float32 [P, T, R]. split_k: K splits per (segment, projection)
    (default: enough programs to fill the GPU); with more than one, out is zeroed and results are added
    atomically. block_k, block_r, num_warps, num_stages: tile over K, rank rows per program (ranks above
    it take several programs), warps per program and pipeline depth (benchmark sweeps).
    """
    num_segments, num_proj = batch.num_segments, len(proj_ids)
    if num_segments == 0 or batch.max_rank == 0:
        return
    K = x.shape[1]
    block_r = block_r or (64 if _INTERPRET else 16)
    num_r_chunks = triton.cdiv(batch.max_rank, block_r)
    block_k = block_k or _pow2(triton.cdiv(K, split_k or 1), 16, 128)
    num_k_blocks = triton.cdiv(K, block_k)
    if split_k is None:
        # Enough programs to keep every SM busy; rank chunks past a slot's rank exit at once, so count
        # the programs of an average rank.
        programs = num_segments * num_proj * max(1, num_r_chunks // 2)
        split_k = min(num_k_blocks, triton.cdiv(2 * _num_sms(str(x.device)), programs))
    split_k = max(1, min(split_k, num_k_blocks))
    k_per_split = triton.cdiv(num_k_blocks, split_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    block_t = _block_t(batch)
    num_warps = num_warps or (8 if block_t >= 64 else 4)
    if split_k > 1:
        out.zero_()
    _shrink_kernel[(num_segments, num_proj * num_r_chunks, split_k)](
        x,
        layout.pool,
        layout.ranks,
        layout.a_offsets,
        batch.sorted_token_ids,
        batch.seg_starts,
        batch.seg_slots,
        _device_ints(tuple(proj_ids), str(x.device)),
        out,
        layer,
        K,
        k_per_split,
        num_r_chunks,
        x.stride(0),
        out.stride(0),
        out.stride(1),
        layout.max_slots,
        layout.max_rank,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        ALIGN=layout.row_align,
        ATOMIC=split_k > 1,
        UPCAST=_upcast(x.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def lora_expand_triton(
    *,
    xa: Tensor,
    layout: LoRALayout,
    layer: int,
    proj_ids: list[int],
    batch: LoRABatch,
    y: Tensor,
    out_slices: list[tuple[int, int]],
    block_n: int | None = None,
    block_r: int | None = None,
    cols_per_program: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """Triton backend of `kernels.lora.lora_expand` (inputs already checked there).

    Semantics: y[t, o_i:o_i+n_i] += scale[slot(t), layer, p_i] * xa[i, t, :rank] @ B^T[slot(t), layer, p_i][:rank, :n_i].

    xa: float32 [P, T, R]. y: [T, N] model dtype. out_slices: P (first column, width) pairs.
    block_n, block_r, cols_per_program, num_warps, num_stages: output tile, rank rows per step,
    output columns each program walks, warps and pipeline depth (benchmark sweeps).
    """
    num_segments, num_proj = batch.num_segments, len(proj_ids)
    if num_segments == 0 or batch.max_rank == 0:
        return
    widest = max(n for _, n in out_slices)
    block_t = _block_t(batch)
    block_n = block_n or _pow2(widest, 16, 64 if _INTERPRET or block_t >= 64 else 128)
    block_r = block_r or _pow2(batch.max_rank, 16, 128)  # the whole rank in one tile up to 128
    if cols_per_program is None:
        # Each program walks enough column tiles that the grid is ~4 programs per SM: the metadata
        # latency is paid once per program, and the tiles' loads are in flight ahead of their use.
        cols_per_program = widest * num_segments * num_proj // (4 * _num_sms(str(y.device)))
    cols_per_program = triton.cdiv(max(block_n, min(cols_per_program, widest)), block_n) * block_n
    slices = tuple(v for p, (start, n) in zip(proj_ids, out_slices, strict=True) for v in (p, start, n))
    assert all(0 <= p < NUM_PROJS for p in proj_ids)
    _expand_kernel[(num_segments, num_proj, triton.cdiv(widest, cols_per_program))](
        xa,
        layout.pool,
        layout.ranks,
        layout.scales,
        layout.b_offsets,
        batch.sorted_token_ids,
        batch.seg_starts,
        batch.seg_slots,
        _device_ints(slices, str(y.device)),
        y,
        layer,
        xa.stride(0),
        xa.stride(1),
        y.stride(0),
        layout.max_slots,
        layout.max_rank,
        cols_per_program,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        ALIGN=layout.row_align,
        MULTI_CHUNK=batch.max_rank > block_r,
        UPCAST=_upcast(y.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
