"""Paged attention (write_kv, decode, chunked prefill) against dense attention, on every backend.

Caches are strided views of a unified page pool ([P, L, 2, bs, Hkv, D] per page), block tables are
shuffled pages, GQA groups of 1-4, outputs poisoned before each run.
"""

import math

import pytest
import torch

from lorafleet.kernels.attention import paged_attention_decode, paged_attention_prefill, write_kv
from tests.kernels.kernel_cases import shuffled_tables

BACKENDS = ["reference", "triton"]
TOL = {torch.float32: 1e-4, torch.float16: 4e-3}


def _caches(num_pages, block_size, num_kv_heads, head_dim, dtype, gen, layer=1):
    """k/v caches as non-contiguous views of a pool page [num_layers=3, 2, bs, Hkv, D], filled with noise."""
    pool = torch.randn(num_pages, 3 * 2 * block_size * num_kv_heads * head_dim, generator=gen).to(dtype)
    view = pool.view(num_pages, 3, 2, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = view[:, layer, 0], view[:, layer, 1]
    assert not k_cache.is_contiguous()
    return k_cache, v_cache


def _dense(q, keys, values, q_pos, scale):
    """float64 causal attention of q [n, Hq, D] at positions q_pos over keys/values [N, Hkv, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,nhd->hqn", q.double(), k) * scale
    mask = torch.arange(keys.shape[0])[None, :] <= q_pos[:, None]
    return torch.einsum("hqn,nhd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)


def _rel(got, want):
    assert not torch.isnan(got).any()
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_puts_rows_where_the_slots_say(backend, dtype, gen):
    k_cache, v_cache = _caches(9, 4, 2, 16, dtype, gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 0, 35, 17], dtype=torch.int64)
    k = torch.randn(5, 2, 16, generator=gen).to(dtype)
    v = torch.randn(5, 2, 16, generator=gen).to(dtype)
    write_kv(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, backend=backend)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // 4, s % 4], k[t]) and torch.equal(v_cache[s // 4, s % 4], v[t])
            before_k[s // 4, s % 4], before_v[s // 4, s % 4] = k[t], v[t]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)  # nothing else written, -1 skipped


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 8), (8, 2, 16), (6, 2, 4)])
def test_decode_matches_dense(backend, dtype, num_heads, num_kv_heads, block_size, gen):
    head_dim, num_pages = 32, 64
    lens = [1, 37, block_size, 100, 5]
    k_cache, v_cache = _caches(num_pages, block_size, num_kv_heads, head_dim, dtype, gen)
    table = shuffled_tables(lens, block_size, num_pages, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    paged_attention_decode(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=torch.tensor(lens, dtype=torch.int32), scale=scale, out=out, backend=backend
    )
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        keys = k_cache[table[b].long()[pos // block_size], pos % block_size]
        values = v_cache[table[b].long()[pos // block_size], pos % block_size]
        want = _dense(q[b : b + 1], keys, values, torch.tensor([n - 1]), scale)
        assert _rel(out[b : b + 1], want) < TOL[dtype], b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 8), (8, 2, 16)])
def test_chunked_prefill_matches_dense(backend, dtype, num_heads, num_kv_heads, block_size, gen):
    """Sequences with fresh prompts, chunks after cached context, single decode tokens, and empty chunks."""
    head_dim, num_pages = 32, 64
    q_lens = [20, 7, 1, 0, 33]
    lens = [20, 50, 9, 12, 33 + 2 * block_size + 3]
    k_cache, v_cache = _caches(num_pages, block_size, num_kv_heads, head_dim, dtype, gen)
    table = shuffled_tables(lens, block_size, num_pages, gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = 0.3
    paged_attention_prefill(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=table,
        query_start_loc=starts,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        scale=scale,
        out=out,
        backend=backend,
    )
    for b, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
        if ql == 0:
            continue
        pos = torch.arange(n)
        keys = k_cache[table[b].long()[pos // block_size], pos % block_size]
        values = v_cache[table[b].long()[pos // block_size], pos % block_size]
        rows = slice(int(starts[b]), int(starts[b + 1]))
        want = _dense(q[rows], keys, values, torch.arange(n - ql, n), scale)
        assert _rel(out[rows], want) < TOL[dtype], b


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_context_splits_merge_exactly(num_splits, gen):
    """Flash-decoding splits, including splits past a short context and an empty context."""
    from lorafleet.kernels.attention_triton import paged_attention_decode_triton

    block_size, num_pages = 8, 48
    lens = [0, 3, 90, 41]
    k_cache, v_cache = _caches(num_pages, block_size, 2, 32, torch.float32, gen)
    table = shuffled_tables(lens, block_size, num_pages, gen)
    q = torch.randn(len(lens), 4, 32, generator=gen)
    out = torch.full_like(q, float("nan"))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    paged_attention_decode_triton(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=context_lens, scale=0.2, out=out, num_splits=num_splits)
    want = torch.full_like(q, float("nan"))
    paged_attention_decode(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=context_lens, scale=0.2, out=want, backend="reference")
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no context: zeros, not NaN
    assert _rel(out, want.double()) < 1e-5
