"""Randomized kernel property: on any segment layout, lora_delta (shrink then expand, adding to y or writing it) and
lora_xa + lora_silu_mul give the float64 dense answer, each token with its own adapter's scale * (x @ A.T) @ B.T,
on the reference backend and on Triton (its interpreter on CPU); rows in no segment come back bit for bit.

test_lora.py, test_lora_delta.py and test_lora_act.py fix the widths (multiples of 16) and draw token slots by
adapter popularity. A mixed batch of real adapters has more shapes than those: here each seed draws odd widths
(K and N from 8 to 136, not multiples of 16), one to nine adapters plus an empty slot, ranks 1 to 128 mixed within
an adapter, modules left unadapted, rsLoRA scales on odd slots, pages from the widest row to 512 elements with
spare pages shuffled; then batches made by make_lora_batch (grouped or one segment a token, segments cut at 1 to
64 tokens, tokens without an adapter) or by hand (empty segments, one slot's tokens in several non-adjacent
segments, slot -1 segments, tokens in no segment). Every fused group the model calls (q|k|v, o, gate|up, down)
and two it does not (k alone, v|up) is checked on each.

LORAFLEET_FUZZ_SEEDS=0,1,2,... runs other seeds on both backends (a longer local sweep).
"""

import os
import random

import pytest
import torch
import torch.nn.functional as F

from lorafleet.kernels.lora import lora_delta, lora_silu_mul, lora_xa
from lorafleet.kernels.lora_layout import make_lora_batch, pack_lora_layout
from tests.kernels.kernel_cases import dense_delta, hand_built_batch, random_adapters

# The Triton interpreter takes 3 to 45 s a seed on 2 cores: its default seeds are among the cheaper ones, which still
# hold hand-built and grouped batches, widths 40 to 136 and ranks up to 128.
_SWEEP = os.environ.get("LORAFLEET_FUZZ_SEEDS")
SEEDS = {backend: [int(s) for s in _SWEEP.split(",") if s] if _SWEEP else default
         for backend, default in (("reference", list(range(24))), ("triton", [0, 3, 7, 9]))}
RANKS = (1, 2, 3, 5, 8, 16, 17, 31, 33, 64, 65, 100, 127, 128)
NUM_LAYERS = 2
NUM_BATCHES = 4


def draw_layout(seed: int):
    """(rng, gen, dims by projection id, modules, layout, number of adapters) of one seed."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hidden, kv = rng.choice([24, 40, 64, 72, 100]), rng.choice([8, 24, 32, 40])
    q, inter = rng.choice([hidden, 48, 56]), rng.choice([40, 80, 100, 136])
    dims = {0: (hidden, q), 1: (hidden, kv), 2: (hidden, kv), 3: (q, hidden), 4: (hidden, inter), 5: (hidden, inter),
            6: (inter, hidden)}
    num_slots = rng.randint(1, 9)
    modules = random_adapters(num_slots=num_slots, num_layers=NUM_LAYERS, dims=dims, gen=gen, ranks=RANKS,
                              skip_prob=rng.choice([0.0, 0.25, 0.5]))
    widest = max(max(k, n) for k, n in dims.values())
    pack = dict(modules=modules, num_layers=NUM_LAYERS, max_slots=num_slots + 2, dtype=torch.float32,
                page_elems=rng.choice([widest, widest + 7, 2 * widest + 3, 512]))
    num_pages = pack_lora_layout(**pack).pool.shape[0] + rng.randint(0, 20)
    layout = pack_lora_layout(**pack, num_pages=num_pages, page_order=torch.randperm(num_pages, generator=gen))
    return rng, gen, dims, modules, layout, num_slots


def draw_batch(rng: random.Random, gen: torch.Generator, layout, num_slots: int):
    """(how it was made, token slots [T], LoRABatch): by make_lora_batch (grouped or not) or by hand."""
    kind = rng.choice(["grouped", "ungrouped", "hand", "hand"])
    mr = layout.max_rank_by_slot()
    if kind != "hand":
        num_tokens, p_none = rng.choice([1, 2, 5, 17, 40, 65, 90]), rng.choice([0.0, 0.3, 0.5, 1.0])
        slots = torch.tensor([-1 if rng.random() < p_none else rng.randrange(num_slots + 1) for _ in range(num_tokens)],
                             dtype=torch.int32)  # slot num_slots: an empty one
        batch = make_lora_batch(slots, mr, grouped=kind == "grouped", max_segment_len=rng.choice([None, 1, 3, 16, 64]))
        return kind, slots, batch
    lengths = [rng.choice([0, 0, 1, 2, 7, 16, 30]) for _ in range(rng.randint(1, 10))]
    seg_slots = [rng.choice([-1, *range(num_slots + 1)]) for _ in lengths]
    num_without = rng.choice([0, 0, 3])
    if sum(lengths) + num_without == 0:
        lengths[0] = 1
    used = [s for s, n in zip(seg_slots, lengths, strict=True) if s >= 0 and n]
    slots, batch = hand_built_batch(lengths, seg_slots, num_without, gen, int(mr[used].max()) if used else 0)
    batch.every_token = num_without == 0  # a write-mode expand then skips zeroing the rows of no segment
    return kind, slots, batch


def groups(dims) -> dict[str, tuple[list[int], int, list[int]]]:
    """name -> (projection ids, K, output widths) of the fused groups the model calls, and two it does not."""
    return {"qkv": ([0, 1, 2], dims[0][0], [dims[0][1], dims[1][1], dims[2][1]]), "o": ([3], dims[3][0], [dims[3][1]]),
            "gate_up": ([4, 5], dims[4][0], [dims[4][1], dims[5][1]]), "down": ([6], dims[6][0], [dims[6][1]]),
            "k_only": ([1], dims[1][0], [dims[1][1]]), "v_up": ([2, 5], dims[2][0], [dims[2][1], dims[5][1]])}


def wrong(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why got is not want (float64) within 1e-4 of its largest entry (at least 1); None where it is."""
    if not torch.isfinite(got).all():
        return "not finite"
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    bound = 1e-4 * max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    return None if err <= bound else f"off by {err:.2e} (bound {bound:.2e})"


