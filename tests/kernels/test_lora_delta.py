"""lora_delta (the whole delta of a projection group) and the expand's write mode (y = delta, used
before the base GEMM adds itself), against dense answers."""

import dataclasses

import pytest
import torch

from lorafleet.kernels.lora import lora_delta, lora_expand, lora_shrink, resolve_backend, shrink_buffer
from lorafleet.kernels.lora_layout import make_lora_batch, pack_lora_layout
from tests.kernels.kernel_cases import MIXED_RANKS, POPULARITIES, dense_delta, random_adapters, token_slots

BACKENDS = ["reference", "triton"]
DIMS = {0: (64, 64), 1: (64, 32), 2: (64, 48), 3: (64, 64), 4: (64, 96), 5: (64, 80), 6: (96, 64)}
GROUPS = {"qkv": ([0, 1, 2], 64, [64, 32, 48]), "o": ([3], 64, [64]), "gate_up": ([4, 5], 64, [96, 80]), "down": ([6], 96, [64])}
TOL = {torch.float32: 2e-4, torch.float16: 3e-3}


def _setup(gen, dtype, num_slots=10, ranks=MIXED_RANKS):
    modules = random_adapters(num_slots=num_slots, num_layers=2, dims=DIMS, gen=gen, ranks=ranks)
    modules = {key: (a.to(dtype).float(), b.to(dtype).float(), s) for key, (a, b, s) in modules.items()}
    order = torch.randperm(4000, generator=gen)
    layout = pack_lora_layout(modules, num_layers=2, max_slots=num_slots, page_elems=300, dtype=dtype, num_pages=4000, page_order=order)
    return modules, layout


