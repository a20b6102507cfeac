"""Public LoRA entry points: `lora_shrink` and `lora_expand`, a checked launcher over two backends.

A layer's LoRA delta for fused projections (q|k|v or gate|up) is two calls:

    xa = shrink_buffer(x=x, proj_ids=[0, 1, 2], batch=batch)  # float32 [splits, P, T, R]
    lora_shrink(x=x, layout=layout, layer=l, proj_ids=[0, 1, 2], batch=batch, out=xa)
    lora_expand(xa=xa, layout=layout, layer=l, proj_ids=[0, 1, 2], batch=batch, y=qkv, out_offsets=[0, 4096, 5120])

`lora_xa` is the first two lines in one call, `lora_delta` all three; `lora_silu_mul` takes gate|up's shrink output and folds
the expand into the MLP's activation (kernels/lora_act.py). `lora_expand(..., accumulate=False)` writes y = delta
instead of adding, for a caller that lets the base GEMM add itself afterwards (worker/lora_linear.py).
`backend="auto"` picks Triton for CUDA tensors and the torch reference otherwise.
"""

from __future__ import annotations

import numbers
import os

import torch
from torch import Tensor

from lorafleet.kernels.lora_layout import NUM_PROJS, LoRABatch, LoRALayout
from lorafleet.kernels.lora_reference import (
    lora_delta_host,
    lora_expand_reference,
    lora_shrink_reference,
    takes_host,
)

BACKENDS = ("auto", "reference", "triton")


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the kernels' dots and accumulators take


def resolve_backend(backend: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """'reference' or 'triton' for a tensor on `device` (a torch.device or its name); Triton on CPU needs TRITON_INTERPRET=1.
    `dtype`: the data's, which Triton must take (TRITON_DTYPES; float64 or float8 only on the reference, which
    'auto' then picks)."""
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":  # Triton on a GPU, for the data it takes
        backend = "triton" if device.type == "cuda" and (dtype is None or dtype in TRITON_DTYPES) else "reference"
    elif backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); use backend='reference' on CPU")
    if backend == "triton" and dtype is not None and dtype not in TRITON_DTYPES:
        raise ValueError(f"backend='triton' takes float16, bfloat16 or float32 data, got {dtype}; use backend='reference'")
    return backend


def _check_proj_ids(name: str, proj_ids: list[int]) -> None:
    if not isinstance(proj_ids, (list, tuple)) or not proj_ids or any(isinstance(p, bool) or not isinstance(p, numbers.Integral) or not 0 <= p < NUM_PROJS for p in proj_ids):
        raise ValueError(f"{name}: proj_ids must be a non-empty list of int ids in [0, {NUM_PROJS}), got {proj_ids!r}")


def _check_common(name: str, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, device: torch.device) -> None:
    """Shape, dtype and device checks only (per call: the batch's own in LoRABatch): the *values* (slots < layout.max_slots,
    seg_starts increasing and inside sorted_token_ids, token ids < T, ranks <= the layout's max_rank)
    are the caller's contract, as reading them would cost a host sync per call."""
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < layout.num_layers:
        raise ValueError(f"{name}: layer {layer!r} outside [0, {layout.num_layers}) or not an int")
    _check_proj_ids(name, proj_ids)
    if batch.max_rank > layout.max_rank:
        raise ValueError(f"{name}: batch.max_rank {batch.max_rank} exceeds the layout's max_rank {layout.max_rank}")
    # The batch's own tensors were checked once, when it was built (LoRABatch.__post_init__): one device.
    for label, t in (("layout.pool", layout.pool), ("batch.token_slots", batch.token_slots)):
        if t.device != device:
            raise ValueError(f"{name}: {label} is on {t.device}, the activations on {device}")


def _check_widths(name: str, layout: LoRALayout, proj_ids: list[int], widths: list[int], *, side: int) -> None:
    """Where the layout records its projections' widths (the adapter pool's does): each of `widths` must be
    projection proj_ids[i]'s in (side 0) or out (side 1) features."""
    if layout.widths is None:
        return
    expected = [layout.widths[p][side] for p in proj_ids]
    if list(widths) != expected:
        raise ValueError(f"{name} {list(widths)} are not the adapters' {expected} for projections {proj_ids}")


def _check_x(name: str, x: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch) -> None:
    """The checks of a shrink's input x [T, K] (and of the layout and batch it is read with)."""
    _check_common(name, layout, layer, proj_ids, batch, x.device)
    if x.dim() != 2 or x.shape[0] != batch.num_tokens or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be [T={batch.num_tokens}, K] with a contiguous last dim, got {tuple(x.shape)} strides {x.stride()}")
    _check_widths(f"{name}: x's K", layout, proj_ids, [x.shape[1]] * len(proj_ids), side=0)
    if x.dtype != layout.pool.dtype:
        raise ValueError(f"{name}: x is {x.dtype}, the adapter pool {layout.pool.dtype}; they must match")


