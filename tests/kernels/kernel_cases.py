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


# Small fused groups as the model calls them: q|k|v (unequal widths), o, gate|up (unequal here), down.
SMALL_DIMS = {0: (64, 64), 1: (64, 32), 2: (64, 48), 3: (64, 64), 4: (64, 96), 5: (64, 80), 6: (96, 64)}
SMALL_GROUPS = {"qkv": ([0, 1, 2], 64, [64, 32, 48]), "o": ([3], 64, [64]), "gate_up": ([4, 5], 64, [96, 80]), "down": ([6], 96, [64])}


def small_layout(gen: torch.Generator, *, dtype, dims=SMALL_DIMS, num_slots: int = 10, num_layers: int = 2, ranks=MIXED_RANKS, skip_prob: float = 0.15):
    """Random adapters over dims (as stored: rounded to dtype) packed into 4000 shuffled pages of 300
    elements, with one empty slot past num_slots. Returns (modules, layout)."""
    from lorafleet.kernels.lora_layout import pack_lora_layout

    modules = random_adapters(num_slots=num_slots, num_layers=num_layers, dims=dims, gen=gen, ranks=ranks, skip_prob=skip_prob)
    modules = {key: (a.to(dtype).float(), b.to(dtype).float(), s) for key, (a, b, s) in modules.items()}
    order = torch.randperm(4000, generator=gen)
    layout = pack_lora_layout(modules, num_layers=num_layers, max_slots=num_slots + 1, page_elems=300, dtype=dtype, num_pages=4000, page_order=order)
    return modules, layout


def poisoned_layout(layout, dims: dict[int, tuple[int, int]]):
    """A copy of layout whose pool is NaN wherever no live adapter row lies, plus one NaN page that every row
    offset past a module's rank (and of every module a slot does not adapt) points at: a kernel that reads
    anything but the true rank's rows shows NaN."""
    from lorafleet.kernels.lora_layout import LoRALayout

    num_pages, page_elems = layout.pool.shape
    pool = torch.cat([layout.pool, torch.full((1, page_elems), float("nan"), dtype=layout.pool.dtype)])
    dead = torch.arange(layout.max_rank)[None, None, None, :] >= layout.ranks[..., None]  # [L, 7, M, R]
    a_off, b_off = layout.a_offsets.clone(), layout.b_offsets.clone()
    a_off[dead], b_off[dead] = num_pages * page_elems, num_pages * page_elems
    live = torch.zeros(pool.numel(), dtype=torch.bool)
    for proj, (k, n) in dims.items():
        for offsets, width in ((a_off[:, proj][~dead[:, proj]], k), (b_off[:, proj][~dead[:, proj]], n)):
            live[(offsets[:, None] + torch.arange(width)).reshape(-1)] = True
    pool.view(-1)[~live] = float("nan")
    poisoned = LoRALayout(pool=pool, ranks=layout.ranks, scales=layout.scales, a_offsets=a_off, b_offsets=b_off, row_align=layout.row_align)
    poisoned.check_alignment()
    return poisoned


def hand_built_batch(lengths: list[int], seg_slots: list[int], num_without: int, gen: torch.Generator, max_rank: int):
    """A LoRABatch with segments of the given lengths (0 allowed) and slots, over randomly placed tokens,
    plus num_without tokens in no segment. Returns (token_slots, batch)."""
    from lorafleet.kernels.lora_layout import LoRABatch

    num_tokens = sum(lengths) + num_without
    perm = torch.randperm(num_tokens, generator=gen)
    slots = torch.full((num_tokens,), -1, dtype=torch.int32)
    ids, pos = [], 0
    for s, n in zip(seg_slots, lengths, strict=True):
        slots[perm[pos : pos + n]] = s
        ids.append(perm[pos : pos + n])
        pos += n
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return slots, LoRABatch(slots, torch.cat(ids).to(torch.int32), starts, torch.tensor(seg_slots, dtype=torch.int32), max_rank)


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


def paged_caches(num_pages: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, gen: torch.Generator, *, fill: float | None = None,
                 device="cpu"):  # fmt: skip
    """k/v caches as non-contiguous views of a page pool ([P, num_layers=3, 2, bs, Hkv, D], layer 1), filled with
    noise, or with `fill` (NaN: rows no sequence owns must never be read)."""
    numel = num_pages * 3 * 2 * block_size * num_kv_heads * head_dim
    if fill is not None:  # made where it lives: GPU-sized caches never pass through host memory
        pool = torch.full((numel,), fill, dtype=dtype, device=device)
    else:
        pool = torch.randn(numel, generator=gen).to(dtype).to(device)
    view = pool.view(num_pages, 3, 2, block_size, num_kv_heads, head_dim)
    return view[:, 1, 0], view[:, 1, 1]


def shuffled_tables(lens: list[int], block_size: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [B, max_blocks + 1]: each sequence's blocks on distinct shuffled pages; entries past its blocks are junk (out of range)."""
    max_blocks = max((-(-n // block_size) for n in lens), default=0) + 1
    pages = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), max_blocks), num_pages + 7, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        table[b, :nb] = pages[used : used + nb].to(torch.int32)
        used += nb
    return table


def slot_mapping(lens: list[int], table: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [sum(lens)]: the cache slot (page * bs + row) of every position of every sequence, in order."""
    rows = [table[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size for b, n in enumerate(lens)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of q [n, Hq, D] at positions q_pos over keys/values [N, Hkv, D] (GQA by repeat)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,nhd->hqn", q.double(), k) * scale
    mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    return torch.einsum("hqn,nhd->qhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)
