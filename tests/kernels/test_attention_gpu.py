"""Paged attention on the GPU (gpu marker): Triton against the torch reference on the same device at
Llama-3-8B's attention shapes (32 query heads of 128, KV heads 32, 8 or 4: GQA 1, 4, 8) in bf16, block
size 16, contexts not multiples of it: relative error within bf16 tolerance, never NaN."""

import pytest
import torch

from lorafleet.kernels.attention import paged_attention_decode, paged_attention_prefill, write_kv
from tests.kernels.kernel_cases import paged_caches, shuffled_tables, slot_mapping


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return float((got.double() - want.double()).norm() / want.double().norm())


def _triton_vs_reference(attention, q: torch.Tensor, **kw) -> float:
    """`attention` (decode or prefill) on each backend into a NaN-poisoned output: Triton's relative error."""
    outs = {}
    for backend in ("reference", "triton"):
        outs[backend] = torch.full_like(q, float("nan"))
        attention(q=q, out=outs[backend], backend=backend, **kw)
    return _rel(outs["triton"], outs["reference"])


@pytest.mark.gpu
def test_llama3_8b_shapes_in_bf16_on_gpu(gen):
    """Decode (batch 16, contexts up to 2048) and chunked prefill at 32 q heads / 8 KV heads of 128, bf16."""
    block_size, num_pages = 16, 1024
    pool = torch.randn(num_pages, 2 * 2 * block_size * 8 * 128, generator=gen).to(torch.bfloat16).cuda()
    view = pool.view(num_pages, 2, 2, block_size, 8, 128)
    k_cache, v_cache = view[:, 1, 0], view[:, 1, 1]
    lens = torch.randint(1, 2049, (16,), generator=gen).tolist()
    lens[0] = 2048
    table = shuffled_tables(lens, block_size, num_pages * 2, gen) % num_pages  # pages may repeat: fine for reads
    table = table.cuda()
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(16, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    outs = {}
    for backend in ("reference", "triton"):
        outs[backend] = torch.full_like(q, float("nan"))
        paged_attention_decode(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, context_lens=context_lens, scale=128**-0.5, out=outs[backend], backend=backend)
    assert _rel(outs["triton"], outs["reference"]) < 1e-2

    q_lens = [512, 100, 1, 300]
    ctx = [512, 1000, 2000, 700]
    table = shuffled_tables(ctx, block_size, num_pages, gen).cuda()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 32, 128, generator=gen).to(torch.bfloat16).cuda()
    for backend in ("reference", "triton"):
        outs[backend] = torch.full_like(q, float("nan"))
        paged_attention_prefill(
            q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table, query_start_loc=starts,
            context_lens=torch.tensor(ctx, dtype=torch.int32, device="cuda"), scale=128**-0.5, out=outs[backend], backend=backend,
        )  # fmt: skip
    assert _rel(outs["triton"], outs["reference"]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_heads", [32, 8, 4])
@pytest.mark.parametrize("num_seqs", [1, 16, 128])
def test_gqa_ratios_over_written_contexts_in_bf16_on_gpu(num_kv_heads, num_seqs, gen):
    """Caches NaN except the contexts write_kv (Triton) stores at shuffled pages: write_kv puts exactly those
    rows; decode (1 sequence: 16 context splits; 128: one) and chunked prefill (a whole prompt, a decode
    token, chunks after cached context) read nothing else and match the reference."""
    block_size, head_dim = 16, 128
    lens = torch.randint(1, 1025 if num_seqs > 16 else 2049, (num_seqs,), generator=gen).tolist()
    lens[0] = 2047 if num_seqs <= 16 else 1023
    num_pages = sum(-(-n // block_size) for n in lens) + 8
    k_cache, v_cache = paged_caches(num_pages, block_size, num_kv_heads, head_dim, torch.bfloat16, gen, fill=float("nan"), device="cuda")
    table = shuffled_tables(lens, block_size, num_pages, gen).cuda()
    cuda_gen = torch.Generator(device="cuda")
    cuda_gen.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    keys = torch.randn(sum(lens), num_kv_heads, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
    values = torch.randn(sum(lens), num_kv_heads, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
    slots = slot_mapping(lens, table.cpu(), block_size).cuda()
    write_kv(k=keys, v=values, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, backend="triton")
    assert torch.equal(k_cache[slots // block_size, slots % block_size], keys) and torch.equal(v_cache[slots // block_size, slots % block_size], values)
    assert int((~torch.isnan(k_cache)).sum()) == keys.numel() and int((~torch.isnan(v_cache)).sum()) == values.numel()

    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(num_seqs, 32, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
    assert _triton_vs_reference(paged_attention_decode, q, k_cache=k_cache, v_cache=v_cache, block_tables=table,
                                context_lens=context_lens, scale=head_dim**-0.5) < 1e-2  # fmt: skip

    seqs = min(num_seqs, 6)  # a prefill step holds a few sequences: sequence 0 its whole prompt, 1 a decode token, others a chunk
    q_lens = [min(lens[b], (lens[b], 1, 200, 77, 300, 513)[b]) for b in range(seqs)]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 32, head_dim, generator=cuda_gen, device="cuda").to(torch.bfloat16)
    assert _triton_vs_reference(paged_attention_prefill, q, k_cache=k_cache, v_cache=v_cache, block_tables=table[:seqs].contiguous(),
                                query_start_loc=starts, context_lens=context_lens[:seqs].contiguous(), scale=head_dim**-0.5) < 1e-2  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [8, 12, 24, 64])
def test_small_and_odd_head_dims_compile_and_match_on_gpu(head_dim, gen):
    """Head dims under 16 or not a power of two pad the dot to a width tl.dot takes on the GPU (at least
    16): decode and prefill compile and match the reference in fp16 and bf16."""
    _decode_and_prefill_match(head_dim, (torch.float16, torch.bfloat16), gen)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_wide_heads_compile_and_match_in_every_model_dtype_on_gpu(head_dim, gen):
    """float32 is a model dtype too: at head dim 256 its K and V tiles are twice bf16's, so the kernels' tiles
    and pipeline depth must still fit the GPU's shared memory (decode and prefill compile and match)."""
    _decode_and_prefill_match(head_dim, (torch.float32, torch.bfloat16), gen)


def _decode_and_prefill_match(head_dim: int, dtypes, gen) -> None:
    block_size, lens = 16, [37, 1, 300]
    for dtype in dtypes:
        num_pages = sum(-(-n // block_size) for n in lens) + 2
        k_cache, v_cache = paged_caches(num_pages, block_size, 2, head_dim, dtype, gen, fill=float("nan"), device="cuda")
        table = shuffled_tables(lens, block_size, num_pages, gen).cuda()
        keys = torch.randn(sum(lens), 2, head_dim, generator=gen).to(dtype).cuda()
        values = torch.randn(sum(lens), 2, head_dim, generator=gen).to(dtype).cuda()
        write_kv(k=keys, v=values, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping(lens, table.cpu(), block_size).cuda(), backend="triton")
        context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), 8, head_dim, generator=gen).to(dtype).cuda()
        assert _triton_vs_reference(paged_attention_decode, q, k_cache=k_cache, v_cache=v_cache, block_tables=table,
                                    context_lens=context_lens, scale=head_dim**-0.5) < 1e-2  # fmt: skip
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(lens), 8, head_dim, generator=gen).to(dtype).cuda()
        assert _triton_vs_reference(paged_attention_prefill, q, k_cache=k_cache, v_cache=v_cache, block_tables=table, query_start_loc=starts,
                                    context_lens=context_lens, scale=head_dim**-0.5) < 1e-2  # fmt: skip
