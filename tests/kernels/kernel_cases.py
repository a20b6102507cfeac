"""Random adapters, slot patterns and naive dense answers shared by the kernel tests."""

from __future__ import annotations

import math

import torch

POPULARITIES = ("distinct", "uniform", "zipf", "identical", "all_none", "mixed_none")
MIXED_RANKS = (1, 3, 8, 16, 33, 64, 128)


def token_slots(popularity: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [T] slots drawn by an adapter-popularity pattern."""
    if popularity == "distinct":
        slots = torch.randperm(max(num_slots, num_tokens), generator=gen)[:num_tokens] % num_slots
    elif popularity == "uniform":
        slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    elif popularity == "zipf":
        weights = torch.tensor([1.0 / (k + 1) ** 1.2 for k in range(num_slots)])
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    elif popularity == "identical":
        slots = torch.full((num_tokens,), int(torch.randint(0, num_slots, (1,), generator=gen)))
    elif popularity == "all_none":
        slots = torch.full((num_tokens,), -1)
    elif popularity == "mixed_none":
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    else:
        raise ValueError(popularity)
    return slots.to(torch.int32)


def random_adapters(
    *, num_slots: int, num_layers: int, dims: dict[int, tuple[int, int]], gen: torch.Generator, ranks=MIXED_RANKS, skip_prob: float = 0.15
) -> dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, float]]:
    """(slot, layer, proj) -> (a [r, in], b [out, r], scale) in float32; some modules left unadapted."""
    modules = {}
    for slot in range(num_slots):
        for layer in range(num_layers):
            for proj, (k, n) in dims.items():
                if float(torch.rand((), generator=gen)) < skip_prob:
                    continue
                r = ranks[int(torch.randint(0, len(ranks), (1,), generator=gen))]
                a = torch.randn(r, k, generator=gen) / math.sqrt(k)
                b = torch.randn(n, r, generator=gen) / math.sqrt(r)
                alpha = float(torch.randint(1, 64, (1,), generator=gen))
                scale = alpha / math.sqrt(r) if slot % 2 else alpha / r  # rsLoRA on odd slots
                modules[(slot, layer, proj)] = (a, b, scale)
    return modules


def dense_delta(modules, slots: torch.Tensor, x: torch.Tensor, layer: int, proj: int, width: int) -> torch.Tensor:
    """float64 [T, width]: scale * (x[t] @ A.T) @ B.T with each token's own adapter, slot by slot."""
    out = torch.zeros(x.shape[0], width, dtype=torch.float64)
    for s in slots.unique().tolist():
        if s >= 0 and (s, layer, proj) in modules:
            a, b, scale = modules[(s, layer, proj)]
            idx = (slots == s).nonzero().squeeze(1)
            out[idx] = scale * (x[idx].double() @ a.double().T) @ b.double().T
    return out


def dense_shrink(modules, slots: torch.Tensor, x: torch.Tensor, layer: int, proj: int):
    """Per token: float64 [r] = x[t] @ A.T, or None where the token has no adapter for this module."""
    res = [None] * x.shape[0]
    for s in slots.unique().tolist():
        if s >= 0 and (s, layer, proj) in modules:
            idx = (slots == s).nonzero().squeeze(1)
            vals = x[idx].double() @ modules[(s, layer, proj)][0].double().T
            for j, t in enumerate(idx.tolist()):
                res[t] = vals[j]
    return res

LLAMA3_8B_DIMS = {0: (4096, 4096), 1: (4096, 1024), 2: (4096, 1024), 3: (4096, 4096), 4: (4096, 14336), 5: (4096, 14336), 6: (14336, 4096)}


def random_pool_layout(*, ranks_by_slot: list[int], dims: dict[int, tuple[int, int]], page_elems: int, dtype, device, gen: torch.Generator):
    """A layout whose pool holds random weights in place (large shapes: no per-row copies), packed by the pool's rule."""
    from lorafleet.kernels.lora_layout import NUM_PROJS, LoRALayout, place_rows

    lengths, owners = [], []
    for slot, r in enumerate(ranks_by_slot):
        for proj, (k, n) in sorted(dims.items()):
            lengths += [k] * r + [n] * r
            owners.append((slot, proj, r))
    placements = place_rows(lengths, page_elems)
    num_pages = placements[-1][0] + 1
    pool = (torch.randn(num_pages, page_elems, generator=gen) * 0.05).to(dtype).to(device)
    max_rank = max(ranks_by_slot)
    num_slots = len(ranks_by_slot)
    ranks = torch.zeros(1, NUM_PROJS, num_slots, dtype=torch.int32)
    scales = torch.zeros(1, NUM_PROJS, num_slots)
    offsets = torch.tensor([p * page_elems + o for p, o in placements], dtype=torch.int64)
    a_off = torch.zeros(1, NUM_PROJS, num_slots, max_rank, dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    cursor = 0
    for slot, proj, r in owners:
        ranks[0, proj, slot] = r
        scales[0, proj, slot] = 16.0 / r
        a_off[0, proj, slot, :r] = offsets[cursor : cursor + r]
        b_off[0, proj, slot, :r] = offsets[cursor + r : cursor + 2 * r]
        cursor += 2 * r
    layout = LoRALayout(pool=pool, ranks=ranks.to(device), scales=scales.to(device), a_offsets=a_off.to(device), b_offsets=b_off.to(device), row_align=8)
    layout.check_alignment()
    return layout