def _check_y(name: str, y: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch,
             out_offsets: list[int]) -> list[tuple[int, int]]:
    """The checks of an expand's output y [T, N]; returns its (start, width) slices."""
    _check_common(name, layout, layer, proj_ids, batch, y.device)
    if y.dim() != 2 or y.shape[0] != batch.num_tokens or y.stride(1) != 1:
        raise ValueError(f"{name}: y must be [T={batch.num_tokens}, N] with a contiguous last dim, got {tuple(y.shape)} strides {y.stride()}")
    if y.dtype != layout.pool.dtype:
        raise ValueError(f"{name}: y is {y.dtype}, the adapter pool {layout.pool.dtype}; they must match")
    slices = output_slices(out_offsets, len(proj_ids), y.shape[1])
    _check_widths(f"{name}: the output slices' widths", layout, proj_ids, [n for _, n in slices], side=1)
    return slices


def shrink_buffer(*, x: Tensor, proj_ids: list[int], batch: LoRABatch, backend: str = "auto") -> Tensor:
    """An uninitialised float32 [S, P, T, R] output for `lora_shrink` (R = batch.max_rank, at least 1).

    S, the number of partial sums over K, suits the backend and the GPU (1 for the reference): the
    Triton shrink writes one partial sum per split with plain stores, and `lora_expand` adds them.
    x: [T, K] the shrink's input. proj_ids: list of P ints. batch: `LoRABatch` over the T tokens.
    """
    if x.dim() != 2:
        raise ValueError(f"shrink_buffer: x must be [T, K], got shape {tuple(x.shape)}")
    _check_proj_ids("shrink_buffer", proj_ids)
    splits = 1
    if resolve_backend(backend, x.device) == "triton":
        from lorafleet.kernels.lora_triton import shrink_splits

        splits = shrink_splits(k=x.shape[1], num_proj=len(proj_ids), batch=batch, device=x.device)
    return torch.empty(splits, len(proj_ids), x.shape[0], max(batch.max_rank, 1), dtype=torch.float32, device=x.device)


def _as_splits(name: str, xa: Tensor, num_proj: int, batch: LoRABatch) -> Tensor:
    """xa as [S, P, T, R] (a [P, T, R] buffer is one split), after checking it."""
    xa4 = xa.unsqueeze(0) if xa.dim() == 3 else xa
    shape = (num_proj, batch.num_tokens)
    if xa.dtype != torch.float32 or xa4.dim() != 4 or tuple(xa4.shape[1:3]) != shape or xa4.shape[0] < 1 or xa4.shape[3] < batch.max_rank or not xa.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous float32 [S, {shape[0]}, {shape[1]}, >= {batch.max_rank}] or [{shape[0]}, {shape[1]}, >= {batch.max_rank}]"
            f" (see shrink_buffer), got {xa.dtype} {tuple(xa.shape)}"
        )
    return xa4


def lora_shrink(*, x: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, out: Tensor, backend: str = "auto") -> None:
    """Project each token onto its adapter's A rows, for several projections sharing one input.

    Semantics: sum_s out[s, i, t, j] = sum_k x[t, k] * A[slot(t), layer, proj_ids[i]][j, k] for j < rank, every t with slot(t) >= 0.

    x: [T, K] model dtype (the pool's), last dim contiguous. layout: `LoRALayout` (A rows of K elements: a
    layout that records its widths refuses another K; one that does not leaves it to the caller, as a wrong K
    reads the wrong pool elements).
    layer: int. proj_ids: list of P ints in [0, 7) (ids into PROJS). batch: `LoRABatch` over the T tokens.
    out: float32 [S, P, T, R] with S >= 1 partial sums over K and R >= batch.max_rank, contiguous
    (`shrink_buffer` makes one; a [P, T, R] buffer is one split, which leaves the GPU less parallel). Entries past a slot's rank, of tokens without a slot, or of a module
    the slot does not adapt are not read by `lora_expand` and may hold anything.
    """
    _check_x("lora_shrink", x, layout, layer, proj_ids, batch)
    out = _as_splits("lora_shrink: out", out, len(proj_ids), batch)
    if out.device != x.device:
        raise ValueError(f"lora_shrink: out is on {out.device}, x on {x.device}")
    if resolve_backend(backend, x.device, x.dtype) == "triton":
        from lorafleet.kernels.lora_triton import lora_shrink_triton

        lora_shrink_triton(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, out=out)
    else:
        lora_shrink_reference(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, out=out)


