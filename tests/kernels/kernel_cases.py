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
    """float64 [T, width]: scale * (x[t] @ A.T) @ B.T per token, one token at a time (the plainest answer)."""
    out = torch.zeros(x.shape[0], width, dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0 and (s, layer, proj) in modules:
            a, b, scale = modules[(s, layer, proj)]
            out[t] = scale * (x[t].double() @ a.double().T) @ b.double().T
    return out


def dense_shrink(modules, slots: torch.Tensor, x: torch.Tensor, layer: int, proj: int):
    """Per token: float64 [r] = x[t] @ A.T, or None where the token has no adapter for this module."""
    res = []
    for t, s in enumerate(slots.tolist()):
        if s >= 0 and (s, layer, proj) in modules:
            res.append(x[t].double() @ modules[(s, layer, proj)][0].double().T)
        else:
            res.append(None)
    return res
