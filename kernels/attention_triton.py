"""Triton paged attention: KV write, decode (GQA, block tables, split context) and chunked prefill.

Caches are `[num_pages, block_size, num_kv_heads, head_dim]` views of any strides (a layer's slice of
the unified page pool); every address goes through the block table and the cache's strides. Decode
runs one program per (sequence, KV head, context split) and loads each K/V row once for the whole
query-head group; splits are merged by a second small kernel (flash-decoding). Prefill runs one
program per (query block, query head, sequence) with online softmax over the causal context.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch,
    block_size, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    t = t.to(tl.int64)  # row offsets past 2**31 elements (a long prefill's K/V): no int32 wrap
    if slot < 0:
        return
    page = slot // block_size
    row = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(kc_ptr + page * stride_kcp + row * stride_kco + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(vc_ptr + page * stride_vcp + row * stride_vco + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


@triton.jit
def _load_kv(
    kc_ptr, vc_ptr, tables_ptr, b, stride_tb, kv_head, offs_n, n_mask, offs_d, d_mask,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch, PAGE: tl.constexpr,
):  # fmt: skip
    """K and V [BLOCK_N, BLOCK_D] of sequence b's keys offs_n, through its block table (masked rows: 0)."""
    page = tl.load(tables_ptr + b * stride_tb + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    row = offs_n % PAGE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kc_ptr + page[:, None] * stride_kcp + row[:, None] * stride_kco + kv_head * stride_kch + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(vc_ptr + page[:, None] * stride_vcp + row[:, None] * stride_vco + kv_head * stride_vch + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, tables_ptr, lens_ptr,
    part_acc_ptr, part_ml_ptr,  # float32 [B, Hq, SPLITS, D] and [B, Hq, SPLITS, 2] (max, sum)
    scale,
    stride_qb, stride_qh,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch,
    stride_tb, num_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program per (sequence b, KV head, context split): the GROUP query heads sharing that KV head
    against the split's pages of the sequence's block table. q [B, Hq, D]; kc, vc [pages, PAGE, Hkv, D]
    (strides per page, offset, head); tables int32 [B, max_pages]; lens int32 [B]. Writes the split's
    unnormalised output and (max, sum) for the merge kernel. Meaning: kernels/attention.py."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    # Each sequence's own context is cut into SPLITS ranges (whole BLOCK_N tiles): a short context in a
    # batch of long ones, or in a CUDA graph sized for the longest, still spreads over the splits.
    tokens_per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, length)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    arange_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + arange_n
        n_mask = offs_n < hi
        k, v = _load_kv(kc_ptr, vc_ptr, tables_ptr, b, stride_tb, kv_head, offs_n, n_mask, offs_d, d_mask,
                        stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch, PAGE)
        if UPCAST:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    base = (b.to(tl.int64) * num_heads + heads) * SPLITS + split
    tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_ml_ptr + base * 2, m_i, mask=g_mask)
    tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < SPLITS
    d_mask = offs_d < HEAD_DIM
    base = (b.to(tl.int64) * num_heads + h) * SPLITS + offs_s
    m = tl.load(part_ml_ptr + base * 2, mask=s_mask, other=float("-inf"))
    den = tl.load(part_ml_ptr + base * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_all = tl.max(m, 0)
    # Splits past the context (max -inf) and an empty context (all -inf) weigh 0; no inf - inf anywhere.
    live = m > float("-inf")
    m_all = tl.where(m_all > float("-inf"), m_all, 0.0)
    w = tl.where(live, tl.exp(tl.where(live, m, m_all) - m_all), 0.0)
    total = tl.sum(w * den, 0)
    res = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, tables_ptr, qsl_ptr, lens_ptr, out_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch,
    stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One program per (BLOCK_M query rows, query head, sequence b): causal attention of the sequence's new
    queries over its cached context and itself, read through its block table. q, out [T, Hq, D] (the
    sequences' queries packed, qsl int32 [B+1] their starts); kc, vc [pages, PAGE, Hkv, D]; tables int32
    [B, max_pages]; lens int32 [B] (context + new tokens). Meaning: kernels/attention.py."""
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if m0 >= q_len:
        return
    length = tl.load(lens_ptr + b)
    kv_head = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = length - q_len + offs_m  # absolute position of each query row
    rows = (q_start + offs_m).to(tl.int64)  # offsets past 2**31 elements (a step of >500k tokens): no int32 wrap
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    hi = tl.minimum(length - q_len + m0 + BLOCK_M, length)  # keys past the block's last query are masked anyway
    # Keys up to the block's first query position are visible to every row: those blocks need no mask.
    full = tl.minimum((length - q_len + m0 + 1) // BLOCK_N * BLOCK_N, hi)
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, n0, hi, q_pos, b, kv_head, kc_ptr, vc_ptr, tables_ptr, stride_tb,
            stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch, qk_scale, offs_d, d_mask,
            PAGE, BLOCK_N, False, UPCAST,
        )  # fmt: skip
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, n0, hi, q_pos, b, kv_head, kc_ptr, vc_ptr, tables_ptr, stride_tb,
            stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch, qk_scale, offs_d, d_mask,
            PAGE, BLOCK_N, True, UPCAST,
        )  # fmt: skip
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], res.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, n0, hi, q_pos, b, kv_head, kc_ptr, vc_ptr, tables_ptr, stride_tb,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch, qk_scale, offs_d, d_mask,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys n0..n0+BLOCK_N (base-2 running max m_i and sum l_i)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    k, v = _load_kv(kc_ptr, vc_ptr, tables_ptr, b, stride_tb, kv_head, offs_n, n_mask, offs_d, d_mask,
                    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch, PAGE)
    if UPCAST:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a padded query row may see no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


def _upcast(dtype: torch.dtype) -> bool:
    return _INTERPRET or dtype == torch.float32


@functools.lru_cache(maxsize=8)
def _num_sms(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4


def write_kv_triton(*, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Triton backend of `kernels.attention.write_kv` (inputs checked there).

    Semantics: k_cache[s // bs, s % bs] = k[t], v_cache[s // bs, s % bs] = v[t] for s = slot_mapping[t] >= 0.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def paged_attention_decode_triton(
    *,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> None:
    """Triton backend of `kernels.attention.paged_attention_decode` (inputs checked there).

    Semantics: out[b, h] = softmax_n(scale * q[b, h] . K[b, n, h // G]) @ V[b, :, h // G] over n < context_lens[b].

    num_splits: context splits per (sequence, KV head), merged afterwards; each sequence's own context
    is cut evenly among them in the kernel (default: enough programs to fill the GPU, at most one split
    per 256 tokens of the longest context the block tables can hold). block_n, num_warps, num_stages:
    context rows per step, warps and pipeline depth (benchmark sweeps).
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * page
    block_n = block_n or (32 if _INTERPRET else 64)
    if num_splits is None:
        want = triton.cdiv(2 * _num_sms(str(q.device)), num_seqs * num_kv_heads)
        num_splits = max(1, min(want, triton.cdiv(max_context, 256), 16))
    part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_acc, part_ml, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), num_heads,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=_dot_width(head_dim),
        PAGE=page, BLOCK_N=block_n, SPLITS=num_splits, UPCAST=_upcast(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_acc, part_ml, out, out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
    )  # fmt: skip


def paged_attention_prefill_triton(
    *,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> None:
    """Triton backend of `kernels.attention.paged_attention_prefill` (inputs checked there).

    Semantics: out[t, h] = softmax_n(scale * q[t, h] . K[b, n, h // G]) @ V[b, :, h // G] over n <= pos(t).

    The grid covers every sequence with as many query blocks as the whole batch has tokens (no host
    sync for the longest chunk); blocks past a sequence's chunk return at once. block_m, block_n,
    num_warps, num_stages: query rows and key rows per step, warps, pipeline depth (benchmark sweeps).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    if num_seqs > 65535:  # a CUDA grid's third axis
        raise ValueError(f"paged_attention_prefill: the Triton kernel takes at most 65535 sequences a launch, got {num_seqs}")
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_m = block_m or (16 if _INTERPRET else 128)
    block_n = block_n or 32
    num_warps = num_warps or (4 if _INTERPRET else 8)
    _prefill_kernel[(triton.cdiv(num_tokens, block_m), num_heads, num_seqs)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=_dot_width(head_dim), PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_upcast(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def _dot_width(head_dim: int) -> int:
    """The head dimension's block where it is a `tl.dot` operand: a power of two, at least 16 (the smallest K
    a GPU's dot takes for 16-bit operands); the lanes past head_dim are masked."""
    return max(16, triton.next_power_of_2(head_dim))