def lora_xa(*, x: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, backend: str = "auto") -> Tensor:
    """`lora_shrink` into a fresh `shrink_buffer`: the float32 [S, P, T, R] partial sums that `lora_expand`
    and `lora_silu_mul` take. Arguments as `lora_shrink`.

    Semantics: sum_s xa[s, i, t, j] = sum_k x[t, k] * A[slot(t), layer, proj_ids[i]][j, k] for j < rank, every t with slot(t) >= 0.
    """
    xa = shrink_buffer(x=x, proj_ids=proj_ids, batch=batch, backend=backend)
    lora_shrink(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, out=xa, backend=backend)
    return xa


def output_slices(out_offsets: list[int], num_slices: int, width: int) -> list[tuple[int, int]]:
    """(start, width) of each output slice from P starts (the last runs to `width`) or P+1 boundaries."""
    if len(out_offsets) == num_slices:
        bounds = [*out_offsets, width]
    elif len(out_offsets) == num_slices + 1:
        bounds = list(out_offsets)
    else:
        raise ValueError(f"lora_expand: out_offsets needs {num_slices} starts or {num_slices + 1} boundaries, got {out_offsets}")
    slices = [(int(a), int(b) - int(a)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if any(start < 0 or n <= 0 or start + n > width for start, n in slices):
        raise ValueError(f"lora_expand: out_offsets {out_offsets} do not give increasing slices inside y's {width} columns")
    return slices


def lora_expand(
    *, xa: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, y: Tensor, out_offsets: list[int], backend: str = "auto",
    accumulate: bool = True,
) -> None:  # fmt: skip
    """Add each token's scaled adapter output into its slice of y, for several projections in one launch.

    Semantics: y[t, o_i:o_i+n_i] += scale[slot(t), layer, p_i] * sum_j (sum_s xa[s, i, t, j]) * B^T[slot(t), layer, p_i][j, :n_i] for j < rank.

    xa: float32 [S, P, T, R], R >= batch.max_rank: the S partial sums from `lora_shrink` ([P, T, R]: one). layout: `LoRALayout` (B^T rows of
    n_i elements). layer: int. proj_ids: list of P ints in [0, 7). batch: `LoRABatch` over the T tokens.
    y: [T, N] model dtype, last dim contiguous, updated in place (tokens without a slot untouched).
    out_offsets: P slice starts (slice i ends where i+1 starts, the last at N) or P+1 boundaries.
    accumulate=False: y[t, slices] = the delta instead (zeros where the slot does not adapt a module)
    for every token in a segment, y not read; tokens in no segment are left as they are. A prefill
    writes the delta first and lets the base GEMM add itself (`torch.addmm_`): y is then read once, by
    the GEMM's epilogue, instead of read and written again by this kernel.
    Precision: the reference keeps sum_s xa in float32; the Triton kernel on a GPU rounds it to the model dtype
    before its dot with B^T (tensor cores), as PEFT's own fp16/bf16 forward does (x @ A^T in the model dtype):
    in float16 an |xa| past 65504 is inf there.
    """
    slices = _check_y("lora_expand", y, layout, layer, proj_ids, batch, out_offsets)
    xa = _as_splits("lora_expand: xa", xa, len(proj_ids), batch)
    if xa.device != y.device:
        raise ValueError(f"lora_expand: xa is on {xa.device}, y on {y.device}")
    if not accumulate and batch.max_rank == 0:  # no slot adapts anything: the delta is zeros (the kernels launch nothing)
        # The rows of the segments only: a graph-shaped batch pads its token list past the last segment (with
        # token 0), rows the kernels leave as they are. No host read (capture-safe).
        rows = batch.sorted_token_ids.long()
        real = (torch.arange(rows.numel(), device=rows.device) < batch.seg_starts[-1]).to(torch.int32)
        hits = torch.zeros(y.shape[0], dtype=torch.int32, device=y.device).index_add_(0, rows, real)
        for start, n in slices:
            y[:, start : start + n].masked_fill_((hits > 0)[:, None], 0)
        return
    if resolve_backend(backend, y.device, layout.pool.dtype) == "triton":
        from lorafleet.kernels.lora_triton import lora_expand_triton

        lora_expand_triton(xa=xa, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_slices=slices, accumulate=accumulate)
    else:
        lora_expand_reference(xa=xa, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_slices=slices, accumulate=accumulate)


def lora_delta(
    *, x: Tensor, layout: LoRALayout, layer: int, proj_ids: list[int], batch: LoRABatch, y: Tensor, out_offsets: list[int], backend: str = "auto",
    accumulate: bool = True,
) -> None:  # fmt: skip
    """A projection group's whole LoRA delta: `lora_shrink` into a fresh buffer, then `lora_expand` into y.

    Semantics: y[t, o_i:o_i+n_i] += scale[slot(t), layer, p_i] * (x[t] @ A^T[slot(t), layer, p_i]) @ B^T[slot(t), layer, p_i] (rank columns only).

    x: [T, K] model dtype, last dim contiguous. y: [T, N] model dtype, last dim contiguous, updated in
    place (tokens without a slot untouched). layout: `LoRALayout`. layer: int. batch: `LoRABatch` over the
    T tokens. proj_ids, out_offsets, accumulate: as `lora_expand` (accumulate=False: y = the delta).
    """
    if x.device.type == "cpu" and resolve_backend(backend, x.device, x.dtype) == "reference" and takes_host(batch):
        _check_x("lora_delta", x, layout, layer, proj_ids, batch)
        slices = _check_y("lora_delta", y, layout, layer, proj_ids, batch, out_offsets)
        lora_delta_host(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_slices=slices,
                        accumulate=accumulate)
        return
    xa = lora_xa(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, backend=backend)
    lora_expand(xa=xa, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_offsets=out_offsets, backend=backend,
                accumulate=accumulate)


def lora_silu_mul(*, gate_up: Tensor, xa: Tensor, layout: LoRALayout, layer: int, batch: LoRABatch, out: Tensor, backend: str = "auto") -> None:
    """The MLP activation with the gate|up LoRA delta folded in, the delta never written to memory.

    Semantics: out[t] = silu(g[t] + dg[t]) * (u[t] + du[t]) for every token in a segment, where g, u are the two
    halves of gate_up[t] and dg, du the gate and up deltas `lora_expand` would add (zero where the slot adapts neither);
    tokens in no segment are left as they are (a caller with such tokens computes theirs itself).

    gate_up: [T, 2 * I] model dtype, contiguous (the base GEMM's output, gate columns first). xa: float32
    [S, 2, T, R], R >= batch.max_rank: `lora_shrink`'s partial sums for proj_ids [4, 5] (gate, up). out: [T, I]
    model dtype, last dim contiguous. layout: `LoRALayout` (its widths, where recorded, must give I). layer: int.
    batch: `LoRABatch` over the T tokens, ranks up to 128 on Triton. backend: "auto", "reference" or "triton".
    """
    from lorafleet.kernels.lora_act import GATE, UP, silu_mul_lora_reference, silu_mul_lora_triton

    _check_common("lora_silu_mul", layout, layer, [GATE, UP], batch, gate_up.device)
    num_tokens, inter = batch.num_tokens, out.shape[-1] if out.dim() == 2 else -1
    if gate_up.dim() != 2 or tuple(gate_up.shape) != (num_tokens, 2 * inter) or not gate_up.is_contiguous():
        raise ValueError(f"lora_silu_mul: gate_up must be contiguous [T={num_tokens}, 2 * I] and out [T, I], got {tuple(gate_up.shape)} and {tuple(out.shape)}")
    if out.shape[0] != num_tokens or out.stride(1) != 1:
        raise ValueError(f"lora_silu_mul: out must be [T={num_tokens}, I] with a contiguous last dim, got {tuple(out.shape)} strides {out.stride()}")
    _check_widths("lora_silu_mul: I", layout, [GATE, UP], [inter, inter], side=1)
    if gate_up.dtype != layout.pool.dtype or out.dtype != layout.pool.dtype:
        raise ValueError(f"lora_silu_mul: gate_up {gate_up.dtype} and out {out.dtype} must be the adapter pool's {layout.pool.dtype}")
    xa = _as_splits("lora_silu_mul: xa", xa, 2, batch)
    if out.device != gate_up.device or xa.device != gate_up.device:
        raise ValueError(f"lora_silu_mul: gate_up, xa and out must share a device, got {gate_up.device}, {xa.device}, {out.device}")
    if resolve_backend(backend, gate_up.device, gate_up.dtype) == "triton":
        if batch.max_rank > 128:
            raise ValueError(f"lora_silu_mul: the Triton backend takes ranks up to 128, the batch has {batch.max_rank}")
        silu_mul_lora_triton(gate_up=gate_up, xa=xa, layout=layout, layer=layer, batch=batch, out=out)
    else:
        silu_mul_lora_reference(gate_up=gate_up, xa=xa, layout=layout, layer=layer, batch=batch, out=out)
