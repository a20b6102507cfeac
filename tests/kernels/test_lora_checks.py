"""The LoRA launchers refuse what the kernels would read wrongly: dtypes, shapes, strides, devices,
layers, projection ids, slices, and a Triton backend without CUDA or the interpreter."""

import dataclasses

import pytest
import torch

from lorafleet.kernels.lora import lora_delta, lora_expand, lora_shrink, shrink_buffer
from lorafleet.kernels.lora_layout import make_lora_batch
from tests.kernels.kernel_cases import small_layout

BACKENDS = ["reference", "triton"]


def _case(gen):
    _, layout = small_layout(gen, dtype=torch.float32, num_slots=2, ranks=(4,), skip_prob=0.0)
    batch = make_lora_batch(torch.tensor([0, 1, -1], dtype=torch.int32), layout.max_rank_by_slot())
    return layout, batch


def test_launchers_refuse_bad_inputs(gen):
    layout, batch = _case(gen)
    x = torch.randn(3, 64)
    out = torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match="x is torch.float16"):
        lora_shrink(x=x.half(), layout=layout, layer=0, proj_ids=[0], batch=batch, out=out)
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(x=x, layout=layout, layer=0, proj_ids=[0], batch=batch, out=out.half())
    with pytest.raises(ValueError, match="proj_ids"):
        lora_shrink(x=x, layout=layout, layer=0, proj_ids=[7], batch=batch, out=out)
    with pytest.raises(ValueError, match="layer"):
        lora_shrink(x=x, layout=layout, layer=5, proj_ids=[0], batch=batch, out=out)
    with pytest.raises(ValueError, match="x must be"):
        lora_shrink(x=x[:2], layout=layout, layer=0, proj_ids=[0], batch=batch, out=out)
    with pytest.raises(ValueError, match="backend"):
        lora_shrink(x=x, layout=layout, layer=0, proj_ids=[0], batch=batch, out=out, backend="cuda")
    y = torch.zeros(3, 96)
    with pytest.raises(ValueError, match="out_offsets"):
        lora_expand(xa=out, layout=layout, layer=0, proj_ids=[0], batch=batch, y=y, out_offsets=[0, 64, 96])
    with pytest.raises(ValueError, match="out_offsets"):
        lora_expand(xa=out, layout=layout, layer=0, proj_ids=[0], batch=batch, y=y, out_offsets=[90, 100])


