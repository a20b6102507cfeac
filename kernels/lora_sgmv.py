"""Triton SGMV programs: segmented-gather LoRA shrink and expand (the launchers are in lora_triton.py).

Both read their metadata in as few dependent memory round trips as possible: the segment's slot and
token range first; then, all at once, the slot's rank, scale, the shrink's A row offsets and the
segment's token ids (loaded before the early exits, masked loads are safe); the expand's B row
offsets (masked by the rank) after them; then the data. With programmatic dependent launch (PDL,
Hopper) that metadata is read while the previous kernel works: every program calls
`gdc_wait` before it touches x, xa, y or out (the previous kernel's results, or a buffer it may still
read), and past its wait lets the next kernel launch. A program with nothing to do returns before the
wait, freeing its SM slot at once, except the grid's first program: its wait keeps the grid from
completing ahead of its predecessor (H200: a batch of mixed ranks {8, 16, 32, 64} over 32 adapters
then takes 1.08x (T=64) and 1.09x (T=256) the time of one whose ranks all equal their mean, against
1.14x and 1.16x when every program waited; kernels_early_exit_20261130_h200.json). Weight tiles
read before the wait were slower (T=64 over 32 adapters 64.5 vs 57.4 us,
kernels_pdl_trigger_20261130_h200.json).

Shrink writes per-split partial sums (out[split]) with plain stores: no zero fill, no atomics; expand
adds the splits as it loads its (tiny) xa tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the launchers never set PDL
    gdc_launch_dependents = gdc_wait = None


XA_TILE = tl.constexpr(8192)  # elements of xa (splits x token tile x rank tile) the expand sums in one unrolled group


@triton.jit
def _gdc_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def _gdc_launch_dependents(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has passed its own wait: the next
    kernel's programs read their metadata while this one works, and launches run at most one kernel
    ahead (a trigger before the wait would let a chain of waiting kernels fill the GPU)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def shrink_kernel(
    x_ptr,  # [T, K] model dtype
    pool_ptr,  # flat pool, model dtype
    ranks_ptr,  # int32 [L, 7, M]
    a_off_ptr,  # int64 [L, 7, M, max_rank]
    token_ids_ptr,  # int32 [T_lora]
    seg_starts_ptr,  # int32 [S+1]
    seg_slots_ptr,  # int32 [S]
    proj_ids_ptr,  # int32 [P]
    out_ptr,  # float32 [splits, P, T, R]
    layer,
    K,
    k_per_split,
    num_r_chunks,
    num_chunks,  # P * num_r_chunks
    stride_xt,
    stride_os,
    stride_op,
    stride_ot,
    max_slots,
    layout_max_rank,
    batch_max_rank,  # ranks above it are cut to it (the xa buffer holds batch.max_rank rows)
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNKS: tl.constexpr,  # (projection, rank chunk) pairs per program: their rows share each x tile
    BLOCK_K: tl.constexpr,
    ALIGN: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (segment, chunks of (projection, A rank rows), K split): the segment's tokens of x
    times the slot's A rows (true rank only), one float32 partial sum per split into out[split, p, t, :rank]. Launcher:
    lora_triton.lora_shrink_triton; meaning: kernels/lora.py lora_shrink."""
    seg = tl.program_id(0)
    split = tl.program_id(2)
    # Round trip 1: independent metadata (in _shrink_rows, the program's projections).
    slot = tl.load(seg_slots_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    # Round trip 2: ranks, row offsets and the first token ids together.
    i, offs_r, a_row, r_mask, idle = _shrink_rows(proj_ids_ptr, ranks_ptr, a_off_ptr, slot, layer, num_r_chunks, num_chunks, max_slots, layout_max_rank,
                                                  batch_max_rank, BLOCK_R, CHUNKS, ALIGN)  # fmt: skip
    arange_t = tl.arange(0, BLOCK_T)
    tok = tl.load(token_ids_ptr + start + arange_t, mask=start + arange_t < end, other=0)
    # No slot, modules the slot does not adapt, or rank chunks past the slot's ranks: nothing to do.
    if idle and _leaves_early(seg + tl.program_id(1) + split):
        return
    _gdc_wait(PDL)
    _gdc_launch_dependents(PDL)
    if idle:
        return
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    arange_k = tl.arange(0, BLOCK_K)
    out_cols = out_ptr + split * stride_os + i * stride_op + offs_r
    for t0 in range(start, end, BLOCK_T):
        t_mask = t0 + arange_t < end
        tok64 = tok.to(tl.int64)
        acc = tl.zeros([BLOCK_T, CHUNKS * BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + arange_k
            k_mask = offs_k < k_hi
            # x tile [BLOCK_T, BLOCK_K]: gathered token rows; A tile [rows, BLOCK_K]: pool rows, contiguous along K.
            xt = tl.load(x_ptr + tok64[:, None] * stride_xt + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(pool_ptr + a_row[:, None] + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(at))
        # Every split stores its partial sum (zeros for an empty K range): no zero fill, no atomics.
        tl.store(out_cols[None, :] + tok64[:, None] * stride_ot, acc, mask=t_mask[:, None] & r_mask[None, :])
        nxt = t0 + BLOCK_T + arange_t
        tok = tl.load(token_ids_ptr + nxt, mask=nxt < end, other=0)


@triton.jit
def _shrink_rows(proj_ids_ptr, ranks_ptr, a_off_ptr, slot, layer, num_r_chunks, num_chunks, max_slots, layout_max_rank, batch_max_rank,
                 BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, ALIGN: tl.constexpr):  # fmt: skip
    """A shrink program's rows: CHUNKS (projection, rank chunk) pairs of BLOCK_R rows from program_id(1) *
    CHUNKS, pair j = projection j // num_r_chunks, rank rows from (j % num_r_chunks) * BLOCK_R. Returns the
    projection index (per row, or one for the program), the rank rows, their pool offsets, which rows are
    below their slot's rank, and whether none is. One pair per program reads scalar metadata (decode:
    per-row loads of the same rank cost ~0.7 us a shrink on the H200). Slot -1 reads slot 0's, unused."""
    if CHUNKS == 1:
        i = tl.program_id(1) // num_r_chunks
        r0 = (tl.program_id(1) % num_r_chunks) * BLOCK_R
        offs_r = r0 + tl.arange(0, BLOCK_R)
        valid = offs_r < layout_max_rank
    else:
        offs_q = tl.arange(0, CHUNKS * BLOCK_R)
        chunk = tl.program_id(1) * CHUNKS + offs_q // BLOCK_R
        i = tl.minimum(chunk, num_chunks - 1) // num_r_chunks  # rows past the last pair: the last projection's, masked
        offs_r = (chunk % num_r_chunks) * BLOCK_R + offs_q % BLOCK_R
        valid = (chunk < num_chunks) & (offs_r < layout_max_rank)
    proj = tl.load(proj_ids_ptr + i)
    meta = (layer * 7 + proj) * max_slots + tl.maximum(slot, 0)
    rank = tl.where(slot < 0, 0, tl.minimum(tl.load(ranks_ptr + meta), batch_max_rank))
    a_row = tl.multiple_of(tl.load(a_off_ptr + meta.to(tl.int64) * layout_max_rank + offs_r, mask=valid, other=0), ALIGN)
    if CHUNKS == 1:
        r_mask = offs_r < rank  # rank <= layout_max_rank
        idle = r0 >= rank
    else:
        r_mask = valid & (offs_r < rank)
        idle = tl.max(r_mask.to(tl.int32), axis=0) == 0
    return i, offs_r, a_row, r_mask, idle


@triton.jit
def _load_xa(xa_base, stride_xs, tok64, t_mask, offs_r, r_mask, stride_xt, SPLITS: tl.constexpr):
    """sum over the SPLITS splits of xa[s, tok, offs_r]: float32 [BLOCK_T, BLOCK_R]. The loads of a group of
    splits holding at most XA_TILE elements are unrolled and independent; groups follow one another (a
    program of a large rank class in a batch whose splits were planned for smaller ranks)."""
    ptrs = xa_base + tok64[:, None] * stride_xt + offs_r[None, :]
    mask = t_mask[:, None] & r_mask[None, :]
    TILE: tl.constexpr = tok64.shape[0] * offs_r.shape[0]
    GROUP: tl.constexpr = XA_TILE // TILE if TILE <= XA_TILE else 1
    FIRST: tl.constexpr = SPLITS if SPLITS < GROUP else GROUP
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, FIRST):
        acc += tl.load(ptrs + s * stride_xs, mask=mask, other=0.0)
    if SPLITS > GROUP:  # the last group may be partial (a split count that is not a power of two)
        for s0 in range(GROUP, SPLITS, GROUP):
            for s in tl.static_range(GROUP):
                acc += tl.load(ptrs + (s0 + s) * stride_xs, mask=mask & (s0 + s < SPLITS), other=0.0)
    return acc


@triton.jit
def expand_kernel(
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
    batch_max_rank,  # ranks above it are cut to it (the xa buffer holds batch.max_rank rows)
    cols_per_program,  # columns of a program whose slot's rank class is REF_RANK
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rank tile: the batch's largest rank class (or a smaller tile with MULTI_CHUNK)
    BLOCK_N: tl.constexpr,  # column tile of the BLOCK_R class
    N16: tl.constexpr,  # column tiles of the smaller rank classes (BY_CLASS)
    N32: tl.constexpr,
    N64: tl.constexpr,
    SPLITS: tl.constexpr,
    ALIGN: tl.constexpr,
    ALIGN_N: tl.constexpr,
    MULTI_CHUNK: tl.constexpr,
    BY_CLASS: tl.constexpr,
    REF_RANK: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # 1: y += delta; 0: y = delta (zeros where the slot does not adapt the module)
):
    """One program per (segment, projection, column range of its slice): the K splits of xa summed, times the
    slot's B^T rows (true rank) and scale, added into (or written to) y's columns of that range. Launcher:
    lora_triton.lora_expand_triton; meaning: kernels/lora.py lora_expand."""
    seg = tl.program_id(0)
    i = tl.program_id(1)
    c = tl.program_id(2)
    # Round trip 1: independent metadata.
    slot = tl.load(seg_slots_ptr + seg)
    proj = tl.load(slices_ptr + i * 3)
    # Slice starts and widths are multiples of ALIGN_N: y and B tiles load as vectors, masks included.
    col0 = tl.multiple_of(tl.load(slices_ptr + i * 3 + 1), ALIGN_N)
    width = tl.multiple_of(tl.load(slices_ptr + i * 3 + 2), ALIGN_N)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    # Round trip 2: rank, scale and the first token ids together.
    meta = (layer * 7 + proj) * max_slots + tl.maximum(slot, 0)
    rank = tl.minimum(tl.load(ranks_ptr + meta), batch_max_rank)
    scale = tl.load(scales_ptr + meta)
    b_rows = b_off_ptr + meta.to(tl.int64) * layout_max_rank
    arange_t = tl.arange(0, BLOCK_T)
    tok = tl.load(token_ids_ptr + start + arange_t, mask=start + arange_t < end, other=0)
    rank = tl.where(slot < 0, 0, rank)
    # Nothing to do: no column of this program's range (a narrower slice, or a smaller rank class walking
    # more columns per program), or no delta to add.
    cols = _rank_cols(rank, cols_per_program, REF_RANK, BLOCK_R, BLOCK_N, N16, N32, N64, BY_CLASS)
    if (c * cols >= width or (ACCUMULATE and rank == 0)) and _leaves_early(seg + i + c):
        return
    # The wait is in each branch: a program reads its B row offsets (metadata) before it.
    xa_base = xa_ptr + i * stride_xp
    y_base = y_ptr + col0
    # Rank classes 16, 32, 64, 128: a program of a smaller class uses a wider column tile (the same
    # bytes per tile) and walks more columns (the same tiles per program), so a batch mixing ranks
    # runs like one whose ranks all equal its mean. The grid has the columns of the largest class.
    # (Each branch computes its own columns, the value `cols` holds: passing `cols` instead takes fewer
    # sm_90 registers, 218 to 128, but ran the layer's decode delta at 80.5 against 56.3 us on the H200,
    # kernels_act_expand_trials_20261130_h200.json.)
    if rank == 0:
        _gdc_wait(PDL)
        _gdc_launch_dependents(PDL)
        if not ACCUMULATE:
            cols = _class_cols(cols_per_program, REF_RANK, BLOCK_R, BLOCK_N)
            _store_zeros(y_base, stride_yt, token_ids_ptr, start, end, c * cols, tl.minimum(c * cols + cols, width), BLOCK_T, BLOCK_N)
    elif not BY_CLASS:
        _expand_program(xa_base, stride_xs, stride_xt, pool_ptr, b_rows, token_ids_ptr, tok, start, end, rank, scale, y_base, stride_yt, c,
                        _class_cols(cols_per_program, BLOCK_R, BLOCK_R, BLOCK_N), width, BLOCK_T, BLOCK_R, BLOCK_N, SPLITS, ALIGN, MULTI_CHUNK, UPCAST, ACCUMULATE, PDL)
    elif rank <= 16:
        _expand_program(xa_base, stride_xs, stride_xt, pool_ptr, b_rows, token_ids_ptr, tok, start, end, rank, scale, y_base, stride_yt, c,
                        _class_cols(cols_per_program, REF_RANK, 16, N16), width, BLOCK_T, 16, N16, SPLITS, ALIGN, False, UPCAST, ACCUMULATE, PDL)
    elif rank <= 32:
        if BLOCK_R >= 32:  # compiled only where the batch holds such ranks
            _expand_program(xa_base, stride_xs, stride_xt, pool_ptr, b_rows, token_ids_ptr, tok, start, end, rank, scale, y_base, stride_yt, c,
                            _class_cols(cols_per_program, REF_RANK, 32, N32), width, BLOCK_T, 32, N32, SPLITS, ALIGN, False, UPCAST, ACCUMULATE, PDL)
    elif rank <= 64:
        if BLOCK_R >= 64:
            _expand_program(xa_base, stride_xs, stride_xt, pool_ptr, b_rows, token_ids_ptr, tok, start, end, rank, scale, y_base, stride_yt, c,
                            _class_cols(cols_per_program, REF_RANK, 64, N64), width, BLOCK_T, 64, N64, SPLITS, ALIGN, False, UPCAST, ACCUMULATE, PDL)
    else:
        if BLOCK_R >= 128:
            _expand_program(xa_base, stride_xs, stride_xt, pool_ptr, b_rows, token_ids_ptr, tok, start, end, rank, scale, y_base, stride_yt, c,
                            _class_cols(cols_per_program, REF_RANK, 128, BLOCK_N), width, BLOCK_T, 128, BLOCK_N, SPLITS, ALIGN, False, UPCAST, ACCUMULATE, PDL)


@triton.jit
def _leaves_early(pid_sum):
    """Whether a program with nothing to do may return before its wait: any but the grid's first (pid_sum
    0), whose wait alone keeps the grid from completing ahead of the previous kernel. Leaving at once
    frees its SM slot for working ones. Without PDL the wait does nothing and leaving early changes
    nothing, but the programs take the same exits (so the interpreter's tests check their conditions)."""
    return pid_sum > 0


@triton.jit
def _rank_cols(rank, cols_per_program, REF_RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, N16: tl.constexpr,
               N32: tl.constexpr, N64: tl.constexpr, BY_CLASS: tl.constexpr):  # fmt: skip
    """Columns a program of a slot of this rank covers (as expand_kernel's branches compute them)."""
    if rank == 0:
        cols = _class_cols(cols_per_program, REF_RANK, BLOCK_R, BLOCK_N)
    elif not BY_CLASS:
        cols = _class_cols(cols_per_program, BLOCK_R, BLOCK_R, BLOCK_N)
    elif rank <= 16:
        cols = _class_cols(cols_per_program, REF_RANK, 16, N16)
    elif rank <= 32:
        cols = _class_cols(cols_per_program, REF_RANK, 32, N32)
    elif rank <= 64:
        cols = _class_cols(cols_per_program, REF_RANK, 64, N64)
    else:
        cols = _class_cols(cols_per_program, REF_RANK, 128, BLOCK_N)
    return cols


@triton.jit
def _class_cols(cols_per_program, REF_RANK: tl.constexpr, RANK_CLASS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns one program of a rank class walks: cols_per_program scaled by REF_RANK / RANK_CLASS, whole tiles."""
    return tl.maximum(BLOCK_N, (cols_per_program * REF_RANK // RANK_CLASS) // BLOCK_N * BLOCK_N)


@triton.jit
def _expand_program(
    xa_base, stride_xs, stride_xt, pool_ptr, b_rows, token_ids_ptr, tok, start, end, rank, scale, y_ptr, stride_yt, c, cols, width,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ALIGN: tl.constexpr,
    MULTI_CHUNK: tl.constexpr, UPCAST: tl.constexpr, ACCUMULATE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program's columns [c * cols, (c + 1) * cols) of a slice, every token tile of its segment. The
    B row offsets (metadata) are read before the PDL wait, so the B tiles load as soon as it ends."""
    n_lo = c * cols
    n_hi = tl.minimum(n_lo + cols, width)
    arange_r = tl.arange(0, BLOCK_R)
    r_mask0 = arange_r < rank
    b_row0 = tl.multiple_of(tl.load(b_rows + arange_r, mask=r_mask0, other=0), ALIGN)
    _gdc_wait(PDL)
    _gdc_launch_dependents(PDL)
    if n_lo < width:
        arange_t = tl.arange(0, BLOCK_T)
        arange_n = tl.arange(0, BLOCK_N)
        for t0 in range(start, end, BLOCK_T):
            t_mask = t0 + arange_t < end
            tok64 = tok.to(tl.int64)
            # The first rank tile of xa is the same for every column tile: loaded once, splits summed.
            xt0 = _load_xa(xa_base, stride_xs, tok64, t_mask, arange_r, r_mask0, stride_xt, SPLITS)
            if not UPCAST:
                xt0 = xt0.to(pool_ptr.dtype.element_ty)
            # y tiles are read two column tiles ahead: their loads are not dot operands, so the compiler's
            # pipelining does not cover them, and a program walking many tiles would wait a full memory
            # latency per tile.
            y_row = y_ptr + tok64[:, None] * stride_yt
            if ACCUMULATE:
                ya = tl.load(y_row + (n_lo + arange_n)[None, :], mask=t_mask[:, None] & (n_lo + arange_n < n_hi)[None, :], other=0.0)
                yb = tl.load(y_row + (n_lo + BLOCK_N + arange_n)[None, :], mask=t_mask[:, None] & (n_lo + BLOCK_N + arange_n < n_hi)[None, :], other=0.0)
            else:  # y = delta: y is not read
                ya = tl.zeros([BLOCK_T, BLOCK_N], dtype=y_ptr.dtype.element_ty)
                yb = ya
            for n0 in range(n_lo, n_hi, BLOCK_N):
                if ACCUMULATE:
                    ahead = n0 + 2 * BLOCK_N + arange_n
                    yc = tl.load(y_row + ahead[None, :], mask=t_mask[:, None] & (ahead < n_hi)[None, :], other=0.0)
                else:
                    yc = ya
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
                        acc = _expand_chunk(acc, xa_base, stride_xs, pool_ptr, b_row, tok64, t_mask, stride_xt, r0, rank, offs_n, n_mask, BLOCK_R, SPLITS, ALIGN, UPCAST)
                tl.store(y_row + offs_n[None, :], (ya.to(tl.float32) + acc * scale).to(ya.dtype), mask=t_mask[:, None] & n_mask[None, :])
                ya = yb
                yb = yc
            nxt = t0 + BLOCK_T + arange_t
            tok = tl.load(token_ids_ptr + nxt, mask=nxt < end, other=0)


@triton.jit
def _store_zeros(y_ptr, stride_yt, token_ids_ptr, start, end, n_lo, n_hi, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[tok, n_lo:n_hi] = 0 for the segment's tokens."""
    arange_t = tl.arange(0, BLOCK_T)
    arange_n = tl.arange(0, BLOCK_N)
    for t0 in range(start, end, BLOCK_T):
        t_mask = t0 + arange_t < end
        tok = tl.load(token_ids_ptr + t0 + arange_t, mask=t_mask, other=0).to(tl.int64)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + arange_n
            tl.store(y_ptr + tok[:, None] * stride_yt + offs_n[None, :], tl.zeros([BLOCK_T, BLOCK_N], dtype=y_ptr.dtype.element_ty),
                     mask=t_mask[:, None] & (offs_n < n_hi)[None, :])


@triton.jit
def _expand_chunk(
    acc, xa_base, stride_xs, pool_ptr, b_row, tok64, t_mask, stride_xt, r0, rank, offs_n, n_mask,
    BLOCK_R: tl.constexpr, SPLITS: tl.constexpr, ALIGN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """acc += xa[tok, r0:r0+BLOCK_R] @ B^T[r0:r0+BLOCK_R, offs_n] for the rows below rank."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_row = tl.multiple_of(b_row, ALIGN)
    # B^T tile [BLOCK_R, BLOCK_N]: each row contiguous in the pool; xa tile [BLOCK_T, BLOCK_R].
    bt = tl.load(pool_ptr + b_row[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    xt = _load_xa(xa_base, stride_xs, tok64, t_mask, offs_r, r_mask, stride_xt, SPLITS)
    if UPCAST:
        acc += tl.dot(xt, bt.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(xt.to(bt.dtype), bt)
    return acc
