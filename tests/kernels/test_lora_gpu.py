"""LoRA kernels on the GPU (gpu marker): Triton against the torch reference on the same device at
Llama-3-8B shapes (hidden 4096, intermediate 14336, q|k|v 4096|1024|1024) in bf16, 24 adapters of ranks
1-128 (odd ones among them) over every adapter popularity: relative error within bf16 tolerance, never NaN."""

import pytest
import torch

from lorafleet.kernels.lora import lora_delta, lora_expand, lora_shrink, lora_silu_mul, lora_xa, shrink_buffer
from lorafleet.kernels.lora_layout import make_lora_batch
from tests.kernels.kernel_cases import LLAMA3_8B_DIMS, POPULARITIES, random_pool_layout, token_slots

GPU_RANKS = (8, 16, 32, 64, 128, 24, 1, 7, 33, 97)  # rank classes 16-128, rank 1 and odd ranks in each class
LLAMA_GROUPS = {"qkv": ([0, 1, 2], [4096, 1024, 1024]), "o": ([3], [4096]), "gate_up": ([4, 5], [14336, 14336]), "down": ([6], [4096])}


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [(16,), GPU_RANKS])
def test_prefill_shrink_programs_covering_several_pairs_on_gpu(ranks, gen):
    """T=1024 over 8 adapters in 64-token segments, Llama-3-8B shapes, bf16: the shrink with the pairs
    per program its rule picks (2 for q|k|v at rank 16: the benchmark's prefill case) and with 4,
    against the torch reference."""
    from lorafleet.kernels.lora_triton import lora_shrink_triton, shrink_chunks

    layout = random_pool_layout(ranks_by_slot=[ranks[s % len(ranks)] for s in range(8)], dims=LLAMA3_8B_DIMS, page_elems=2 * 2 * 16 * 8 * 128 * 32,
                                dtype=torch.bfloat16, device="cuda", gen=gen)  # fmt: skip
    slots = (torch.arange(1024, device="cuda") // 128).to(torch.int32)
    batch = make_lora_batch(slots, layout.max_rank_by_slot(), max_segment_len=64)
    for proj_ids, _ in LLAMA_GROUPS.values():
        x = torch.randn(1024, LLAMA3_8B_DIMS[proj_ids[0]][0], generator=gen).to(torch.bfloat16).cuda()
        want = shrink_buffer(x=x, proj_ids=proj_ids, batch=batch, backend="reference")
        lora_shrink(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=want, backend="reference")
        splits = shrink_buffer(x=x, proj_ids=proj_ids, batch=batch, backend="triton").shape[0]
        if ranks == (16,) and len(proj_ids) == 3:
            assert shrink_chunks(num_proj=3, batch=batch, splits=splits, device=x.device, block_r=16) == 2
        for chunks in (None, 4):
            got = torch.full((splits, *want.shape[1:]), float("nan"), device="cuda")
            lora_shrink_triton(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=got, chunks=chunks)
            for i, proj in enumerate(proj_ids):
                r = layout.ranks[0, proj, slots.long()]
                rows = torch.arange(batch.max_rank, device="cuda")[None, :] < r[:, None]
                g, w = got.sum(0)[i][rows], want[0, i][rows]
                assert not torch.isnan(g).any(), (proj_ids, chunks)
                assert float((g - w).norm() / w.norm()) < 1e-3, (proj_ids, chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens,grouped", [(1, True), (64, True), (64, False), (300, True)])
def test_llama3_8b_shapes_in_bf16_on_gpu(popularity, num_tokens, grouped, gen):
    """Triton vs the torch reference at Llama-3-8B shapes, 24 adapters of ranks 1-128, bf16."""
    ranks_by_slot = [GPU_RANKS[s % len(GPU_RANKS)] for s in range(24)]
    layout = random_pool_layout(ranks_by_slot=ranks_by_slot, dims=LLAMA3_8B_DIMS, page_elems=2 * 2 * 16 * 8 * 128 * 32, dtype=torch.bfloat16, device="cuda", gen=gen)
    slots = token_slots(popularity, num_tokens, 24, gen).cuda()
    batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=64)  # T=300: 64-token tiles
    for group, (proj_ids, widths) in LLAMA_GROUPS.items():
        k = LLAMA3_8B_DIMS[proj_ids[0]][0]
        x = torch.randn(num_tokens, k, generator=gen).to(torch.bfloat16).cuda()
        xas = {}
        for backend in ("reference", "triton"):
            xa = shrink_buffer(x=x, proj_ids=proj_ids, batch=batch, backend=backend).fill_(float("nan"))
            lora_shrink(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=xa, backend=backend)
            xas[backend] = xa
        live = slots >= 0
        if live.any() and batch.max_rank:
            for i, proj in enumerate(proj_ids):
                r = layout.ranks[0, proj, slots[live].long()]
                cols = torch.arange(batch.max_rank, device="cuda")[None, :] < r[:, None]
                # The sum of the partials: a split left unwritten would show as NaN.
                got, want = xas["triton"].sum(0)[i][live][cols], xas["reference"].sum(0)[i][live][cols]
                assert not torch.isnan(got).any(), group
                assert float((got - want).norm() / want.norm()) < 1e-3, group
        offsets = [0, *torch.tensor(widths).cumsum(0).tolist()[:-1]]
        y0 = (torch.randn(num_tokens, sum(widths), generator=gen) * 0.1).to(torch.bfloat16).cuda()
        ys = {}
        for backend in ("reference", "triton"):
            y = y0.clone()
            lora_expand(xa=xas[backend], layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=y, out_offsets=offsets, backend=backend)
            ys[backend] = y.float()
        assert not torch.isnan(ys["triton"]).any(), group
        delta_t, delta_r = ys["triton"] - y0.float(), ys["reference"] - y0.float()
        assert float((delta_t - delta_r).norm() / delta_r.norm().clamp_min(1e-6)) < 2e-2, group
        assert torch.equal(ys["triton"][~live], y0.float()[~live])


def _llama_layout(gen: torch.Generator):
    """24 adapters of ranks 1-128 at Llama-3-8B dims in bf16 on the GPU; slot s leaves projection s % 7 alone."""
    ranks_by_slot = [GPU_RANKS[s % len(GPU_RANKS)] for s in range(24)]
    layout = random_pool_layout(ranks_by_slot=ranks_by_slot, dims=LLAMA3_8B_DIMS, page_elems=2 * 2 * 16 * 8 * 128 * 32, dtype=torch.bfloat16, device="cuda", gen=gen)
    for proj in range(7):
        layout.ranks[0, proj, proj::7] = 0
    return layout


def _covered(batch, num_tokens: int) -> torch.Tensor:
    covered = torch.zeros(num_tokens, dtype=torch.bool, device="cuda")
    covered[batch.sorted_token_ids.long()] = True
    return covered


@pytest.mark.gpu
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens,grouped", [(1, True), (64, False), (300, True), (1024, True)])
def test_write_mode_delta_at_llama3_8b_shapes_in_bf16_on_gpu(popularity, num_tokens, grouped, gen):
    """lora_delta(accumulate=False), the prefill path where the base GEMM adds itself afterwards, into a
    NaN-filled y: every segment token gets the reference's delta, exact zeros in a slice its slot leaves
    alone (or slot -1 in a per-token batch); tokens in no segment keep NaN. T=1024: the step's own segment length."""
    layout = _llama_layout(gen)
    slots = token_slots(popularity, num_tokens, 24, gen).cuda()
    batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=None if num_tokens == 1024 else 64)
    covered = _covered(batch, num_tokens)
    for group, (proj_ids, widths) in LLAMA_GROUPS.items():
        x = torch.randn(num_tokens, LLAMA3_8B_DIMS[proj_ids[0]][0], generator=gen).to(torch.bfloat16).cuda()
        offsets = [0, *torch.tensor(widths).cumsum(0).tolist()[:-1]]
        ys = {}
        for backend in ("reference", "triton"):
            y = torch.full((num_tokens, sum(widths)), float("nan"), dtype=torch.bfloat16, device="cuda")
            lora_delta(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=y, out_offsets=offsets, backend=backend, accumulate=False)
            ys[backend] = y.float()
        got, want = ys["triton"], ys["reference"]
        assert torch.isnan(got[~covered]).all(), group
        assert not torch.isnan(got[covered]).any(), group
        for proj, start, n in zip(proj_ids, offsets, widths, strict=True):
            adapted = (slots >= 0) & (layout.ranks[0, proj, slots.clamp(min=0).long()] > 0)
            assert (got[covered & ~adapted, start : start + n] == 0).all(), (group, proj)
        err = float((got[covered] - want[covered]).norm() / want[covered].norm().clamp_min(1e-6))
        assert err < 2e-2, (group, err)


