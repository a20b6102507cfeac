"""Decode steps replayed from CUDA graphs give what eager steps give: same tokens, same logprobs, with
adapters mixed in the batch, batch sizes walking down through the buckets as requests finish, and
adapters evicted and loaded again between steps (the layout changes under captured graphs)."""

from __future__ import annotations

import random

import pytest
import torch

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.cuda_graphs import (
    batch_buckets,
    graph_ranks,
    graph_segments,
    group_by_slot,
    padded_groups,
    rank_bounds,
)
from tests.lora_factory import make_peft_adapter

ADAPTERS = {"g4": dict(rank=4, alpha=8, targets=["q_proj", "v_proj"]),
            "g8": dict(rank=8, alpha=16),
            "g16": dict(rank=16, alpha=8, use_rslora=True, targets=["o_proj", "gate_proj", "down_proj"]),
            "g40": dict(rank=40, alpha=40, targets=["k_proj", "up_proj"])}


def test_batch_buckets_cover_every_size_once():
    for max_seqs in (1, 3, 8, 20, 64, 100, 256):
        buckets = batch_buckets(max_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_seqs and buckets[0] >= 1
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100)[-3:] == [80, 96, 100]


def test_group_by_slot_keeps_order_drops_base_and_cuts_long_runs():
    assert group_by_slot([2, -1, 0, 2, 0], 16) == ([2, 4, 0, 3], [0, 2, 4], [0, 2])
    assert group_by_slot([1, 1, 1, 1, 1], 2) == ([0, 1, 2, 3, 4], [0, 2, 4, 5], [1, 1, 1])
    assert group_by_slot([-1, -1], 4) == ([], [0], [])
    assert group_by_slot([], 4) == ([], [0], [])
    assert padded_groups([2, -1, 0, 2, 0], 16, 6) == ([2, 4, 0, 3, 0, 0], [0, 2, 4, 4, 4, 4, 4], [0, 2, -1, -1, -1, -1])
    # A step's segments: 16 tokens in a small step, longer in a long one (kernels.lora_layout.segment_len),
    # never above the engine's bound.
    assert group_by_slot([0] * 100, 64)[1] == [0, 16, 32, 48, 64, 80, 96, 100]
    assert group_by_slot([0] * 1024 + [-1] * 8, 64)[1] == list(range(0, 1025, 64))
    assert group_by_slot([1] * 600 + [0] * 424, 64)[1] == [*range(0, 424, 64), 424, *range(488, 1024, 64), 1024]
    assert group_by_slot([0] * 1024, 32)[1] == list(range(0, 1025, 32))


def test_rank_bounds_are_the_kernels_rank_classes_up_to_the_pools():
    assert rank_bounds(64) == [16, 32, 64]
    assert rank_bounds(100) == [16, 32, 64, 100]
    assert rank_bounds(16) == [16] and rank_bounds(8) == [8] and rank_bounds(1) == [1]
    assert rank_bounds(128) == [16, 32, 64, 128]


def test_graph_ranks_pick_the_smallest_bound_and_planning_rank_that_hold_the_step():
    assert graph_ranks(64, 16, 16.0) == (16, 16) and graph_ranks(64, 4, 4.0) == (16, 16)
    assert graph_ranks(64, 17, 17.0) == (32, 32)
    assert graph_ranks(64, 40, 20.0) == (64, 32) and graph_ranks(64, 64, 8.0) == (64, 16)
    assert graph_ranks(64, 0, 0.0) == (64, 64)  # unknown: the pool's rank, planned for it
    assert graph_ranks(64, 999, 999.0) == (64, 64)
    assert graph_ranks(100, 70, 50.0) == (100, 64) and graph_ranks(8, 3, 2.0) == (8, 8)