def delta_failures(modules, layout, batch, slots, dims, rng, gen, backend) -> list[str]:
    """lora_delta of every group, adding to y and writing it, against the dense answer."""
    in_seg = torch.zeros(slots.shape[0], dtype=torch.bool)
    in_seg[batch.sorted_token_ids[: int(batch.seg_starts[-1])].long()] = True
    served = torch.where(in_seg, slots, -1)  # a token in no segment gets no delta, whatever its slot
    fails = []
    for name, (proj_ids, k, widths) in groups(dims).items():
        layer = rng.randrange(NUM_LAYERS)
        x = torch.randn(slots.shape[0], k, generator=gen)
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        delta = torch.cat([dense_delta(modules, served, x, layer, p, n)
                           for p, n in zip(proj_ids, widths, strict=True)], dim=1)
        for accumulate in (True, False):
            y0 = torch.randn(slots.shape[0], sum(widths), generator=gen)
            y = y0.clone()
            lora_delta(x=x, layout=layout, layer=layer, proj_ids=proj_ids, batch=batch, y=y, out_offsets=offsets,
                       backend=backend, accumulate=accumulate)
            want = torch.where(in_seg[:, None], delta + y0.double() if accumulate else delta, y0.double())
            if why := wrong(y, want):
                fails.append(f"{name} layer {layer} accumulate={accumulate}: {why}")
            if not torch.equal(y[~in_seg], y0[~in_seg]):
                fails.append(f"{name} layer {layer} accumulate={accumulate}: a row in no segment changed")
    return fails


def silu_mul_failures(modules, layout, batch, slots, dims, rng, gen, backend) -> list[str]:
    """silu(gate + delta) * (up + delta) on the rows of a segment, against the dense answer."""
    if batch.max_rank == 0:
        return []
    in_seg = torch.zeros(slots.shape[0], dtype=torch.bool)
    in_seg[batch.sorted_token_ids[: int(batch.seg_starts[-1])].long()] = True
    served = torch.where(in_seg, slots, -1)
    (k, inter), layer = dims[4], rng.randrange(NUM_LAYERS)
    x = torch.randn(slots.shape[0], k, generator=gen)
    gate_up = torch.randn(slots.shape[0], 2 * inter, generator=gen)
    xa = lora_xa(x=x, layout=layout, layer=layer, proj_ids=[4, 5], batch=batch, backend=backend)
    out = torch.full((slots.shape[0], inter), float("nan"))
    lora_silu_mul(gate_up=gate_up, xa=xa, layout=layout, layer=layer, batch=batch, out=out, backend=backend)
    gate = gate_up[:, :inter].double() + dense_delta(modules, served, x, layer, 4, inter)
    up = gate_up[:, inter:].double() + dense_delta(modules, served, x, layer, 5, inter)
    why = wrong(out[in_seg], (F.silu(gate) * up)[in_seg])
    return [f"silu_mul layer {layer}: {why}"] if why else []


@pytest.mark.parametrize(("backend", "seed"), [(b, s) for b, seeds in SEEDS.items() for s in seeds])
def test_lora_kernels_match_dense_on_random_layouts(backend, seed):
    """Every group's delta (adding and writing) and the folded activation equal the float64 dense answer on each of
    the seed's batches; rows in no segment are left exactly as they were."""
    rng, gen, dims, modules, layout, num_slots = draw_layout(seed)
    fails = []
    for _ in range(NUM_BATCHES):
        kind, slots, batch = draw_batch(rng, gen, layout, num_slots)
        where = f"{kind} batch of {slots.shape[0]} tokens, segment slots {batch.seg_slots.tolist()[:20]}"
        fails += [f"{where}: {f}" for check in (delta_failures, silu_mul_failures)
                  for f in check(modules, layout, batch, slots, dims, rng, gen, backend)]
    assert not fails, "\n".join(fails[:10])
