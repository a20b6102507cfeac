"""Paged attention at its edges: caches NaN wherever no sequence's context lies (filled through write_kv),
q/k/v and out as strided views of fused tensors, GQA groups of 8, block sizes that are not powers of two,
and prefill chunks of one token, on block boundaries and spanning several query tiles."""

import pytest
import torch

from lorafleet.kernels.attention import paged_attention_decode, paged_attention_prefill, write_kv
from tests.kernels.kernel_cases import dense_attention, paged_caches, shuffled_tables, slot_mapping

BACKENDS = ["reference", "triton"]
TOL = {torch.float32: 1e-4, torch.float16: 4e-3}
NAN = float("nan")


def _filled_cache(lens, num_kv_heads, head_dim, block_size, dtype, backend, gen, num_pages=40):
    """NaN caches holding each sequence's random keys/values (written by write_kv) at shuffled pages.
    Returns k_cache, v_cache, block table and the per-sequence keys and values."""
    k_cache, v_cache = paged_caches(num_pages, block_size, num_kv_heads, head_dim, dtype, gen, fill=NAN)
    table = shuffled_tables(lens, block_size, num_pages, gen)
    keys = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(sum(lens), num_kv_heads, head_dim, generator=gen).to(dtype)
    write_kv(k=keys, v=values, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping(lens, table, block_size), backend=backend)
    return k_cache, v_cache, table, keys.split(lens), values.split(lens)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(8, 1, 6), (4, 4, 5), (8, 2, 16)])
def test_decode_reads_only_each_sequences_context(backend, dtype, num_heads, num_kv_heads, block_size, gen):
    """Rows past a context (the rest of its last block, other pages, junk table entries) are NaN."""
    lens = [1, 6, 29, 0, 13, 2]
    k_cache, v_cache, table, keys, values = _filled_cache(lens, num_kv_heads, 32, block_size, dtype, backend, gen)
    q = torch.randn(len(lens), num_heads, 32, generator=gen).to(dtype)
    out = torch.full_like(q, NAN)
    paged_attention_decode(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=torch.tensor(lens, dtype=torch.int32), scale=0.2,
                           out=out, backend=backend)  # fmt: skip
    assert not torch.isnan(out).any()
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))  # no context: zeros
            continue
        want = dense_attention(q[b : b + 1], keys[b], values[b], torch.tensor([n - 1]), 0.2)
        assert float((out[b : b + 1].double() - want).norm() / want.norm()) < TOL[dtype], b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(8, 1, 5), (6, 2, 8)])
def test_prefill_chunks_at_the_edges(backend, dtype, num_heads, num_kv_heads, block_size, gen):
    """A one-token prompt, a chunk ending on a block boundary, a chunk of exactly one query tile (16 under
    the interpreter) after cached context, one of 17 starting mid-block, a decode-like single token, a
    chunk whose first keys need no causal mask (context past the 32-key tile), and an empty chunk."""
    q_lens = [1, 5, 16, 17, 1, 20, 0]
    lens = [1, 2 * block_size, 19, 40, 33, 70, 4]
    k_cache, v_cache, table, keys, values = _filled_cache(lens, num_kv_heads, 32, block_size, dtype, backend, gen, num_pages=64)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, 32, generator=gen).to(dtype)
    out = torch.full_like(q, NAN)
    paged_attention_prefill(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, query_start_loc=starts,
                            context_lens=torch.tensor(lens, dtype=torch.int32), scale=0.25, out=out, backend=backend)  # fmt: skip
    assert not torch.isnan(out).any()
    for b, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
        if ql:
            rows = slice(int(starts[b]), int(starts[b + 1]))
            want = dense_attention(q[rows], keys[b], values[b], torch.arange(n - ql, n), 0.25)
            assert float((out[rows].double() - want).norm() / want.norm()) < TOL[dtype], b


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_qkv_views_and_a_strided_output(backend, gen):
    """q, k and v are column slices of one qkv GEMM output (rows strided), out a slice of a wider buffer:
    write_kv, decode and prefill follow the strides, and the buffer's other columns stay untouched."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 4
    lens = [9, 3, 14]
    k_cache, v_cache = paged_caches(24, block_size, num_kv_heads, head_dim, torch.float32, gen, fill=NAN)
    table = shuffled_tables(lens, block_size, 24, gen)
    qkv = torch.randn(sum(lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    assert not (q.is_contiguous() or k.is_contiguous())
    write_kv(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping(lens, table, block_size), backend=backend)
    keys, values = k.split(lens), v.split(lens)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    buf = torch.full((sum(lens), num_heads + 1, head_dim), NAN)
    out = buf[:, 1:]
    paged_attention_prefill(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, query_start_loc=starts, context_lens=context_lens,
                            scale=0.3, out=out, backend=backend)  # fmt: skip
    for b, n in enumerate(lens):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        want = dense_attention(q[rows], keys[b], values[b], torch.arange(n), 0.3)
        assert float((out[rows].double() - want).norm() / want.norm()) < 1e-4, b
    last = starts[1:].long() - 1  # decode: each sequence's last token as the query
    buf.fill_(NAN)
    paged_attention_decode(q=q[last], k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=context_lens, scale=0.3,
                           out=out[: len(lens)], backend=backend)  # fmt: skip
    for b, n in enumerate(lens):
        want = dense_attention(q[last[b] : last[b] + 1], keys[b], values[b], torch.tensor([n - 1]), 0.3)
        assert float((out[b : b + 1].double() - want).norm() / want.norm()) < 1e-4, b
    assert torch.isnan(buf[:, 0]).all() and torch.isnan(buf[len(lens) :]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_with_odd_heads_and_head_dim(backend, dtype, gen):
    """3 KV heads of 48 (neither a power of two), block size 5, k/v rows strided, padding slots (-1):
    exactly the mapped rows change."""
    k_cache, v_cache = paged_caches(7, 5, 3, 48, dtype, gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(6, 2, 3, 48, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([34, -1, 0, 12, -1, 4], dtype=torch.int64)
    write_kv(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, backend=backend)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            before_k[s // 5, s % 5], before_v[s // 5, s % 5] = k[t], v[t]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