SHRINK_REFUSALS = [
    ({"x": torch.randn(64, 3).t()}, r"x must be \[T=3, K\] with a contiguous last dim"),
    ({"x": torch.randn(64)}, r"x must be \[T=3, K\]"),
    ({"x": torch.randn(3, 64, dtype=torch.float64)}, "x is torch.float64, the adapter pool torch.float32"),
    ({"x": torch.randn(3, 64, device="meta")}, "layout.pool is on cpu, the activations on meta"),
    ({"out": torch.zeros(1, 1, 3, 8)[..., ::2]}, "out must be contiguous float32"),
    ({"out": torch.zeros(1, 1, 3, 2)}, r"out must be .*>= 4"),  # fewer rank columns than the batch's max_rank
    ({"out": torch.zeros(1, 2, 3, 4)}, "out must be"),  # two projections' worth for one
    ({"out": torch.zeros(3, 4)}, "out must be"),
    ({"out": torch.zeros(1, 1, 3, 4, device="meta")}, "out is on meta, x on cpu"),
    ({"proj_ids": []}, "proj_ids must be a non-empty list"),
    ({"proj_ids": [True]}, "proj_ids must be a non-empty list"),
    ({"layer": -1}, "layer -1 outside"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", SHRINK_REFUSALS, ids=range(len(SHRINK_REFUSALS)))
def test_shrink_refuses(backend, change, message, gen):
    layout, batch = _case(gen)
    args = {"x": torch.randn(3, 64), "layout": layout, "layer": 0, "proj_ids": [0], "batch": batch, "out": torch.zeros(1, 1, 3, 4), "backend": backend}
    with pytest.raises(ValueError, match=message):
        lora_shrink(**{**args, **change})


EXPAND_REFUSALS = [
    ({"y": torch.zeros(3, 16, dtype=torch.float16)}, "y is torch.float16, the adapter pool torch.float32"),
    ({"y": torch.zeros(2, 16)}, r"y must be \[T=3, N\]"),
    ({"y": torch.zeros(16, 3).t()}, "y must be .* contiguous last dim"),
    ({"y": torch.zeros(3, 16, device="meta")}, "layout.pool is on cpu, the activations on meta"),
    ({"xa": torch.zeros(1, 1, 3, 4, dtype=torch.float16)}, "xa must be contiguous float32"),
    ({"xa": torch.zeros(1, 1, 3, 8)[..., ::2]}, "xa must be contiguous float32"),
    ({"xa": torch.zeros(1, 1, 4, 4)}, "xa must be"),  # one token too many
    ({"xa": torch.zeros(1, 1, 3, 4, device="meta")}, "xa is on meta, y on cpu"),
    ({"out_offsets": [-1]}, "do not give increasing slices"),
    ({"out_offsets": [8, 4], "proj_ids": [0, 1], "xa": torch.zeros(1, 2, 3, 4)}, "do not give increasing slices"),
    ({"out_offsets": [0, 8, 8], "proj_ids": [0, 1], "xa": torch.zeros(1, 2, 3, 4)}, "do not give increasing slices"),  # an empty slice
    ({"out_offsets": [0, 20]}, "do not give increasing slices"),  # past y's 16 columns
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", EXPAND_REFUSALS, ids=range(len(EXPAND_REFUSALS)))
def test_expand_refuses(backend, change, message, gen):
    layout, batch = _case(gen)
    args = {"xa": torch.zeros(1, 1, 3, 4), "layout": layout, "layer": 0, "proj_ids": [0], "batch": batch, "y": torch.zeros(3, 16), "out_offsets": [0],
            "backend": backend}  # fmt: skip
    for accumulate in (True, False):
        with pytest.raises(ValueError, match=message):
            lora_expand(**{**args, **change}, accumulate=accumulate)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_larger_ranks_than_the_layout_is_refused(backend, gen):
    layout, batch = _case(gen)
    big = dataclasses.replace(batch, max_rank=layout.max_rank + 1)
    with pytest.raises(ValueError, match="exceeds the layout's max_rank"):
        lora_delta(x=torch.randn(3, 64), layout=layout, layer=0, proj_ids=[0], batch=big, y=torch.zeros(3, 16), out_offsets=[0], backend=backend)


def test_triton_on_cpu_needs_the_interpreter(gen, monkeypatch):
    layout, batch = _case(gen)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        shrink_buffer(x=x, proj_ids=[0], batch=batch, backend="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        lora_shrink(x=x, layout=layout, layer=0, proj_ids=[0], batch=batch, out=torch.zeros(1, 1, 3, 4), backend="triton")
    lora_delta(x=x, layout=layout, layer=0, proj_ids=[0], batch=batch, y=torch.zeros(3, 16), out_offsets=[0], backend="auto")  # auto: the reference


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layout_recording_its_widths_refuses_activations_of_other_widths(backend, gen):
    """The adapter pool's layout records each projection's (in, out) features: an x of another K (which would
    read A rows at the wrong pool elements) or an output slice of another width is refused, naming both."""
    layout, batch = _case(gen)
    layout = dataclasses.replace(layout, widths=((64, 48), (64, 16), (64, 16), (48, 64), (64, 96), (64, 96), (96, 64)))
    out = torch.zeros(1, 2, 3, 4)
    lora_shrink(x=torch.randn(3, 64), layout=layout, layer=0, proj_ids=[0, 1], batch=batch, out=out, backend=backend)
    with pytest.raises(ValueError, match=r"x's K \[63, 63\] are not the adapters' \[64, 64\] for projections \[0, 1\]"):
        lora_shrink(x=torch.randn(3, 63), layout=layout, layer=0, proj_ids=[0, 1], batch=batch, out=out, backend=backend)
    y = torch.zeros(3, 64)
    lora_expand(xa=out, layout=layout, layer=0, proj_ids=[0, 1], batch=batch, y=y, out_offsets=[0, 48], backend=backend)
    with pytest.raises(ValueError, match=r"slices' widths \[40, 24\] are not the adapters' \[48, 16\]"):
        lora_expand(xa=out, layout=layout, layer=0, proj_ids=[0, 1], batch=batch, y=y, out_offsets=[0, 40], backend=backend)
    with pytest.raises(ValueError, match="7 positive"):
        dataclasses.replace(layout, widths=((64, 48),))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_above_the_batchs_bound_are_cut_to_it_on_every_backend(backend, gen):
    """A slot whose rank is above batch.max_rank (a host-side bound that was wrong) gets the delta of its first
    batch.max_rank rows on both backends, and nothing is written past the xa buffer (which holds that many rows
    per token): the other tokens' deltas are exact. A captured decode graph's bound comes from host bookkeeping;
    a mistake there must not corrupt a neighbour's output."""
    from lorafleet.kernels.lora import lora_silu_mul, lora_xa
    from tests.kernels.kernel_cases import SMALL_DIMS

    _, layout = small_layout(gen, dtype=torch.float32, num_slots=3, ranks=(40,), skip_prob=0.0)
    _, small = small_layout(gen, dtype=torch.float32, num_slots=3, ranks=(8,), skip_prob=0.0)
    layout.ranks[:, :, 0] = small.ranks[:, :, 0].clamp(max=8)  # slot 0: rank 8 (its first 8 rows), slot 1: rank 40
    # Token 0 (slot 1) is followed by slot 0's tokens, whose segment the kernels run first: rows of token 0
    # written past the buffer's 16 would land on theirs.
    slots = torch.tensor([1, 0, 0, 1, -1, 0], dtype=torch.int32)
    exact = make_lora_batch(slots, layout.max_rank_by_slot())
    cut = dataclasses.replace(exact, max_rank=16)
    x = torch.randn(len(slots), SMALL_DIMS[0][0], generator=gen)
    widths = [SMALL_DIMS[p][1] for p in (0, 1, 2)]
    offsets = [0, widths[0], widths[0] + widths[1]]
    deltas = {}
    for name, batch in (("exact", exact), ("cut", cut)):
        y = torch.zeros(len(slots), sum(widths))
        lora_delta(x=x, layout=layout, layer=0, proj_ids=[0, 1, 2], batch=batch, y=y, out_offsets=offsets, backend=backend)
        deltas[name] = y
    truncated = dataclasses.replace(layout, ranks=layout.ranks.clamp(max=16))
    want = torch.zeros(len(slots), sum(widths))
    lora_delta(x=x, layout=truncated, layer=0, proj_ids=[0, 1, 2], batch=exact, y=want, out_offsets=offsets, backend="reference")
    rank8 = slots == 0
    torch.testing.assert_close(deltas["cut"][rank8], deltas["exact"][rank8])  # the rank-8 tokens: untouched by the cut
    torch.testing.assert_close(deltas["cut"], want, rtol=1e-4, atol=1e-4)
    inter = SMALL_DIMS[4][1]
    gate_up = torch.randn(len(slots), 2 * inter, generator=gen)
    acts = []
    for lay, batch in ((layout, cut), (truncated, exact)):
        xa = lora_xa(x=torch.randn(len(slots), SMALL_DIMS[4][0], generator=torch.Generator().manual_seed(1)), layout=lay, layer=0, proj_ids=[4, 5],
                     batch=batch, backend=backend)  # fmt: skip
        out = torch.zeros(len(slots), inter)
        lora_silu_mul(gate_up=gate_up, xa=xa, layout=lay, layer=0, batch=batch, out=out, backend=backend)
        acts.append(out)
    torch.testing.assert_close(acts[0], acts[1], rtol=1e-4, atol=1e-4)


def test_an_int64_slot_past_int32_is_refused_not_wrapped():
    """make_lora_batch checks the slots before its cast to int32, which would wrap 2**32 into slot 0 and
    2**32 - 1 into -1 (no adapter): a silent wrong batch."""
    ranks = torch.tensor([8, 8], dtype=torch.int32)
    for slots in ([2**32, 1, 0], [2**32 - 1, 0], [-(2**32) - 1]):
        with pytest.raises(ValueError, match="max_slots|>= -1"):
            make_lora_batch(torch.tensor(slots, dtype=torch.int64), ranks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_no_slot_adapts_wider_than_the_pool_adds_nothing_on_every_backend(backend):
    """q_proj alone is adapted (16 x 16, rank 1: a pool of 32 elements); v_proj's slice, 64 wide, has no slot
    adapting it. Its rows are read by no backend (the reference used to index past the pool) and it stays as
    it was, while q_proj gets its delta."""
    from lorafleet.kernels.lora_layout import pack_lora_layout

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 16, generator=g), torch.randn(16, 1, generator=g)
    layout = pack_lora_layout({(0, 0, 0): (a, b, 2.0)}, num_layers=1, max_slots=1, page_elems=32, dtype=torch.float32)
    assert layout.pool.numel() < 64
    batch = make_lora_batch(torch.tensor([0, 0], dtype=torch.int32), layout.max_rank_by_slot())
    x, y = torch.randn(2, 16, generator=g), torch.ones(2, 16 + 64)
    lora_delta(x=x, layout=layout, layer=0, proj_ids=[0, 2], batch=batch, y=y, out_offsets=[0, 16], backend=backend)
    torch.testing.assert_close(y[:, :16], 1 + 2.0 * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[:, 16:], torch.ones(2, 64))


def test_triton_takes_only_the_dtypes_its_dots_and_accumulators_do(gen):
    """float64 (or float8) data is refused by backend='triton' with a clear error (a GPU compile would fail on
    a loop-carried float32 accumulator); 'auto' picks the reference for it."""
    from lorafleet.kernels.lora import resolve_backend

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert resolve_backend("triton", "cpu", dtype) == "triton"
    with pytest.raises(ValueError, match="takes float16, bfloat16 or float32 data, got torch.float64"):
        resolve_backend("triton", "cpu", torch.float64)
    assert resolve_backend("auto", "cpu", torch.float64) == "reference"
    layout, batch = _case(gen)
    layout = dataclasses.replace(layout, pool=layout.pool.double())
    x = torch.randn(3, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="got torch.float64"):
        lora_shrink(x=x, layout=layout, layer=0, proj_ids=[0], batch=batch, out=torch.zeros(1, 1, 3, 4), backend="triton")