@pytest.mark.gpu
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens,grouped", [(1, True), (64, False), (300, True)])
def test_folded_activation_at_llama3_8b_shapes_in_bf16_on_gpu(popularity, num_tokens, grouped, gen):
    """lora_silu_mul at hidden 4096 / intermediate 14336: each backend's own shrink and folded activation,
    out NaN-filled; the Triton act matches the reference's on every segment token, the rest stay NaN."""
    layout = _llama_layout(gen)
    slots = token_slots(popularity, num_tokens, 24, gen).cuda()
    batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=64)
    covered = _covered(batch, num_tokens)
    x = torch.randn(num_tokens, 4096, generator=gen).to(torch.bfloat16).cuda()
    gate_up = (torch.randn(num_tokens, 2 * 14336, generator=gen) * 2).to(torch.bfloat16).cuda()
    outs = {}
    for backend in ("reference", "triton"):
        xa = lora_xa(x=x, layout=layout, layer=0, proj_ids=[4, 5], batch=batch, backend=backend)
        out = torch.full((num_tokens, 14336), float("nan"), dtype=torch.bfloat16, device="cuda")
        lora_silu_mul(gate_up=gate_up, xa=xa, layout=layout, layer=0, batch=batch, out=out, backend=backend)
        outs[backend] = out.float()
    got, want = outs["triton"], outs["reference"]
    assert torch.isnan(got[~covered]).all()
    if covered.any():
        assert not torch.isnan(got[covered]).any()
        err = float((got[covered] - want[covered]).norm() / want[covered].norm())
        assert err < 2e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("num_live,bucket", [(1, 1), (13, 16), (64, 64), (200, 208)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_graph_shaped_decode_batch_at_llama3_8b_shapes_on_gpu(num_live, bucket, accumulate, gen):
    """The batch a captured decode step replays: live rows padded to the graph's bucket, segments padded
    with empty ones of slot -1 to `graph_segments`, the rank bound and planning rank `graph_ranks` picks
    (and, as graphs were before rank bounds, one segment per row with the layout's rank). The Triton delta
    equals the reference's on the live rows; padding rows are left alone."""
    from lorafleet.kernels.lora_layout import LoRABatch
    from lorafleet.worker.cuda_graphs import graph_ranks, graph_segments, padded_groups

    layout = _llama_layout(gen)
    live = token_slots("mixed_none", num_live, 24, gen).tolist()
    i32 = {"dtype": torch.int32, "device": "cuda"}
    slots = torch.tensor([*live, *[-1] * (bucket - num_live)], **i32)
    ranks = [int(layout.max_rank_by_slot()[s]) for s in live if s >= 0]
    bound, plan = graph_ranks(layout.max_rank, max(ranks, default=0), sum(ranks) / max(len(ranks), 1))
    for segs, max_rank, mean_rank in ((graph_segments(bucket, 64, layout.max_slots), bound, plan), (bucket, layout.max_rank, 0)):
        ids, starts, seg_slots = padded_groups(live, 64, bucket, segs)
        batch = LoRABatch(slots, torch.tensor(ids, **i32), torch.tensor(starts, **i32), torch.tensor(seg_slots, **i32), max_rank=max_rank,
                          mean_rank=float(mean_rank))  # fmt: skip
        _check_graph_batch(layout, batch, bucket, num_live, accumulate, gen)


def _check_graph_batch(layout, batch, bucket: int, num_live: int, accumulate: bool, gen) -> None:
    for group, (proj_ids, widths) in LLAMA_GROUPS.items():
        x = torch.randn(bucket, LLAMA3_8B_DIMS[proj_ids[0]][0], generator=gen).to(torch.bfloat16).cuda()
        offsets = [0, *torch.tensor(widths).cumsum(0).tolist()[:-1]]
        y0 = (torch.randn(bucket, sum(widths), generator=gen) * 0.1).to(torch.bfloat16).cuda()
        ys = {}
        for backend in ("reference", "triton"):
            y = y0.clone() if accumulate else torch.zeros_like(y0)
            lora_delta(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=y, out_offsets=offsets, backend=backend, accumulate=accumulate)
            ys[backend] = y.float()
        got, want = ys["triton"], ys["reference"]
        assert not torch.isnan(got).any(), group
        assert torch.equal(got[num_live:], ys["reference"][num_live:]), group  # padding rows: untouched (or zeros) on both
        err = float((got[:num_live] - want[:num_live]).norm() / want[:num_live].norm().clamp_min(1e-6))
        assert err < 2e-2, (group, err)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_float32_fits_the_gpu_at_llama3_8b_shapes(num_tokens, gen):
    """A float32 engine on a GPU (what the README has users compare in) runs the same kernels: the shrink's
    bf16 tiles, 256 wide and three deep, asked 256 KiB of shared memory in float32 (sm_90 has 227) and the
    engine failed at its warm-up. Every group against the reference, 8 adapters of mixed ranks."""
    ranks_by_slot = [GPU_RANKS[s % len(GPU_RANKS)] for s in range(8)]
    layout = random_pool_layout(ranks_by_slot=ranks_by_slot, dims=LLAMA3_8B_DIMS, page_elems=2 * 2 * 16 * 8 * 128 * 32,
                                dtype=torch.float32, device="cuda", gen=gen)  # fmt: skip
    slots = (torch.arange(num_tokens, device="cuda") * 8 // num_tokens).to(torch.int32)
    batch = make_lora_batch(slots, layout.max_rank_by_slot(), max_segment_len=64)
    for group, (proj_ids, widths) in LLAMA_GROUPS.items():
        x = torch.randn(num_tokens, LLAMA3_8B_DIMS[proj_ids[0]][0], generator=gen).cuda()
        offsets = [0, *torch.tensor(widths).cumsum(0).tolist()[:-1]]
        ys = {}
        for backend in ("reference", "triton"):
            ys[backend] = torch.zeros((num_tokens, sum(widths)), device="cuda")
            lora_delta(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=ys[backend], out_offsets=offsets,
                       backend=backend)
        err = float((ys["triton"] - ys["reference"]).norm() / ys["reference"].norm().clamp_min(1e-6))
        assert err < 5e-3, (group, err)  # tl.dot of float32 may run in tf32
