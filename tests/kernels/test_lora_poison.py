"""The LoRA kernels read only what they should and write only what they should.

Pools are NaN wherever no live adapter row lies, and every row offset past a module's rank points at a
NaN page (kernel_cases.poisoned_layout); inputs of tokens without an adapter, shrink partial sums past a
rank and outputs are NaN too. A kernel that pads to the batch's largest rank, reads a row past its end
or touches a token it should skip shows NaN. The expand's write mode (y = delta) is checked over every
adapter popularity: the adapted slices get their delta, the rest of a segment's row exact zeros.
"""

import pytest
import torch
import torch.nn.functional as F

from lorafleet.kernels.lora import lora_delta, lora_silu_mul, lora_xa
from lorafleet.kernels.lora_layout import make_lora_batch
from tests.kernels.kernel_cases import (
    POPULARITIES,
    SMALL_DIMS,
    SMALL_GROUPS,
    dense_delta,
    hand_built_batch,
    poisoned_layout,
    small_layout,
    token_slots,
)

BACKENDS = ["reference", "triton"]
TOL = {torch.float32: 2e-4, torch.float16: 3e-3}
NAN = float("nan")


def _offsets(widths: list[int]) -> list[int]:
    return [sum(widths[:i]) for i in range(len(widths))]


def _adapted(modules, slots: torch.Tensor, layer: int, proj: int) -> torch.Tensor:
    """bool [T]: the token's slot adapts this module."""
    return torch.tensor([s >= 0 and (s, layer, proj) in modules for s in slots.tolist()], dtype=torch.bool)


