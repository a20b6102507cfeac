"""Triton SGMV: segmented-gather LoRA shrink and expand over the unified page pool (launchers).

One launch serves every segment (tokens of one adapter slot) and every projection of a fused group
(q|k|v, gate|up). Each program reads its adapter's rows through `LoRALayout`'s offsets (a row is
contiguous in the pool), covers the slot's *true* rank (no padding to the batch's largest rank:
shrink's rank chunks past a slot's rank exit, masked loads fetch nothing), and skips at once a segment
with slot -1 or a module the slot does not adapt. The adapter rows of a segment are read once and
reused by all its tokens; `make_lora_batch` cuts long runs into segments (16 to 64 tokens as the
step grows, `segment_len`) so one adapter's prefill still spreads over many programs.

Grids (programs in lora_sgmv.py): shrink (segment, (projection, rank chunk of 16 rows) pairs, K split),
each split storing its partial sum in out[split], one pair a program at decode and at prefill as many
as fit the grid in one wave (they share each x tile, see shrink_chunks); expand (segment, projection,
column range): each program holds its slot's whole rank in one tile of its rank class (16, 32, 64 or 128 rows; a smaller class
gets a wider column tile and more columns, so every program reads about the same bytes; groups wider
than CLASS_TILES_MIN_COLS columns, else one tile of the largest class), adds the splits of xa as it
loads them, and walks its column tiles with y read two tiles ahead (or, in write mode, y = delta
without reading y). Loads are upcast to float32 under Triton's interpreter (its bf16/fp16 arithmetic
is wrong) and for float32 models; on a GPU, 16-bit operands go to the tensor cores with float32
accumulation. On Hopper the kernels use programmatic dependent launch (metadata reads overlap the
previous kernel's work).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from torch import Tensor

from lorafleet.kernels.lora_layout import NUM_PROJS, LoRABatch, LoRALayout, pow2_divisor
from lorafleet.kernels.lora_sgmv import XA_TILE, expand_kernel, gdc_wait, shrink_kernel

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CLASS_TILES_MIN_COLS = 4096  # expand tiles per rank class only where the slices total more columns than this
XA_TILE_ELEMS = XA_TILE.value  # splits x token tile x rank tile of xa that expand sums in one group of loads


@functools.cache  # never let go: a captured CUDA graph reads these tensors' memory at every replay
def _device_ints(values: tuple[int, ...], device: str) -> Tensor:
    """A small int32 tensor, made once per (values, device): no host-to-device copy per call (graph-safe).
    The values are a model's projection ids and slice bounds: a few per model."""
    return torch.tensor(values, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=8)
