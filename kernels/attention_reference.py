"""Plain-torch paged attention: KV write, decode and (chunked) prefill over a paged, strided cache.

The reference backend of `kernels.attention` and the baseline the Triton kernels are tested against.
Math in float32; caches are `[num_pages, block_size, num_kv_heads, head_dim]` views of any strides.
"""

from __future__ import annotations

import torch
from torch import Tensor


def write_kv_reference(*, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k_cache[s // bs, s % bs] = k[t] (same for v) for every t with s = slot_mapping[t] >= 0."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, offs = slots // block_size, slots % block_size
    k_cache[pages, offs] = k[keep].to(k_cache.dtype)
    v_cache[pages, offs] = v[keep].to(v_cache.dtype)


def _gather_context(cache: Tensor, block_table: Tensor, num_tokens: int) -> Tensor:
    """The first num_tokens cache rows of one sequence (or of a batch, block_table [B, nb]) in order."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    pages = block_table[..., :num_blocks].long().clamp(0, cache.shape[0] - 1)
    rows = cache[pages]  # [..., nb, bs, Hkv, D]
    rows = rows.reshape(*rows.shape[:-4], num_blocks * block_size, *rows.shape[-2:])
    return rows[..., :num_tokens, :, :]


def paged_attention_decode_reference(
    *, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float, out: Tensor
) -> None:
    """out[b, h] = softmax(scale * q[b, h] . K_b[:len_b, h // G]) @ V_b[:len_b, h // G]; zero where len_b == 0."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    longest = int(context_lens.max()) if num_seqs else 0
    if longest == 0:
        out.zero_()
        return
    live = torch.arange(longest, device=q.device)[None, :] < context_lens[:, None].long()  # [B, N]
    keys = _gather_context(k_cache, block_tables, longest).float()  # [B, N, Hkv, D]
    # Rows past a sequence's own context (the rest of its last block, junk table entries) are any other
    # page's data, NaN or inf included: a zero weight times them is still NaN, so they become zeros.
    values = _gather_context(v_cache, block_tables, longest).float().masked_fill(~live[:, :, None, None], 0.0)
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, keys) * scale  # [B, Hkv, G, N]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no context -> 0
    res = torch.einsum("bhgn,bnhd->bhgd", probs, values)
    out.copy_(res.reshape(num_seqs, num_heads, head_dim).to(out.dtype))


def paged_attention_prefill_reference(
    *, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor, context_lens: Tensor, scale: float, out: Tensor
) -> None:
    """Causal attention of each sequence's new queries over its whole cached context (new tokens included).

    Query j of sequence b (q_len_b queries) sits at position len_b - q_len_b + j and sees keys 0..that position.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for b, length in enumerate(lens):  # prefill batches hold few sequences; one SDPA-sized step each
        q_len = starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        keys = _gather_context(k_cache, block_tables[b], length).float()  # [N, Hkv, D]
        values = _gather_context(v_cache, block_tables[b], length).float()
        qb = q[starts[b] : starts[b + 1]].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,nhd->hgqn", qb, keys) * scale  # [Hkv, G, q, N]
        q_pos = torch.arange(length - q_len, length, device=q.device)
        causal = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # [q, N]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        res = torch.einsum("hgqn,nhd->qhgd", probs, values)
        out[starts[b] : starts[b + 1]] = res.reshape(q_len, num_heads, head_dim).to(out.dtype)