def check_write_mode(modules, layout, slots, batch, group: str, layer: int, backend: str, dtype, gen, groups=SMALL_GROUPS) -> None:
    """lora_delta(accumulate=False) into a NaN-filled y, x NaN for tokens without an adapter: every token
    in a segment gets exactly its delta, and zeros in a slice its slot does not adapt; others keep NaN."""
    proj_ids, k, widths = groups[group]
    x = torch.randn(slots.shape[0], k, generator=gen).to(dtype)
    x[slots < 0] = NAN  # never read: no adapter
    y = torch.full((slots.shape[0], sum(widths)), NAN, dtype=dtype)
    lora_delta(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_offsets=_offsets(widths), backend=backend, accumulate=False)
    covered = torch.zeros(slots.shape[0], dtype=torch.bool)
    covered[batch.sorted_token_ids.long()] = True
    assert torch.isnan(y[~covered]).all(), group  # in no segment: not written
    assert not torch.isnan(y[covered]).any(), group
    for proj, start, n in zip(proj_ids, _offsets(widths), widths, strict=True):
        cols = slice(start, start + n)
        live = _adapted(modules, slots, layer, proj) & covered
        assert (y[covered & ~live, cols] == 0).all(), (group, proj)  # slot -1 or a module left alone: exact zeros
        if live.any():
            want = dense_delta(modules, slots, x.float().nan_to_num(), layer, proj, n)[live]
            got = y[live, cols].double()
            assert float((got - want).norm() / want.norm()) < TOL[dtype], (group, proj)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_mode_over_every_popularity(backend, popularity, dtype, gen):
    """Grouped (segments of up to 5 tokens) and per-token batches, unequal slices, ranks 1-128 mixed."""
    modules, layout = small_layout(gen, dtype=dtype)
    for grouped, num_tokens in ((True, 17), (False, 5)):
        slots = token_slots(popularity, num_tokens, 10, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=5)
        for group in ("qkv", "gate_up", "down"):  # o is down's shape with a narrower K
            check_write_mode(modules, layout, slots, batch, group, 1, backend, dtype, gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("popularity", POPULARITIES)
def test_nothing_but_each_adapters_true_rank_rows_is_read(backend, popularity, gen):
    """A poisoned pool (and, without any adapter in the step, an all-NaN pool: slot -1 costs no read)
    gives the dense answer in both modes; tokens without an adapter keep y exactly."""
    modules, clean = small_layout(gen, dtype=torch.float32)
    layout = poisoned_layout(clean, SMALL_DIMS)
    if popularity == "all_none":
        layout.pool.fill_(NAN)
    for grouped, num_tokens in ((True, 21), (False, 6)):
        slots = token_slots(popularity, num_tokens, 10, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=8)
        check_write_mode(modules, layout, slots, batch, "qkv", 0, backend, torch.float32, gen)
        proj_ids, k, widths = SMALL_GROUPS["down"]
        x = torch.randn(num_tokens, k, generator=gen)
        x[slots < 0] = NAN
        y0 = torch.randn(num_tokens, sum(widths), generator=gen)
        y = y0.clone()
        lora_delta(x=x, layout=layout, layer=0, proj_ids=proj_ids, batch=batch, y=y, out_offsets=[0], backend=backend)
        want = y0.double() + dense_delta(modules, slots, x.nan_to_num(), 0, proj_ids[0], widths[0])
        assert not torch.isnan(y).any()
        assert float((y.double() - want).norm() / want.norm()) < 2e-4
        assert torch.equal(y[slots < 0], y0[slots < 0])


ACT_DIMS = {4: (64, 80), 5: (64, 80)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("popularity", ["distinct", "zipf", "identical", "mixed_none", "all_none"])
def test_folded_activation_reads_only_live_rows(backend, popularity, gen):
    """lora_silu_mul over a poisoned pool, with gate|up NaN for tokens in no segment and out NaN-filled."""
    modules, clean = small_layout(gen, dtype=torch.float32, dims=ACT_DIMS)
    layout = poisoned_layout(clean, ACT_DIMS)
    for grouped, num_tokens in ((True, 19), (False, 6)):
        slots = token_slots(popularity, num_tokens, 10, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=6)
        covered = slots >= 0 if grouped else torch.ones(num_tokens, dtype=torch.bool)
        x = torch.randn(num_tokens, 64, generator=gen)
        x[slots < 0] = NAN
        gate_up = torch.randn(num_tokens, 160, generator=gen)
        gate_up[~covered] = NAN
        xa = lora_xa(x=x, layout=layout, layer=1, proj_ids=[4, 5], batch=batch, backend=backend)
        out = torch.full((num_tokens, 80), NAN)
        lora_silu_mul(gate_up=gate_up, xa=xa, layout=layout, layer=1, batch=batch, out=out, backend=backend)
        x0 = x.nan_to_num()
        want = F.silu(gate_up[:, :80].double() + dense_delta(modules, slots, x0, 1, 4, 80)) * (gate_up[:, 80:].double() + dense_delta(modules, slots, x0, 1, 5, 80))
        assert torch.isnan(out[~covered]).all()
        if covered.any():
            assert not torch.isnan(out[covered]).any()
            assert float((out[covered].double() - want[covered]).norm() / want[covered].norm()) < 2e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_without_tokens(backend, gen):
    modules, layout = small_layout(gen, dtype=torch.float32, num_slots=3, dims=ACT_DIMS)
    for grouped in (True, False):
        batch = make_lora_batch(torch.empty(0, dtype=torch.int32), layout.max_rank_by_slot(), grouped=grouped)
        x, y = torch.empty(0, 64), torch.empty(0, 160)
        for accumulate in (True, False):
            lora_delta(x=x, layout=layout, layer=0, proj_ids=[4, 5], batch=batch, y=y, out_offsets=[0, 80], backend=backend, accumulate=accumulate)
        xa = lora_xa(x=x, layout=layout, layer=0, proj_ids=[4, 5], batch=batch, backend=backend)
        lora_silu_mul(gate_up=y, xa=xa, layout=layout, layer=0, batch=batch, out=torch.empty(0, 80), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_empty_segments_in_the_delta_and_the_folded_activation(backend, dtype, gen):
    """A hand-built batch with segments of 0, 1, 3 and 40 tokens (the 40 over several token tiles) and
    tokens in no segment: lora_delta in both modes and lora_silu_mul."""
    modules, layout = small_layout(gen, dtype=dtype, num_slots=6, dims={**SMALL_DIMS, 5: (64, 96)}, skip_prob=0.0)
    lengths, seg_slots = [0, 40, 1, 0, 3, 1, 0], [4, 0, 5, 1, 2, 3, 1]
    max_rank = int(layout.max_rank_by_slot()[[s for s, n in zip(seg_slots, lengths, strict=True) if n]].max())
    slots, batch = hand_built_batch(lengths, seg_slots, 4, gen, max_rank)
    groups = {**SMALL_GROUPS, "gate_up": ([4, 5], 64, [96, 96])}
    for group in ("qkv", "gate_up"):
        check_write_mode(modules, layout, slots, batch, group, 1, backend, dtype, gen, groups)
    x = torch.randn(slots.shape[0], 64, generator=gen).to(dtype)
    gate_up = torch.randn(slots.shape[0], 192, generator=gen).to(dtype)
    xa = lora_xa(x=x, layout=layout, layer=1, proj_ids=[4, 5], batch=batch, backend=backend)
    out = torch.full((slots.shape[0], 96), NAN, dtype=dtype)
    lora_silu_mul(gate_up=gate_up, xa=xa, layout=layout, layer=1, batch=batch, out=out, backend=backend)
    g = gate_up[:, :96].double() + dense_delta(modules, slots, x.float(), 1, 4, 96)
    u = gate_up[:, 96:].double() + dense_delta(modules, slots, x.float(), 1, 5, 96)
    live = slots >= 0
    assert torch.isnan(out[~live]).all() and not torch.isnan(out[live]).any()
    want = (F.silu(g) * u)[live]
    assert float((out[live].double() - want).norm() / want.norm()) < TOL[dtype]
