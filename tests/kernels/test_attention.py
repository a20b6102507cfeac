"""Paged attention (write_kv, decode, chunked prefill) against dense attention, on every backend.

Caches are strided views of a unified page pool ([P, L, 2, bs, Hkv, D] per page), block tables are
shuffled pages, GQA groups of 1-4, outputs poisoned before each run.
"""

import math

import pytest
import torch

from lorafleet.kernels.attention import paged_attention_decode, paged_attention_prefill, write_kv

BACKENDS = ["reference", "triton"]
TOL = {torch.float32: 1e-4, torch.float16: 4e-3}


def _caches(num_pages, block_size, num_kv_heads, head_dim, dtype, gen, layer=1):
    """k/v caches as non-contiguous views of a pool page [num_layers=3, 2, bs, Hkv, D], filled with noise."""
    pool = torch.randn(num_pages, 3 * 2 * block_size * num_kv_heads * head_dim, generator=gen).to(dtype)
    view = pool.view(num_pages, 3, 2, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = view[:, layer, 0], view[:, layer, 1]
    assert not k_cache.is_contiguous()
    return k_cache, v_cache


def _tables(lens, block_size, num_pages, gen):
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    pages = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), max_blocks), num_pages + 7, dtype=torch.int32)  # junk past the end
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        table[b, :nb] = pages[used : used + nb].to(torch.int32)
        used += nb
    return table


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
    table = _tables(lens, block_size, num_pages, gen)
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
    table = _tables(lens, block_size, num_pages, gen)
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
    table = _tables(lens, block_size, num_pages, gen)
    q = torch.randn(len(lens), 4, 32, generator=gen)
    out = torch.full_like(q, float("nan"))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    paged_attention_decode_triton(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=context_lens, scale=0.2, out=out, num_splits=num_splits)
    want = torch.full_like(q, float("nan"))
    paged_attention_decode(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=context_lens, scale=0.2, out=want, backend="reference")
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no context: zeros, not NaN
    assert _rel(out, want.double()) < 1e-5


def test_attention_refuses_bad_inputs(gen):
    k_cache, v_cache = _caches(4, 4, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16)
    ok = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=torch.zeros(2, 3, dtype=torch.int32), context_lens=torch.ones(2, dtype=torch.int32), scale=1.0, out=torch.empty_like(q))
    paged_attention_decode(**ok)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(**{**ok, "q": torch.randn(2, 3, 16), "out": torch.empty(2, 3, 16)})
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode(**{**ok, "block_tables": torch.zeros(2, 3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="must match"):
        paged_attention_decode(**{**ok, "q": q.half(), "out": q.half()})
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k=torch.zeros(3, 2, 16), v=torch.zeros(3, 2, 16), k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.zeros(3, dtype=torch.int32))



@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_refuses_strided_index_tensors_and_odd_scales(backend, gen):
    # The Triton kernels step along these with stride 1: a strided view gave wrong rows (decode, write_kv)
    # or corrupted memory (prefill's query_start_loc) instead of an error.
    k_cache, v_cache = _caches(4, 4, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16)
    tables = torch.zeros(3, 2, dtype=torch.int32).t()  # [2, 3], stride (1, 2)
    lens = torch.ones(4, dtype=torch.int32)[::2]
    ok = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=torch.zeros(2, 3, dtype=torch.int32), context_lens=torch.ones(2, dtype=torch.int32),
              scale=1.0, out=torch.empty_like(q), backend=backend)  # fmt: skip
    with pytest.raises(ValueError, match="block_tables must be int32 .* contiguous last dim"):
        paged_attention_decode(**{**ok, "block_tables": tables})
    with pytest.raises(ValueError, match="context_lens must be contiguous"):
        paged_attention_decode(**{**ok, "context_lens": lens})
    with pytest.raises(ValueError, match="scale must be a Python float"):
        paged_attention_decode(**{**ok, "scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="floating dtype"):
        paged_attention_decode(**{**ok, "q": q.int(), "out": q.int(), "k_cache": k_cache.int(), "v_cache": v_cache.int()})
    qsl = torch.tensor([0, 9, 1, 9, 2, 9], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="query_start_loc must be contiguous"):
        paged_attention_prefill(**{**ok, "query_start_loc": qsl})
    kv = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        write_kv(k=kv, v=kv, k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.zeros(6, dtype=torch.int64)[::2], backend=backend)
    with pytest.raises(ValueError, match="k is on meta"):
        write_kv(k=kv.to("meta"), v=kv, k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.zeros(3, dtype=torch.int64), backend=backend)

@pytest.mark.gpu
def test_llama3_8b_shapes_in_bf16_on_gpu(gen):
    """Decode (batch 16, contexts up to 2048) and chunked prefill at 32 q heads / 8 KV heads of 128, bf16."""
    block_size, num_pages = 16, 1024
    pool = torch.randn(num_pages, 2 * 2 * block_size * 8 * 128, generator=gen).to(torch.bfloat16).cuda()
    view = pool.view(num_pages, 2, 2, block_size, 8, 128)
    k_cache, v_cache = view[:, 1, 0], view[:, 1, 1]
    lens = torch.randint(1, 2049, (16,), generator=gen).tolist()
    lens[0] = 2048
    table = _tables(lens, block_size, num_pages * 2, gen) % num_pages  # pages may repeat: fine for reads
    table = table.cuda()
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(16, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    outs = {}
    for backend in ("reference", "triton"):
        outs[backend] = torch.full_like(q, float("nan"))
        paged_attention_decode(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=context_lens, scale=128**-0.5, out=outs[backend], backend=backend)
    assert _rel(outs["triton"].float(), outs["reference"].double()) < 1e-2

    q_lens = [512, 100, 1, 300]
    ctx = [512, 1000, 2000, 700]
    table = _tables(ctx, block_size, num_pages, gen).cuda()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    for backend in ("reference", "triton"):
        outs[backend] = torch.full_like(q, float("nan"))
        paged_attention_prefill(
            q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, query_start_loc=starts,
            context_lens=torch.tensor(ctx, dtype=torch.int32, device="cuda"), scale=128**-0.5, out=outs[backend], backend=backend,
        )  # fmt: skip
    assert _rel(outs["triton"].float(), outs["reference"].double()) < 1e-2