def _num_sms(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4


@functools.lru_cache(maxsize=8)
def pdl_supported(device: str) -> bool:
    """Programmatic dependent launch: a Hopper-or-newer GPU and a Triton that can launch with it."""
    if _INTERPRET or not device.startswith("cuda") or gdc_wait is None:
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(torch.device(device))[0] >= 9


def _pdl(pdl: bool | None, device: torch.device) -> bool:
    """Programmatic dependent launch for a launch: where supported, unless pdl is False. Each program lets
    the next kernel launch once it has passed its own wait (lora_sgmv._gdc_launch_dependents). H200,
    against the trigger placed after the main loop (or before the wait for one-wave grids): the layer's
    delta 87.0 vs 91.9 us at T=64 over 32 adapters of mixed ranks, 82.6 vs 86.7 at T=1024 over 8,
    63.3 vs 65.0 at T=256 over 32; equal at T=1 and T=64 at rank 16."""
    return pdl is not False and pdl_supported(str(device))


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def _block_t(batch: LoRABatch) -> int:
    """Token tile: a decode batch has ~1 token per segment, a prefill batch many."""
    per_segment = batch.num_tokens / max(batch.num_segments, 1)
    return _pow2(int(per_segment), 16, 64)


def _rank_tile(batch: LoRABatch) -> int:
    return _pow2(batch.max_rank, 16, 128)  # expand holds the whole rank in one tile up to 128


def _upcast(dtype: torch.dtype) -> bool:
    return _INTERPRET or dtype == torch.float32


def shrink_chunks(*, num_proj: int, batch: LoRABatch, splits: int, device: torch.device, block_r: int, most_rows: int = 64) -> int:
    """(projection, rank chunk) pairs of one shrink program, a power of two. At prefill (64-token tiles)
    a program's pipelined x and A tiles take ~120 KB of shared memory, one program per SM: a grid of
    more programs than SMs runs a second, mostly idle wave, so programs take several pairs (sharing
    each x tile) until the grid fits one wave (H200, q|k|v at T=1024 over 8 adapters: 9.3 us with two
    pairs a program, 128 programs, against 12.0 with one, 192 programs; gate|up's 128 programs gain
    nothing; kernels_grouped_shrink_20261130_h200.json). A power of two, so it may pass the number of
    pairs (3 pairs in 4: the spare rows are masked). At decode one pair (more programs keep more weight
    bytes in flight)."""
    if _block_t(batch) < 64 or batch.max_rank == 0:
        return 1
    pairs = num_proj * triton.cdiv(batch.max_rank, block_r)
    chunks = 1
    while chunks * block_r < most_rows and chunks < pairs and batch.num_segments * triton.cdiv(pairs, chunks) * splits > _num_sms(str(device)):
        chunks *= 2
    return chunks


def shrink_splits(*, k: int, num_proj: int, batch: LoRABatch, device: torch.device, programs_per_sm: int = 8) -> int:
    """K splits of a shrink (the first dim of its output): enough programs to fill the GPU, few enough
    that expand sums every split of its xa tile in registers; a power of two."""
    if batch.num_segments == 0 or batch.max_rank == 0:
        return 1
    # Rank chunks past a slot's rank exit at once: count the programs of the batch's mean rank (so a batch
    # mixing ranks gets the splits of one whose ranks all equal that mean).
    programs = batch.num_segments * num_proj * max(1, triton.cdiv(round(batch.planning_rank), 16) // 2)
    splits = triton.cdiv(programs_per_sm * _num_sms(str(device)), programs)
    # At most one group of xa loads for a program of the batch's typical rank class (larger classes sum
    # theirs in several, see lora_sgmv._load_xa): a rank-64 slot among rank-8 ones must not halve every
    # program's splits (H200, down_proj over ranks {8,16,32,64}: 21.6 us with 8 splits vs 13.7 at rank 30).
    # A batch of one or two segments (one adapter's tokens) has too few programs without more splits: its
    # expand sums them in several groups (H200, T=64 over one adapter: 35 us with 16 splits vs 38 with 4).
    group = XA_TILE_ELEMS * (4 if batch.num_segments <= 2 else 1)
    most = max(1, group // (_block_t(batch) * max(32, _pow2(round(batch.planning_rank), 16, 128))))
    splits = max(1, min(splits, triton.cdiv(k, 128), most, 16))
    # A power of two: the expand kernel is compiled per split count, and a server's batches must not
    # keep finding new counts (each a JIT compile stalling a step).
    return 1 << (splits.bit_length() - 1)


def lora_shrink_triton(
    *,
    x: Tensor,
    layout: LoRALayout,
    layer: int,
    proj_ids: list[int],
    batch: LoRABatch,
    out: Tensor,
    block_k: int | None = None,
    block_r: int | None = None,
    chunks: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool | None = None,
) -> None:
    """Triton backend of `kernels.lora.lora_shrink` (inputs already checked there).

    Semantics: sum_s out[s, i, t, j] = sum_k x[t, k] * A[slot(t), layer, proj_ids[i]][j, k] for j < rank(slot(t)).

    x: [T, K] model dtype. out: float32 [S, P, T, R]: split s sums K range s of S (each split writes
    its partial sum, zeros for an empty range). block_k, block_r, chunks, num_warps, num_stages: tile
    over K, rank rows of a chunk (ranks above it take several), (projection, rank chunk) pairs per
    program (default: shrink_chunks), warps per program and pipeline depth (benchmark sweeps).
    pdl: programmatic dependent launch (default: where supported, see _pdl).
    """
    num_segments, num_proj = batch.num_segments, len(proj_ids)
    if num_segments == 0 or batch.max_rank == 0:
        return
    K, num_splits = x.shape[1], out.shape[0]
    block_t = _block_t(batch)
    block_r = block_r or (64 if _INTERPRET else 16)
    num_pairs = num_proj * triton.cdiv(batch.max_rank, block_r)
    chunks = chunks or shrink_chunks(num_proj=num_proj, batch=batch, splits=num_splits, device=x.device, block_r=block_r)
    if chunks & (chunks - 1):
        raise ValueError(f"lora_shrink_triton: chunks must be a power of two, got {chunks}")
    # float32 tiles take twice the bytes: 256-wide K tiles three deep need 256 KiB of shared memory (sm_90: 227)
    wide = x.element_size() < 4
    block_k = block_k or _pow2(triton.cdiv(K, num_splits), 16, 256 if block_t >= 64 and wide else 128)
    num_stages = num_stages or (3 if wide else 2)
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), num_splits) * block_k
    grid = (num_segments, triton.cdiv(num_pairs, chunks), num_splits)
    use_pdl = _pdl(pdl, x.device)
    shrink_kernel[grid](
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
        num_pairs // num_proj,
        num_pairs,
        x.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        layout.max_slots,
        layout.max_rank,
        batch.max_rank,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        CHUNKS=chunks,
        BLOCK_K=block_k,
        ALIGN=layout.row_align,
        UPCAST=_upcast(x.dtype),
        PDL=use_pdl,
        # 4 warps at every token tile: at [64, 256] tiles 8 spill registers (sm_90) and run slower (H200,
        # T=1024 over 8 adapters: the layer's delta 87 vs 93 us with the expand's 8 warps below).
        num_warps=num_warps or 4,
        num_stages=num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
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
    programs_per_sm: int = 2,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool | None = None,
    accumulate: bool = True,
    class_tile_elems: int = 8192,
) -> None:
    """Triton backend of `kernels.lora.lora_expand` (inputs already checked there).

    Semantics: y[t, o_i:o_i+n_i] += scale[slot(t), layer, p_i] * (sum_s xa[s, i, t, :rank]) @ B^T[slot(t), layer, p_i][:rank, :n_i].

    xa: float32 [S, P, T, R] (S partial sums). y: [T, N] model dtype. out_slices: P (first column,
    width) pairs. block_n, block_r, cols_per_program, programs_per_sm, num_warps, num_stages: output
    tile, rank rows per step, output columns each program walks (default: ~programs_per_sm programs
    per SM), warps and pipeline depth (benchmark sweeps).
    pdl: programmatic dependent launch (default: where supported, see _pdl).
    accumulate: False writes y = delta for the segments' tokens instead of adding (see lora.lora_expand).
    class_tile_elems: elements of a decode program's B tile (rank class x column tile), per rank class.
    """
    num_segments, num_proj = batch.num_segments, len(proj_ids)
    if num_segments == 0 or batch.max_rank == 0:
        return
    widest = max(n for _, n in out_slices)
    block_t = _block_t(batch)
    num_stages = num_stages or (3 if layout.pool.element_size() < 4 else 2)  # float32: see lora_shrink_triton
    # Tiles per rank class, unless a tuning sweep fixes both for every program (or ranks pass 128).
    # H200, ranks {8, 16, 32, 64} at T=64: they pay on q|k|v and gate|up, and cost ~1.5 us on a lone
    # 4096-wide o or down slice (each class-16 program is then one wide tile, many programs idle).
    by_class = block_r is None and block_n is None and batch.max_rank <= 128 and sum(n for _, n in out_slices) > CLASS_TILES_MIN_COLS
    block_r = block_r or _rank_tile(batch)

    def tile_n(rank_class: int) -> int:
        # Decode: wide column tiles (up to 512 x 16 rank rows: more bytes in flight per program); prefill:
        # 128 (the [64, 128] float32 accumulator and y tiles fill the registers). H200 sweep of bench/lora_kernels.py.
        return _pow2(widest, 16, 64 if _INTERPRET else 128 if block_t >= 64 else max(64, class_tile_elems // rank_class))

    block_n = block_n or tile_n(block_r)
    multi_chunk = batch.max_rank > block_r
    # The batch's typical rank class: a program of a slot in that class walks cols_per_program columns;
    # larger ranks fewer, smaller more (see expand_kernel), so the grid covers the largest class.
    ref_rank = min(_pow2(round(batch.planning_rank), 16, 128), block_r) if by_class else block_r
    if cols_per_program is None:
        # Each program walks enough column tiles that the grid is ~programs_per_sm programs per SM: the
        # metadata latency is paid once per program, and the tiles' loads are in flight ahead of their use.
        cols_per_program = widest * num_segments * num_proj // (programs_per_sm * _num_sms(str(y.device)))
    cols_per_program = triton.cdiv(max(block_n, min(cols_per_program, widest)), block_n) * block_n
    fewest_cols = max(block_n, (cols_per_program * ref_rank // block_r) // block_n * block_n)
    slices = tuple(v for p, (start, n) in zip(proj_ids, out_slices, strict=True) for v in (p, start, n))
    assert all(0 <= p < NUM_PROJS for p in proj_ids)
    grid = (num_segments, num_proj, triton.cdiv(widest, fewest_cols))
    use_pdl = _pdl(pdl, y.device)
    expand_kernel[grid](
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
        xa.stride(2),
        y.stride(0),
        layout.max_slots,
        layout.max_rank,
        batch.max_rank,
        cols_per_program,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        N16=tile_n(16),
        N32=tile_n(32),
        N64=tile_n(64),
        SPLITS=xa.shape[0],
        ALIGN=layout.row_align,
        ALIGN_N=pow2_divisor([v for start, n in out_slices for v in (start, n)]),
        MULTI_CHUNK=multi_chunk,
        BY_CLASS=by_class,
        REF_RANK=ref_rank,
        UPCAST=_upcast(y.dtype),
        PDL=use_pdl,
        ACCUMULATE=int(accumulate),
        # Prefill tiles ([64, 128] float32 accumulator) spill registers at 4 warps (sm_90: 64 bytes).
        num_warps=num_warps or (8 if block_t >= 64 else 4),
        num_stages=num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