def _want(modules, slots, x, layer, proj_ids, widths, y):
    want = y.double().clone()
    start = 0
    for proj, n in zip(proj_ids, widths, strict=True):
        want[:, start : start + n] += dense_delta(modules, slots, x, layer, proj, n)
        start += n
    return want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_delta_matches_dense(backend, popularity, dtype, gen):
    modules, layout = _setup(gen, dtype)
    for grouped, num_tokens in ((True, 24), (False, 7)):
        slots = token_slots(popularity, num_tokens, 10, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=5)
        for proj_ids, k, widths in GROUPS.values():
            x = torch.randn(num_tokens, k, generator=gen).to(dtype)
            y = torch.randn(num_tokens, sum(widths), generator=gen).to(dtype)
            want = _want(modules, slots, x, 1, proj_ids, widths, y)
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            lora_delta(x=x, layout=layout, layer=1, proj_ids=proj_ids, batch=batch, y=y, out_offsets=offsets, backend=backend)
            assert not torch.isnan(y).any()
            assert float((y.double() - want).norm() / want.norm()) < TOL[dtype]
            assert torch.equal(y[slots < 0].double(), want[slots < 0])  # no adapter: untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_write_mode_replaces_the_slices(backend, gen):
    """accumulate=False: segment tokens get exactly their delta (zeros for modules the slot leaves
    alone); tokens in no segment keep what y held."""
    modules, layout = _setup(gen, torch.float32)
    slots = token_slots("mixed_none", 30, 10, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    proj_ids, k, widths = GROUPS["qkv"]
    x = torch.randn(30, k, generator=gen)
    xa = shrink_buffer(x=x, proj_ids=proj_ids, batch=batch, backend=backend)
    lora_shrink(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, out=xa, backend=backend)
    y = torch.full((30, sum(widths)), float("nan"))
    lora_expand(xa=xa, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=y, out_offsets=[0, 64, 96], backend=backend, accumulate=False)
    want = _want(modules, slots, x, 0, proj_ids, widths, torch.zeros(30, sum(widths)))
    live = slots >= 0
    assert float((y[live].double() - want[live]).norm() / want[live].norm()) < 2e-4
    assert torch.isnan(y[~live]).all()


def _small():
    a, b = torch.ones(4, 32), torch.ones(16, 4)
    layout = pack_lora_layout({(0, 0, 0): (a, b, 1.0), (1, 0, 1): (a, b, 1.0)}, num_layers=1, max_slots=2, page_elems=64, dtype=torch.float32)
    batch = make_lora_batch(torch.tensor([0, 1, -1, 0], dtype=torch.int32), layout.max_rank_by_slot())
    return layout, batch


@pytest.mark.parametrize("backend", BACKENDS)
def test_launchers_refuse_bad_layer_proj_ids_and_x(backend):
    layout, batch = _small()
    x, y = torch.randn(4, 32), torch.zeros(4, 32)
    args = dict(x=x, layout=layout, layer=0, proj_ids=[0, 1], batch=batch, y=y, out_offsets=[0, 16], backend=backend)
    with pytest.raises(ValueError, match="layer 0.0 outside .* not an int"):
        lora_delta(**{**args, "layer": 0.0})
    with pytest.raises(ValueError, match="proj_ids"):
        lora_delta(**{**args, "proj_ids": torch.tensor([0, 1])})
    with pytest.raises(ValueError, match=r"(shrink_buffer|lora_delta): x must be \[T"):  # lora_delta: the CPU's host path
        lora_delta(**{**args, "x": x[0]})
    with pytest.raises(ValueError, match=r"shrink_buffer: x must be \[T, K\]"):
        shrink_buffer(x=x[0], proj_ids=[0], batch=batch, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_launchers_refuse_strided_or_inconsistent_batch_tensors(backend):
    layout, batch = _small()
    args = dict(x=torch.randn(4, 32), layout=layout, layer=0, proj_ids=[0, 1], batch=batch, y=torch.zeros(4, 32), out_offsets=[0, 16], backend=backend)
    # A strided view of the token ids was read with stride 1 by the Triton kernels (silently wrong deltas).
    strided = torch.stack([batch.sorted_token_ids, batch.sorted_token_ids], 1)[:, 0]
    with pytest.raises(ValueError, match="batch.sorted_token_ids must be a contiguous 1-D"):
        lora_delta(**{**args, "batch": dataclasses.replace(batch, sorted_token_ids=strided)})
    # One seg_starts entry short: the Triton kernels read past its end.
    with pytest.raises(ValueError, match="seg_starts must hold num_segments"):
        lora_delta(**{**args, "batch": dataclasses.replace(batch, seg_starts=batch.seg_starts[:-1])})
    with pytest.raises(ValueError, match="batch.seg_slots is on meta"):
        lora_delta(**{**args, "batch": dataclasses.replace(batch, seg_slots=batch.seg_slots.to("meta"))})


def test_resolve_backend_takes_a_device_name():
    assert resolve_backend("auto", "cpu") == "reference"
    assert resolve_backend("reference", "cpu") == "reference"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grouped", [True, False])
def test_write_mode_without_adapted_slots_writes_zeros(backend, grouped, gen):
    """A batch whose slots adapt nothing (max_rank 0: every token without an adapter, or only unadapted
    modules) still writes y = delta = 0 for every token in a segment; other rows and columns stay."""
    _, layout = _setup(gen, torch.float32)
    slots = torch.full((7,), -1, dtype=torch.int32)
    slots[::2] = 3
    layout.ranks[:, :, 3] = 0  # slot 3 adapts no module
    batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped)
    assert batch.max_rank == 0
    y = torch.full((7, 100), float("nan"))
    xa = torch.zeros(1, 1, 7, 1)
    lora_expand(xa=xa, layout=layout, layer=1, proj_ids=[3], batch=batch, y=y, out_offsets=[10, 74], backend=backend, accumulate=False)
    covered = torch.ones(7, dtype=torch.bool) if not grouped else slots >= 0
    assert not y[covered, 10:74].any() and y[~covered].isnan().all()
    assert y[:, :10].isnan().all() and y[:, 74:].isnan().all()
    # A graph-shaped batch pads its token list past the last segment with token 0: that row is in no segment
    # and stays as it is, as the kernels leave it when some slot adapts.
    padded = dataclasses.replace(batch, sorted_token_ids=torch.cat([batch.sorted_token_ids[1:],
                                                                    torch.zeros(1, dtype=torch.int32)]),
                                 seg_starts=batch.seg_starts.clamp(max=batch.sorted_token_ids.numel() - 1))
    y = torch.full((7, 100), float("nan"))
    lora_expand(xa=xa, layout=layout, layer=1, proj_ids=[3], batch=padded, y=y, out_offsets=[10, 74], backend=backend,
                accumulate=False)
    assert y[0].isnan().all() and not y[padded.sorted_token_ids[:-1].long(), 10:74].any()


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_cpu_host_path_matches_the_general_one(popularity, accumulate, dtype, gen, monkeypatch):
    """On CPU a batch of few adapters goes adapter by adapter (lora_reference.lora_delta_host, views of the pool
    where rows follow one another, a copy where pages split them); it must give what the general path gives:
    the same rows written (write mode: every segment token, zeros where no module is adapted; NaN left where
    no segment covers a token), the same values to float32 rounding (in float16: the delta is summed in float32
    on both paths, and rounded once, so they agree to float16's rounding; a host path summing in float16 did not)."""
    from lorafleet.kernels import lora_reference

    modules, layout = _setup(gen, dtype, num_slots=6)
    for grouped, num_tokens in ((True, 24), (False, 7), (True, 1)):
        slots = token_slots(popularity, num_tokens, 6, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=5)
        for proj_ids, k, widths in GROUPS.values():
            x = torch.randn(num_tokens, k, generator=gen).to(dtype)
            y0 = (torch.randn(num_tokens, sum(widths), generator=gen) if accumulate
                  else torch.full((num_tokens, sum(widths)), float("nan"))).to(dtype)
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            got = {}
            for most in (0, 64):  # 0: every batch takes the general path; 64: every one the host path
                monkeypatch.setattr(lora_reference, "HOST_SLOTS_MAX", most)
                y = y0.clone()
                lora_delta(x=x, layout=layout, layer=1, proj_ids=proj_ids, batch=dataclasses.replace(batch), y=y,
                           out_offsets=offsets, backend="reference", accumulate=accumulate)
                got[most] = y
            assert torch.equal(got[0].isnan(), got[64].isnan())
            general, host = got[0].nan_to_num(), got[64].nan_to_num()
            # float32: to its rounding of each value and of the largest (sums that cancel); float16: rounded once
            # from float32 sums on both paths, each value to its own rounding (one summed in float16 is not)
            atol = 1e-5 * float(general.abs().max()) if dtype == torch.float32 else 1e-3
            assert torch.allclose(general, host, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=atol)
            want = _want(modules, slots, x, 1, proj_ids, widths, y0.nan_to_num() if accumulate else torch.zeros_like(y0))
            live = slots >= 0
            error = float((got[64][live].double() - want[live]).norm() / max(float(want[live].norm()), 1e-9))
            assert error < TOL[dtype]
