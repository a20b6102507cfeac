"""lora_shrink / lora_expand against a naive per-token dense computation, on every backend.

Outputs are poisoned (NaN) before each run; adapters differ in rank (1-128), alpha and targeted
modules; pages are shuffled so only the layout's offsets can find a row. The shrink output holds
partial sums over K (its first dim); expand is fed a random split of the exact shrink result.
"""

import pytest
import torch

from lorafleet.kernels import lora_reference
from lorafleet.kernels.lora import lora_delta, lora_expand, lora_shrink, shrink_buffer
from lorafleet.kernels.lora_layout import make_lora_batch, pack_lora_layout
from tests.kernels.kernel_cases import (
    MIXED_RANKS,
    POPULARITIES,
    dense_delta,
    dense_shrink,
    hand_built_batch,
    random_adapters,
    token_slots,
)

BACKENDS = ["reference", "triton"]
HIDDEN = 64
# Fused groups as the model calls them: q|k|v (unequal widths), o, gate|up, down.
GROUPS = {"qkv": ([0, 1, 2], HIDDEN, [64, 32, 48]), "o": ([3], 64, [HIDDEN]), "gate_up": ([4, 5], HIDDEN, [96, 80]), "down": ([6], 96, [HIDDEN])}
DIMS = {0: (64, 64), 1: (64, 32), 2: (64, 48), 3: (64, 64), 4: (64, 96), 5: (64, 80), 6: (96, 64)}
TOL = {torch.float32: 2e-4, torch.float16: 3e-3}


def _setup(gen, *, num_slots, dtype, ranks=MIXED_RANKS, num_layers=2, skip_prob=0.15):
    modules = random_adapters(num_slots=num_slots, num_layers=num_layers, dims=DIMS, gen=gen, ranks=ranks, skip_prob=skip_prob)
    # The answer is computed from the weights as stored (rounded to the pool dtype).
    modules = {key: (a.to(dtype).float(), b.to(dtype).float(), s) for key, (a, b, s) in modules.items()}
    order = torch.randperm(4000, generator=gen)
    layout = pack_lora_layout(modules, num_layers=num_layers, max_slots=num_slots + 1, page_elems=300, dtype=dtype, num_pages=4000, page_order=order)
    return modules, layout


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in output"
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-12))


def _check_shrink(modules, layout, batch, x, slots, group, layer, backend, dtype, splits=1):
    proj_ids, _, _ = GROUPS[group]
    out = torch.full((splits, len(proj_ids), x.shape[0], max(batch.max_rank, 1)), float("nan"))
    lora_shrink(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, out=out, backend=backend)
    total = out.sum(0)  # a split left unwritten would show as NaN
    for i, proj in enumerate(proj_ids):
        for t, want in enumerate(dense_shrink(modules, slots, x, layer, proj)):
            if want is not None:
                assert _rel_err(total[i, t, : want.numel()], want) < TOL[dtype], (group, proj, t)


def split_xa(modules, slots, x, layer, proj_ids, max_rank, splits, gen):
    """float32 [splits, P, T, R]: random partial sums of the exact shrink result where defined, NaN elsewhere."""
    xa = torch.full((splits, len(proj_ids), x.shape[0], max(max_rank, 1)), float("nan"))
    for i, proj in enumerate(proj_ids):
        for t, v in enumerate(dense_shrink(modules, slots, x, layer, proj)):
            if v is not None:
                parts = torch.randn(splits - 1, v.numel(), generator=gen, dtype=torch.float64) * v.abs().mean()
                xa[:-1, i, t, : v.numel()] = parts.float()
                xa[-1, i, t, : v.numel()] = (v - parts.float().double().sum(0)).float()
    return xa


