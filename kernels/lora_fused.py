"""Fused LoRA delta (launcher): shrink and expand of a projection group in one Triton launch.

Decode batches have a few tokens per adapter, so the two-kernel delta (lora_triton.py) is bound by
latency, not bytes: each kernel pays its launch, its metadata round trips and its tail. Here one
launch does both, with a handoff through per-(segment, slice) counters instead of a kernel boundary
(program and protocol in lora_fused_sgmv.py). The launcher plans the units:

* K chunks per slice (a power of two, at most 8): enough shrink units to give every SM work;
* expand units of a fixed column count, listed in a small table (slice, first and end column, units
  of that slice), made once per shape and kept on the device;
* the grid: at most the programs the GPU holds at once (measured from the compiled kernel's
  registers and shared memory), so a waiting program never waits on one that cannot start.

The counters live in one zeroed int32 buffer per (device, stream), left zero by every launch.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from lorafleet.kernels.lora_fused_sgmv import fused_kernel
from lorafleet.kernels.lora_layout import LoRABatch, LoRALayout
from lorafleet.kernels.lora_triton import (
    _INTERPRET,
    _block_t,
    _device_ints,
    _num_sms,
    _pdl,
    _rank_tile,
    _upcast,
)

SYNC_CAPACITY = 1 << 16  # (segment, slice) pairs one launch may use
PROGRAMS_PER_SM = 4  # units per SM the plan aims at, per phase
K_ALIGN = 256  # K chunks are multiples of the widest K tile
_sync_buffers: dict[tuple[str, int], Tensor] = {}
_occupancy: dict[tuple, int] = {}


def fused_fits(batch: LoRABatch, num_proj: int) -> bool:
    return batch.num_segments * num_proj <= SYNC_CAPACITY


def _sync_buffer(device: torch.device) -> Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _sync_buffers.get(key)
    if buf is None:
        buf = _sync_buffers[key] = torch.zeros(2, SYNC_CAPACITY, dtype=torch.int32, device=device)
    return buf


def plan(*, k: int, widths: list[int], num_segments: int, max_rank_tile: int, num_sms: int) -> tuple[int, int, list[tuple[int, ...]]]:
    """(K chunks, K chunk length, expand unit table) for one launch. A table row: slice i, the slice's
    first column (relative to slice 0), the unit's columns [lo, hi) within the slice, units of slice i.

    The expand sums a [K chunks, T, R] tile of partial sums in registers: K chunks x rank tile <= 128.
    """
    target = PROGRAMS_PER_SM * num_sms
    per_chunk = max(1, target // max(1, num_segments * len(widths)))
    most = max(1, min(8, 128 // max_rank_tile, triton.cdiv(k, K_ALIGN)))
    k_chunks = 1 << (min(per_chunk, most).bit_length() - 1)
    k_chunk = triton.cdiv(triton.cdiv(k, k_chunks), K_ALIGN) * K_ALIGN
    cols = max(K_ALIGN, triton.cdiv(triton.cdiv(num_segments * sum(widths), target), K_ALIGN) * K_ALIGN)
    table, col0 = [], 0
    for i, n in enumerate(widths):
        count = triton.cdiv(n, cols)
        table += [(i, col0, j * cols, min(n, (j + 1) * cols), count) for j in range(count)]
        col0 += n
    return k_chunks, k_chunk, table


def _resident(compiled, num_warps: int, device: torch.device) -> int:
    """Programs of a compiled kernel one SM holds at once (registers, shared memory, threads)."""
    props = torch.cuda.get_device_properties(device)
    regs = max(int(getattr(compiled, "n_regs", 255) or 255), 1)
    regs_per_warp = triton.cdiv(regs * 32, 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    shared = int(getattr(compiled.metadata, "shared", 0)) + 1024
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // shared
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
    return max(1, min(by_regs, by_shared, by_threads, 32))


def lora_delta_fused(
    *, x: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, y: Tensor, out_slices: list[tuple[int, int]],
    num_warps: int = 4, pdl: bool | int | None = None,
) -> None:  # fmt: skip
    """Triton backend of `kernels.lora.lora_delta` for decode-sized batches (inputs already checked there).

    Semantics: y[t, o_i:o_i+n_i] += scale[slot(t), layer, p_i] * (x[t] @ A^T[slot(t), layer, p_i][:, :rank]) @ B^T[...][:rank, :n_i].

    x: [T, K] model dtype. y: [T, N] model dtype, updated in place. out_slices: P (first column, width)
    pairs, contiguous and in order (q|k|v, gate|up). num_warps: warps per program. pdl: programmatic
    dependent launch (see lora_triton._pdl).
    """
    num_segments, num_proj = batch.num_segments, len(proj_ids)
    if num_segments == 0 or batch.max_rank == 0:
        return
    if any(out_slices[i][0] + out_slices[i][1] != out_slices[i + 1][0] for i in range(num_proj - 1)):
        raise ValueError(f"lora_delta_fused: output slices must be contiguous, got {out_slices}")
    device = x.device
    max_r = _rank_tile(batch)
    num_sms = _num_sms(str(device))
    k_chunks, k_chunk, table = plan(k=x.shape[1], widths=[n for _, n in out_slices], num_segments=num_segments, max_rank_tile=max_r, num_sms=num_sms)
    col0 = out_slices[0][0]
    units = _device_ints(tuple(v for i, first, lo, hi, count in table for v in (i, col0 + first, lo, hi, count)), str(device))
    xa = torch.empty(k_chunks, num_proj, x.shape[0], max(batch.max_rank, 1), dtype=torch.float32, device=device)
    sync = _sync_buffer(device)
    total = num_segments * (num_proj * k_chunks + len(table))
    block_t = _block_t(batch)
    key = (str(device), num_proj, k_chunks, block_t, max_r, layout.row_align, x.dtype, num_warps)
    if _INTERPRET:
        grid, spin = 1, 0  # programs run one after another: one program walks every unit in order
    else:
        grid, spin = min(total, num_sms * _occupancy.get(key, 1)), 1
    use_pdl = _pdl(pdl if pdl is not None else 1, device, grid)
    compiled = fused_kernel[(grid,)](
        x, layout.pool, layout.ranks, layout.scales, layout.a_offsets, layout.b_offsets,
        batch.sorted_token_ids, batch.seg_starts, batch.seg_slots,
        _device_ints(tuple(proj_ids), str(device)), units, xa, sync, y,
        layer, x.shape[1], k_chunk, num_segments, len(table),
        x.stride(0), xa.stride(0), xa.stride(1), xa.stride(2), y.stride(0), SYNC_CAPACITY,
        layout.max_slots, layout.max_rank,
        NUM_PROJ=num_proj, K_CHUNKS=k_chunks, BLOCK_T=block_t, MAX_R=max_r, ALIGN=layout.row_align,
        UPCAST=_upcast(x.dtype), SPIN=spin, PDL=use_pdl, num_warps=num_warps,
        **({"launch_pdl": True} if use_pdl else {}),
    )  # fmt: skip
    if not _INTERPRET and key not in _occupancy:
        _occupancy[key] = _resident(compiled, num_warps, device)

