"""lora_silu_mul (the MLP activation with the gate|up delta folded in) against dense answers, on both
backends (Triton through its interpreter on CPU; on a GPU with the gpu marker), and its input checks."""

import pytest
import torch
import torch.nn.functional as F

from lorafleet.kernels.lora import lora_silu_mul, lora_xa
from lorafleet.kernels.lora_layout import make_lora_batch, pack_lora_layout
from tests.kernels.kernel_cases import MIXED_RANKS, POPULARITIES, dense_delta, random_adapters, token_slots

INTER = 80
DIMS = {4: (64, INTER), 5: (64, INTER)}
TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _setup(gen, dtype, device="cpu", ranks=MIXED_RANKS, dims=DIMS):
    modules = random_adapters(num_slots=10, num_layers=2, dims=dims, gen=gen, ranks=ranks)
    modules = {key: (a.to(dtype).float(), b.to(dtype).float(), s) for key, (a, b, s) in modules.items()}
    widest = max(n for _, n in dims.values())
    order = torch.randperm(4000, generator=gen) if widest <= 300 else None  # small: shuffled pages; Llama widths: as many as needed
    layout = pack_lora_layout(modules, num_layers=2, max_slots=10, page_elems=max(300, widest), dtype=dtype, device=device,
                              num_pages=4000 if order is not None else None, page_order=order)
    return modules, layout


def _run(modules, layout, slots, batch, dtype, backend, gen, inter=INTER, k=64):
    device = layout.pool.device
    x = torch.randn(slots.shape[0], k, generator=gen).to(dtype)
    gate_up = torch.randn(slots.shape[0], 2 * inter, generator=gen).to(dtype)
    xa = lora_xa(x=x.to(device), layout=layout, layer=1, proj_ids=[4, 5], batch=batch, backend=backend)
    out = torch.full((slots.shape[0], inter), float("nan"), dtype=dtype, device=device)
    lora_silu_mul(gate_up=gate_up.to(device), xa=xa, layout=layout, layer=1, batch=batch, out=out, backend=backend)
    g = gate_up[:, :inter].double() + dense_delta(modules, slots, x, 1, 4, inter)
    u = gate_up[:, inter:].double() + dense_delta(modules, slots, x, 1, 5, inter)
    return out.cpu(), F.silu(g) * u


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_dense(backend, popularity, dtype, gen):
    """Every token in a segment gets silu(g + dg) * (u + du), ranks 1-128 mixed, modules left unadapted
    included; a grouped batch leaves tokens without a slot untouched, a per-token one covers them."""
    modules, layout = _setup(gen, dtype)
    for grouped, num_tokens in ((True, 30), (False, 9)):
        slots = token_slots(popularity, num_tokens, 10, gen)
        batch = make_lora_batch(slots, layout.max_rank_by_slot(), grouped=grouped, max_segment_len=7)
        got, want = _run(modules, layout, slots, batch, dtype, backend, gen)
        covered = torch.ones_like(slots, dtype=torch.bool) if not grouped else slots >= 0
        if covered.any():
            err = float((got[covered].double() - want[covered]).norm() / want[covered].norm())
            assert not torch.isnan(got[covered]).any() and err < TOL[dtype], err
        assert torch.isnan(got[~covered]).all()


def test_silu_mul_checks_its_inputs(gen):
    modules, layout = _setup(gen, torch.float32)
    slots = token_slots("uniform", 6, 10, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    xa = torch.zeros(1, 2, 6, batch.max_rank)
    good = {"gate_up": torch.zeros(6, 2 * INTER), "xa": xa, "layout": layout, "layer": 0, "batch": batch, "out": torch.zeros(6, INTER)}
    lora_silu_mul(**good)
    bad = [
        ({"gate_up": torch.zeros(6, 2 * INTER + 1)}, "gate_up must be"),
        ({"gate_up": torch.zeros(2 * INTER, 6).t()}, "gate_up must be"),
        ({"out": torch.zeros(5, INTER)}, "out must be"),
        ({"out": torch.zeros(6, INTER, dtype=torch.float16), "gate_up": torch.zeros(6, 2 * INTER, dtype=torch.float16)}, "adapter pool"),
        ({"xa": torch.zeros(1, 3, 6, batch.max_rank)}, "xa must be"),
        ({"layer": 2}, "layer 2"),
        ({"out": torch.zeros(6, INTER, device="meta")}, "share a device"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            lora_silu_mul(**{**good, **change})
    _, wide = _setup(gen, torch.float32, ranks=(200,), dims={4: (64, 400), 5: (64, 400)})  # rank 200, above the Triton kernel's 128 (rows over 300 wide: pages as needed)
    big = make_lora_batch(slots, wide.max_rank_by_slot())
    args = {**good, "layout": wide, "batch": big, "xa": torch.zeros(1, 2, 6, 200)}
    with pytest.raises(ValueError, match="ranks up to 128"):
        lora_silu_mul(**args, backend="triton")
    lora_silu_mul(**args, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [(16,), (8, 16, 32, 64), MIXED_RANKS])
def test_silu_mul_on_gpu_at_llama_width(ranks, gen):
    """bf16 on the GPU, Llama-3-8B's intermediate width, a prefill-like batch (64-token segments)."""
    inter = 14336
    modules, layout = _setup(gen, torch.bfloat16, device="cuda", ranks=ranks, dims={4: (256, inter), 5: (256, inter)})
    for popularity in ("uniform", "mixed_none", "identical"):
        slots = token_slots(popularity, 300, 10, gen)
        batch = make_lora_batch(slots.cuda(), layout.max_rank_by_slot(), max_segment_len=64)
        got, want = _run(modules, layout, slots, batch, torch.bfloat16, "triton", gen, inter=inter, k=256)
        live = slots >= 0
        if live.any():
            err = float((got[live].double() - want[live]).norm() / want[live].norm())
            assert not torch.isnan(got[live]).any() and err < TOL[torch.bfloat16], (popularity, err)
        assert torch.isnan(got[~live]).all()  # rows in no segment: untouched



def test_partial_sums_in_uneven_groups(gen, monkeypatch):
    """Ranks up to 128 with 3 or 6 partial sums: the expand and the folded activation sum them in groups
    of at most XA_TILE elements, the last group partial (split counts need not be powers of two)."""
    from lorafleet.kernels.lora import lora_expand
    from lorafleet.kernels.lora_reference import lora_expand_reference

    modules, layout = _setup(gen, torch.float32)
    slots = token_slots("uniform", 40, 10, gen)
    batch = make_lora_batch(slots, layout.max_rank_by_slot())
    assert batch.max_rank == 128
    for splits in (3, 6):
        xa = torch.randn(splits, 2, 40, batch.max_rank, generator=gen)
        gate_up = torch.randn(40, 2 * INTER, generator=gen)
        want, got = gate_up.clone(), gate_up.clone()
        lora_expand_reference(xa=xa, layout=layout, layer=1, proj_ids=[4, 5], batch=batch, y=want, out_slices=[(0, INTER), (INTER, INTER)])
        lora_expand(xa=xa, layout=layout, layer=1, proj_ids=[4, 5], batch=batch, y=got, out_offsets=[0, INTER], backend="triton")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        act_want, act_got = torch.zeros(40, INTER), torch.zeros(40, INTER)
        lora_silu_mul(gate_up=gate_up, xa=xa, layout=layout, layer=1, batch=batch, out=act_want, backend="reference")
        lora_silu_mul(gate_up=gate_up, xa=xa, layout=layout, layer=1, batch=batch, out=act_got, backend="triton")
        torch.testing.assert_close(act_got, act_want, rtol=1e-4, atol=1e-3)