def _check_expand(modules, layout, batch, x, slots, group, layer, backend, dtype, gen, splits=1):
    proj_ids, _, widths = GROUPS[group]
    num_tokens = x.shape[0]
    xa = split_xa(modules, slots, x, layer, proj_ids, batch.max_rank, splits, gen)
    y = torch.randn(num_tokens, sum(widths), generator=gen).to(dtype)
    want = y.double().clone()
    offsets, start = [], 0
    for proj, n in zip(proj_ids, widths, strict=True):
        want[:, start : start + n] += dense_delta(modules, slots, x, layer, proj, n)
        offsets.append(start)
        start += n
    lora_expand(xa=xa, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_offsets=offsets, backend=backend)
    assert _rel_err(y, want) < TOL[dtype]
    untouched = slots < 0
    assert torch.equal(y[untouched].double(), want[untouched])  # slot -1: base output left exactly as it was


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_and_expand_match_dense(backend, popularity, dtype, gen):
    num_slots, splits = 12, 1 + POPULARITIES.index(popularity) % 3  # one, two or three partial sums
    modules, layout = _setup(gen, num_slots=num_slots, dtype=dtype)
    # Segments of up to 64 tokens (token tiles of 16, or 64 where one slot holds all 40 tokens), of up to 32
    # (tiles of 32: 32 + 8 tokens), and per-token decode segments.
    cases = [(True, 40, GROUPS, 64), (False, 6, ("qkv", "gate_up"), None)] + [(True, 40, GROUPS, 32)] * (popularity == "identical")
    for grouped, num_tokens, groups, segment_len in cases:
        slots = token_slots(popularity, num_tokens, num_slots, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=segment_len)
        for group in groups:
            k = GROUPS[group][1]
            x = torch.randn(num_tokens, k, generator=gen).to(dtype)
            layer = int(torch.randint(0, 2, (1,), generator=gen))
            _check_shrink(modules, layout, batch, x, slots, group, layer, backend, dtype, splits)
            _check_expand(modules, layout, batch, x, slots, group, layer, backend, dtype, gen, splits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segments_of_length_zero_to_many(backend, dtype, gen):
    """A hand-built batch with empty segments, a long one and single tokens."""
    modules, layout = _setup(gen, num_slots=6, dtype=dtype, skip_prob=0.0)
    lengths, seg_slots = [0, 70, 1, 0, 3, 1, 0], [4, 0, 5, 1, 2, 3, 1]
    used = [s for s, n in zip(seg_slots, lengths, strict=True) if n]
    slots, batch = hand_built_batch(lengths, seg_slots, 5, gen, int(layout.max_rank_by_slot()[used].max()))  # five tokens without adapter
    for group, (_, k, _) in GROUPS.items():
        x = torch.randn(slots.shape[0], k, generator=gen).to(dtype)
        _check_shrink(modules, layout, batch, x, slots, group, 1, backend, dtype)
        _check_expand(modules, layout, batch, x, slots, group, 1, backend, dtype, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_adapters_in_one_batch(backend, gen):
    """64 distinct adapters, one or two tokens each: every segment still gets its own weights."""
    modules, layout = _setup(gen, num_slots=64, dtype=torch.float32, ranks=(4, 8, 16), num_layers=1)
    slots = token_slots("uniform", 100, 64, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    x = torch.randn(100, HIDDEN, generator=gen)
    _check_shrink(modules, layout, batch, x, slots, "qkv", 0, backend, torch.float32)
    _check_expand(modules, layout, batch, x, slots, "gate_up", 0, backend, torch.float32, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_and_alpha_travel_with_each_adapter(backend, gen):
    """Same A/B numbers under two slots with different rank cut-offs and alphas give their own deltas."""
    a = torch.randn(16, HIDDEN, generator=gen)
    b = torch.randn(64, 16, generator=gen)
    modules = {(0, 0, 0): (a, b, 32 / 16), (1, 0, 0): (a[:4], b[:, :4], 8 / 4), (2, 0, 0): (a[:4], b[:, :4], 8 / 2)}
    layout = pack_lora_layout(modules, num_layers=1, max_slots=3, page_elems=256, dtype=torch.float32)
    slots = torch.tensor([0, 1, 2, 1, 0, -1], dtype=torch.int32)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    x = torch.randn(6, HIDDEN, generator=gen)
    x[2] = x[1]
    xa = torch.full((1, 1, 6, 16), float("nan"))
    lora_shrink(x=x, layout=layout, layer=0, proj_ids=[0], batch=batch, out=xa, backend=backend)
    y = torch.zeros(6, 64)
    lora_expand(xa=xa, layout=layout, layer=0, proj_ids=[0], batch=batch, y=y, out_offsets=[0], backend=backend)
    want = dense_delta(modules, slots, x, 0, 0, 64)
    assert _rel_err(y, want) < 1e-4
    assert torch.allclose(y[2].double(), 2 * want[1], rtol=1e-4)  # alpha/r: 8/2 vs 8/4 on the same rank-4 weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_delta_accumulates_in_float32(backend, gen):
    """The shrink result of fp16 inputs is not rounded to fp16 (the merged-vs-unmerged drift pitfall)."""
    modules, layout = _setup(gen, num_slots=4, dtype=torch.float16, ranks=(32,), skip_prob=0.0)
    slots = token_slots("uniform", 20, 4, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    x = torch.randn(20, HIDDEN, generator=gen).half()
    out = torch.full((1, 1, 20, batch.max_rank), float("nan"))
    lora_shrink(x=x, layout=layout, layer=0, proj_ids=[4], batch=batch, out=out, backend=backend)
    want = torch.stack(dense_shrink(modules, slots, x.float(), 0, 4))
    assert _rel_err(out[0, 0], want) < 1e-5  # rounding the result to fp16 would give ~3e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_half_precision_output_takes_its_delta_rounded_once(backend):
    """y + delta is summed in float32 and rounded to y's dtype once: y = 1, delta = 2^-11 (1 + 2^-12) is just over
    half of float16's step at 1, so y becomes 1 + 2^-10; the delta rounded to float16 first (2^-11) would leave a
    tie, rounded to even: 1. Merged weights are rounded once too, so twice would drift from them."""
    a = torch.zeros(1, HIDDEN)
    a[0, 0] = 1.0
    b = torch.full((96, 1), 2.0**-11)
    layout = pack_lora_layout({(0, 0, 4): (a, b, 1 + 2.0**-12)}, num_layers=1, max_slots=1, page_elems=300,
                              dtype=torch.float16, num_pages=64)
    slots = torch.tensor([0], dtype=torch.int32)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    x = torch.zeros(1, HIDDEN, dtype=torch.float16)
    x[0, 0] = 1.0
    xa = shrink_buffer(x=x, proj_ids=[4], batch=batch, backend=backend).fill_(float("nan"))
    lora_shrink(x=x, layout=layout, layer=0, proj_ids=[4], batch=batch, out=xa, backend=backend)
    y = torch.ones(1, 96, dtype=torch.float16)
    lora_expand(xa=xa, layout=layout, layer=0, proj_ids=[4], batch=batch, y=y, out_offsets=[0], backend=backend)
    assert torch.equal(y, torch.full((1, 96), 1 + 2.0**-10, dtype=torch.float16))


@pytest.mark.parametrize("host_slots", [0, 64])
def test_the_whole_delta_rounds_once_on_the_cpus_host_path_and_general_path(host_slots, monkeypatch):
    """The same case through lora_delta, the call the model makes: a CPU batch of few adapters takes the host path
    (lora_delta_host), others the general path (HOST_SLOTS_MAX 0 forces it); both round y + delta once."""
    monkeypatch.setattr(lora_reference, "HOST_SLOTS_MAX", host_slots)
    a = torch.zeros(1, HIDDEN)
    a[0, 0] = 1.0
    layout = pack_lora_layout({(0, 0, 4): (a, torch.full((96, 1), 2.0**-11), 1 + 2.0**-12)}, num_layers=1,
                              max_slots=1, page_elems=300, dtype=torch.float16, num_pages=64)
    batch = make_lora_batch(torch.tensor([0], dtype=torch.int32), layout.max_rank_by_slot())
    assert lora_reference.takes_host(batch) == bool(host_slots)
    x = torch.zeros(1, HIDDEN, dtype=torch.float16)
    x[0, 0] = 1.0
    y = torch.ones(1, 96, dtype=torch.float16)
    lora_delta(x=x, layout=layout, layer=0, proj_ids=[4], batch=batch, y=y, out_offsets=[0], backend="reference")
    assert torch.equal(y, torch.full((1, 96), 1 + 2.0**-10, dtype=torch.float16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unmerged_delta_equals_the_merged_weights(backend, gen):
    """W x + scale B (A x) through the kernels equals (W + scale B A) x in float32 (merged-vs-unmerged pitfall)."""
    modules, layout = _setup(gen, num_slots=3, dtype=torch.float32, ranks=(8, 32), skip_prob=0.0, num_layers=1)
    slots = torch.tensor([0, 2, 1, 1, -1, 0, 2, 2], dtype=torch.int32)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    x = torch.randn(8, HIDDEN, generator=gen)
    w = torch.randn(96 + 80, HIDDEN, generator=gen) / 8  # fused gate|up base weight
    y = x @ w.T
    xa = shrink_buffer(x=x, proj_ids=[4, 5], batch=batch, backend=backend).fill_(float("nan"))
    lora_shrink(x=x, layout=layout, layer=0, proj_ids=[4, 5], batch=batch, out=xa, backend=backend)
    lora_expand(xa=xa, layout=layout, layer=0, proj_ids=[4, 5], batch=batch, y=y, out_offsets=[0, 96], backend=backend)
    for t, s in enumerate(slots.tolist()):
        merged = w.double().clone()
        if s >= 0:
            for proj, rows in ((4, slice(0, 96)), (5, slice(96, 176))):
                a, b, scale = modules[(s, 0, proj)]
                merged[rows] += scale * b.double() @ a.double()
        want = x[t].double() @ merged.T
        assert float((y[t].double() - want).norm() / want.norm()) < 1e-5, t


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_triton_shrink_writes_one_partial_sum_per_split(splits, gen):
    """Each K split stores its own partial sum (no zero fill, no atomics); with more splits than K
    tiles (8 splits of 6 tiles) the empty ones store zeros, so the sum is still exact."""
    from lorafleet.kernels.lora_triton import lora_shrink_triton

    modules, layout = _setup(gen, num_slots=5, dtype=torch.float32, num_layers=1)
    slots = token_slots("zipf", 30, 5, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    x = torch.randn(30, 96, generator=gen)
    out = torch.full((splits, 1, 30, batch.max_rank), float("nan"))
    lora_shrink_triton(x=x, layout=layout, layer=0, proj_ids=[6], batch=batch, out=out, block_k=16)
    for t, want in enumerate(dense_shrink(modules, slots, x, 0, 6)):
        if want is not None:
            r = want.numel()
            assert not torch.isnan(out[:, 0, t, :r]).any(), t
            assert _rel_err(out[:, 0, t, :r].sum(0), want) < 1e-5


@pytest.mark.parametrize("chunks", [1, 2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_shrink_programs_covering_several_projections(chunks, dtype, gen):
    """A program covering several (projection, rank chunk) pairs (rank tile 16, ranks up to 40 over
    q|k|v: 3 chunks a projection, 9 pairs, so programs of 2 or 4 pairs straddle projections and the
    last runs past the last pair; tokens without an adapter; modules a slot does not adapt) writes
    every row of each pair and no other."""
    from lorafleet.kernels.lora_triton import lora_shrink_triton

    modules, layout = _setup(gen, num_slots=6, dtype=dtype, ranks=(8, 24, 40))
    slots = token_slots("mixed_none", 40, 6, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    assert (slots < 0).any() and batch.max_rank > 32
    x = torch.randn(40, HIDDEN, generator=gen).to(dtype)
    out = torch.full((2, 3, 40, batch.max_rank), float("nan"))
    lora_shrink_triton(x=x, layout=layout, layer=1, proj_ids=[0, 1, 2], batch=batch, out=out, block_k=16, block_r=16, chunks=chunks)
    for i, proj in enumerate([0, 1, 2]):
        for t, want in enumerate(dense_shrink(modules, slots, x.float(), 1, proj)):
            if want is not None:
                assert _rel_err(out[:, i, t, : want.numel()].sum(0), want) < TOL[dtype], (proj, t)
                assert torch.isnan(out[:, i, t, want.numel() :]).all(), (proj, t)  # rows past the rank: not written
            else:
                assert torch.isnan(out[:, i, t]).all(), (proj, t)
    with pytest.raises(ValueError, match="power of two"):
        lora_shrink_triton(x=x, layout=layout, layer=1, proj_ids=[0, 1, 2], batch=batch, out=out, block_r=16, chunks=3)


def test_shrink_chunks_fit_prefill_grids_in_one_wave():
    """Prefill programs take more (projection, rank chunk) pairs until the grid fits one program per SM
    (4 on CPU), at most 64 rows; a grid that fits already, and decode programs, take one."""
    from lorafleet.kernels.lora_triton import shrink_chunks

    cpu = torch.device("cpu")
    ranks = torch.tensor([16] * 7 + [64], dtype=torch.int32)
    prefill = make_lora_batch(torch.arange(1024, dtype=torch.int32) // 128, ranks, max_segment_len=64)
    assert shrink_chunks(num_proj=3, batch=prefill, splits=4, device=cpu, block_r=16) == 4  # 12 pairs: 64 rows at most
    assert shrink_chunks(num_proj=2, batch=prefill, splits=4, device=cpu, block_r=32) == 2  # 4 pairs: 64 rows at most
    assert shrink_chunks(num_proj=1, batch=prefill, splits=4, device=cpu, block_r=64) == 1
    one = make_lora_batch(torch.zeros(64, dtype=torch.int32), ranks, max_segment_len=64)
    assert shrink_chunks(num_proj=3, batch=one, splits=1, device=cpu, block_r=64) == 1  # 3 programs
    decode = make_lora_batch(torch.arange(64, dtype=torch.int32) % 8, ranks)
    assert shrink_chunks(num_proj=3, batch=decode, splits=4, device=cpu, block_r=16) == 1


def test_triton_expand_programs_walking_several_column_tiles(gen):
    """A program that walks several output tiles (cols_per_program > block_n) covers each column once,
    ranks above the rank tile (block_r=16, ranks up to 128) take several chunks, xa in two splits."""
    from lorafleet.kernels.lora_triton import lora_expand_triton

    modules, layout = _setup(gen, num_slots=4, dtype=torch.float32, num_layers=1)
    slots = token_slots("mixed_none", 20, 4, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    x = torch.randn(20, HIDDEN, generator=gen)
    xa = split_xa(modules, slots, x, 0, [0, 1, 2], batch.max_rank, 2, gen)
    want = torch.zeros(20, 144, dtype=torch.float64)
    for proj, (start, n) in zip([0, 1, 2], [(0, 64), (64, 32), (96, 48)], strict=True):
        want[:, start : start + n] = dense_delta(modules, slots, x, 0, proj, n)
    y = torch.zeros(20, 144)
    slices = [(0, 64), (64, 32), (96, 48)]
    lora_expand_triton(xa=xa, layout=layout, layer=0, proj_ids=[0, 1, 2], batch=batch, y=y, out_slices=slices, block_n=16, block_r=16, cols_per_program=48)
    assert _rel_err(y, want) < 1e-5


def test_shrink_buffer_sizes_the_partial_sums(gen):
    """One partial sum on the reference backend; the Triton heuristic keeps expand's xa tile small."""
    from lorafleet.kernels.lora_triton import XA_TILE_ELEMS, shrink_splits

    slots = torch.arange(64, dtype=torch.int32) % 32
    batch = make_lora_batch(slots, torch.full((32,), 16, dtype=torch.int32))
    x = torch.randn(64, 4096)
    xa = shrink_buffer(x=x, proj_ids=[0, 1, 2], batch=batch, backend="reference")
    assert tuple(xa.shape) == (1, 3, 64, 16) and xa.dtype == torch.float32
    assert tuple(shrink_buffer(x=x, proj_ids=[0, 1, 2], batch=batch, backend="triton").shape[1:]) == (3, 64, 16)
    for max_rank in (8, 16, 64, 128):
        batch.max_rank, batch.mean_rank = max_rank, 0.0
        splits = shrink_splits(k=4096, num_proj=3, batch=batch, device=x.device)
        assert 1 <= splits <= 16 and splits * 16 * max(32, max_rank) <= XA_TILE_ELEMS
    # Ranks {8, 16, 32, 64}: the splits of a batch whose ranks all equal the mean, not of its largest rank
    # (the expand's rank-64 programs sum their partials in several groups of loads).
    batch.max_rank, batch.mean_rank = 64, 30.0
    mixed = shrink_splits(k=14336, num_proj=1, batch=batch, device=x.device)
    batch.max_rank = 30
    assert mixed == shrink_splits(k=14336, num_proj=1, batch=batch, device=x.device)
    # One adapter's 64 tokens in one segment, too few programs: more splits than one group of xa
    # loads holds (the expand sums them in several).
    one = make_lora_batch(torch.zeros(64, dtype=torch.int32), torch.full((1,), 16, dtype=torch.int32), max_segment_len=64)
    assert shrink_splits(k=4096, num_proj=3, batch=one, device=x.device) * 64 * 32 > XA_TILE_ELEMS


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_expand_tiles_per_rank_class(dtype, accumulate, gen, monkeypatch):
    """The small test widths sit below CLASS_TILES_MIN_COLS: lowered to 0, every group takes the
    per-rank-class tiles (classes 16 to 128, column walks scaled by class) and still gives the dense
    answer, in both modes, with 1 or 3 partial sums."""
    from lorafleet.kernels import lora_triton

    monkeypatch.setattr(lora_triton, "CLASS_TILES_MIN_COLS", 0)
    modules, layout = _setup(gen, num_slots=12, dtype=dtype, ranks=(*MIXED_RANKS, 24))  # every class: 16, 32, 64, 128
    for grouped, num_tokens, splits in ((True, 40, 3), (False, 9, 1)):
        slots = token_slots("mixed_none", num_tokens, 12, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped)
        for group, (proj_ids, k, widths) in GROUPS.items():
            x = torch.randn(num_tokens, k, generator=gen).to(dtype)
            if accumulate:
                _check_expand(modules, layout, batch, x, slots, group, 1, "triton", dtype, gen, splits)
                continue
            xa = split_xa(modules, slots, x, 1, proj_ids, batch.max_rank, splits, gen)
            y = torch.full((num_tokens, sum(widths)), float("nan")).to(dtype)
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            lora_expand(xa=xa, layout=layout, layer=1, proj_ids=proj_ids, batch=batch, y=y, out_offsets=offsets, backend="triton", accumulate=False)
            want = torch.cat([dense_delta(modules, slots, x, 1, p, n) for p, n in zip(proj_ids, widths, strict=True)], dim=1)
            live = slots >= 0
            assert _rel_err(y[live], want[live]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_expand_sums_many_splits_in_groups(dtype, gen):
    """16 partial sums: programs of rank classes 64 and 128 hold more xa than one unrolled group of
    loads and sum theirs in several; every class gives the dense answer."""
    modules, layout = _setup(gen, num_slots=8, dtype=dtype, num_layers=1)
    slots = token_slots("uniform", 40, 8, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    assert batch.max_rank == 128
    for group, (_, k, _) in GROUPS.items():
        x = torch.randn(40, k, generator=gen).to(dtype)
        _check_expand(modules, layout, batch, x, slots, group, 0, "triton", dtype, gen, splits=16)