@pytest.mark.parametrize("most", [1, 8, 16, 64])
def test_graph_segments_hold_every_step_of_the_bucket(most):
    """However a step of at most `size` rows spreads over `max_slots` slots, its segments fit the graph's
    (padded_groups refuses a step that would not), and the bound is well below one per row once the
    bucket is large."""
    rng = random.Random(most)
    for size in (1, 2, 7, 16, 64, 100, 256):
        for max_slots in (1, 4, 16, 64):
            segs = graph_segments(size, most, max_slots)
            assert segs <= size
            for _ in range(40):
                n = rng.randint(0, size)
                shape = rng.choice(["one", "uniform", "runs"])
                if shape == "one":
                    slots = [rng.randrange(max_slots)] * n
                elif shape == "uniform":
                    slots = [rng.randrange(-1, max_slots) for _ in range(n)]
                else:  # each slot a run a little longer than a segment: the most segments per slot
                    slots = [s % max_slots for s in range(max_slots) for _ in range(rng.randint(1, 17))][:n]
                ids, starts, seg_slots = padded_groups(slots, most, size, segs)
                assert len(seg_slots) == segs and len(starts) == segs + 1 and len(ids) == size
    assert graph_segments(256, 64, 16) == 16 + 16 and graph_segments(64, 64, 16) == 4 + 16 and graph_segments(8, 64, 16) == 8
    with pytest.raises(ValueError, match="above the 2 its graph holds"):
        padded_groups([0, 1, 2], 16, 3, 2)


@pytest.fixture(scope="module")
def graph_adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("graph_adapters")
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        make_peft_adapter(tiny_llama_dir, root / name, seed=seed, **kw)
    return root


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, max_lora_rank", [("float32", 16), ("bfloat16", 16), ("float32", 64)])
def test_graph_decode_matches_eager(tiny_llama_dir, graph_adapters, dtype, max_lora_rank):
    """max_lora_rank 64: graphs at rank bounds 16, 32 and 64 (each with its planning ranks); steps of
    ranks <= 16 replay bound 16, a step holding the rank-40 adapter bound 64."""
    rng = random.Random(0)
    names = [None, "g4", "g8", "g16"] if max_lora_rank == 16 else [None, "g4", "g8", "g16", "g40"]
    adapters = [names[i % len(names)] for i in range(13)]
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 30))] for _ in adapters]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, logprobs=3) for i in range(len(prompts))]
    outs = {}
    for graphs in (False, True):
        # Two adapter slots for three adapters: slots are reused by other adapters between steps.
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype=dtype, block_size=16,
                                     adapters=str(graph_adapters), max_lora_rank=max_lora_rank, max_loras=2, max_num_seqs=16,
                                     pool_bytes=64 << 20, cuda_graphs=graphs))
        if graphs:  # a step copies only the columns its longest table uses: those past a row's blocks are never read
            engine.runner.graphs.block_tables.fill_(1 << 30)
        outs[graphs] = engine.generate(prompts, params, adapters=adapters)
        if graphs:
            g = engine.runner.graphs
            # Captured once at start (every bucket, without adapters and at each rank bound); the layout never moved.
            bounds = rank_bounds(max_lora_rank)
            pairs = len(bounds) * (len(bounds) + 1) // 2  # (rank bound, planning rank <= bound)
            assert g is not None and g.captures == (1 + pairs) * len(g.buckets) and g.replays > 10
            if max_lora_rank == 64:  # steps without g40 replay bound 16, with it bound 64
                assert g.replays_by_bound[16] > 0 and g.replays_by_bound[64] > 0
        else:
            assert engine.runner.graphs is None
        engine.page_pool.check()
        engine.adapter_pool.check()
        assert engine.page_pool.num_used("kv") == 0
    # fp32: the same tokens. bf16: other reduction orders (padded buckets, one LoRA segment per token)
    # may flip a near tie, so logprobs are compared while the two outputs agree, and the first token must.
    for i, (eager, graphed) in enumerate(zip(outs[False], outs[True], strict=True)):
        if dtype == "float32":
            assert graphed.token_ids == eager.token_ids, f"request {i} ({adapters[i]})"
        assert graphed.token_ids[0] == eager.token_ids[0], f"request {i} ({adapters[i]})"
        for step, (a, b) in enumerate(zip(eager.logprobs, graphed.logprobs, strict=True)):
            if eager.token_ids[: step + 1] != graphed.token_ids[: step + 1]:
                break
            assert abs(a.logprob - b.logprob) < (1e-4 if dtype == "float32" else 3e-2), f"request {i} step {step}"


def test_warmup_forwards_leave_the_pool_untouched(tiny_llama_dir, graph_adapters):
    """The start-up warm-up writes no KV and moves no adapter: the whole page pool is bit-identical."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", adapters=str(graph_adapters),
                                 max_lora_rank=16, pool_bytes=8 << 20))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), adapters=["g8"])  # an adapter resident in slot 0
    before = engine.page_pool.pool.clone()
    assert engine.runner.warmup([1, 7, 40], [8, 16]) == 9
    assert torch.equal(engine.page_pool.pool, before)
    engine.page_pool.check()
    engine.adapter_pool.check()
