"""Public paged-attention entry points: KV write, decode and (chunked) prefill, reference or Triton.

Caches are `[num_pages, block_size, num_kv_heads, head_dim]` tensors of any strides (one layer's view
of the unified page pool); a token at position n of sequence b lives in page
block_tables[b, n // block_size] at row n % block_size. GQA: query head h reads KV head h // G.

The launchers check shapes, dtypes, strides and devices only. Index *values* are the caller's contract
(checking them would cost a host sync per call): block_tables entries < num_pages for every block a
sequence's context_lens covers, 0 <= context_lens[b] <= max_blocks * block_size, query_start_loc
non-decreasing from 0 to T with context_lens[b] >= its q_len, slot_mapping < num_pages * block_size.
The Triton kernels do not bounds-check them: a value outside these ranges reads or writes out of bounds.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from lorafleet.kernels.attention_reference import (
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
    write_kv_reference,
)
from lorafleet.kernels.lora import resolve_backend


def _check_caches(name: str, k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache and v_cache must both be [num_pages, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError(f"{name}: k_cache and v_cache must share dtype and device")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{name}: the caches' head_dim must be contiguous (stride 1)")


def _check_queries(name: str, q: Tensor, out: Tensor, k_cache: Tensor, block_tables: Tensor, context_lens: Tensor, num_seqs: int) -> None:
    _check_caches(name, k_cache, k_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"{name}: q must be [*, Hq, {head_dim}] with Hq a multiple of {num_kv_heads} KV heads, got {tuple(q.shape)}")
    if q.stride(2) != 1:
        raise ValueError(f"{name}: q's head_dim must be contiguous")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"{name}: out must be {q.dtype} {tuple(q.shape)} with a contiguous head_dim, got {out.dtype} {tuple(out.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"{name}: q is {q.dtype}, the cache {k_cache.dtype}; they must match")
    if not q.dtype.is_floating_point:
        raise ValueError(f"{name}: q and the caches must be a floating dtype, got {q.dtype}")
    # The kernels step along a table row and along context_lens with stride 1.
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables must be int32 [{num_seqs}, max_blocks] with a contiguous last dim, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)} strides {block_tables.stride()}")  # fmt: skip
    if context_lens.shape != (num_seqs,) or context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        raise ValueError(f"{name}: context_lens must be contiguous int32 [{num_seqs}], got {context_lens.dtype} {tuple(context_lens.shape)} strides {context_lens.stride()}")
    for label, t in (("out", out), ("k_cache", k_cache), ("block_tables", block_tables), ("context_lens", context_lens)):
        if t.device != q.device:
            raise ValueError(f"{name}: {label} is on {t.device}, q on {q.device}")


def _check_scale(name: str, scale: float) -> float:
    """`scale` as a Python float (a NumPy scalar or a Fraction is a real number too, which Triton cannot take)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{name}: scale must be a Python float, got {type(scale).__name__}")
    return float(scale)


def write_kv(*, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, backend: str = "auto") -> None:
    """Store the step's keys and values in their cache rows.

    Semantics: k_cache[s // bs, s % bs] = k[t], v_cache[s // bs, s % bs] = v[t] for s = slot_mapping[t] >= 0.

    k, v: [T, Hkv, D] cache dtype, head_dim contiguous. k_cache, v_cache: [P, bs, Hkv, D], any strides,
    head_dim contiguous. slot_mapping: int64 [T], page_id * bs + offset; -1 (padding) writes nothing.
    """
    _check_caches("write_kv", k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"write_kv: k and v must be [T, {k_cache.shape[2]}, {k_cache.shape[3]}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ValueError(f"write_kv: k/v are {k.dtype}/{v.dtype}, the cache {k_cache.dtype}; they must match")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("write_kv: k and v need a contiguous head_dim")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError(f"write_kv: slot_mapping must be contiguous int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)} strides {slot_mapping.stride()}")
    for label, t in (("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if t.device != k_cache.device:
            raise ValueError(f"write_kv: {label} is on {t.device}, the caches on {k_cache.device}")
    if resolve_backend(backend, k.device, k.dtype) == "triton":
        from lorafleet.kernels.attention_triton import write_kv_triton

        write_kv_triton(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    else:
        write_kv_reference(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def paged_attention_decode(
    *, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float, out: Tensor, backend: str = "auto"
) -> None:
    """One query token per sequence over its paged context (the new token's K/V already written).

    Semantics: out[b, h] = softmax_n(scale * q[b, h] . K[b, n, h // G]) @ V[b, :, h // G] over n < context_lens[b].

    q: [B, Hq, D] cache dtype, head_dim contiguous. k_cache, v_cache: [P, bs, Hkv, D], any strides.
    block_tables: int32 [B, max_blocks]. context_lens: int32 [B] (0 gives a zero row). scale: float.
    out: [B, Hq, D] like q.
    """
    _check_caches("paged_attention_decode", k_cache, v_cache)
    _check_queries("paged_attention_decode", q, out, k_cache, block_tables, context_lens, q.shape[0])
    scale = _check_scale("paged_attention_decode", scale)
    if resolve_backend(backend, q.device, q.dtype) == "triton":
        from lorafleet.kernels.attention_triton import paged_attention_decode_triton

        paged_attention_decode_triton(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens, scale=scale, out=out)
    else:
        paged_attention_decode_reference(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens, scale=scale, out=out)


def paged_attention_prefill(
    *,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor,
    backend: str = "auto",
) -> None:
    """Causal attention of many sequences' new query tokens over their paged context (chunked prefill).

    Semantics: out[t, h] = softmax_n(scale * q[t, h] . K[b, n, h // G]) @ V[b, :, h // G] over n <= pos(t),
    pos(t) = context_lens[b] - q_len_b + (t - query_start_loc[b]) for the sequence b holding token t.

    q: [T, Hq, D] cache dtype, head_dim contiguous; the new tokens' K/V already written to the cache.
    k_cache, v_cache: [P, bs, Hkv, D], any strides. block_tables: int32 [B, max_blocks].
    query_start_loc: int32 [B+1], q rows of sequence b are query_start_loc[b]:query_start_loc[b+1].
    context_lens: int32 [B], total tokens in the cache per sequence (>= its q_len). scale: float.
    out: [T, Hq, D] like q.
    """
    if context_lens.dim() != 1:  # it sizes the batch: B = context_lens.shape[0]
        raise ValueError(f"paged_attention_prefill: context_lens must be int32 [B], got shape {tuple(context_lens.shape)}")
    num_seqs = context_lens.shape[0]
    _check_caches("paged_attention_prefill", k_cache, v_cache)
    _check_queries("paged_attention_prefill", q, out, k_cache, block_tables, context_lens, num_seqs)
    scale = _check_scale("paged_attention_prefill", scale)
    qsl = query_start_loc
    if qsl.shape != (num_seqs + 1,) or qsl.dtype != torch.int32 or qsl.device != q.device or not qsl.is_contiguous():
        raise ValueError(f"paged_attention_prefill: query_start_loc must be contiguous int32 [{num_seqs + 1}] on {q.device}, "
                         f"got {qsl.dtype} {tuple(qsl.shape)} strides {qsl.stride()} on {qsl.device}")  # fmt: skip
    if resolve_backend(backend, q.device, q.dtype) == "triton":
        from lorafleet.kernels.attention_triton import paged_attention_prefill_triton

        paged_attention_prefill_triton(
            q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, query_start_loc=query_start_loc, context_lens=context_lens, scale=scale, out=out
        )
    else:
        paged_attention_prefill_reference(
            q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, query_start_loc=query_start_loc, context_lens=context_lens, scale=scale, out=out
        )
