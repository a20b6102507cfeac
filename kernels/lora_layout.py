"""LoRA metadata: where each adapter row lives in the page pool, and how a batch's tokens use slots.

`LoRALayout` is the one place where the kernels and the adapter pool agree. The pool writes adapter
matrices row by row into pages of the unified page pool (A as `[r, in]` rows, B transposed as
`[r, out]` rows; a row never straddles a page, so each row is contiguous) and records the element
offset of every row here. Kernels read rows only through these offsets.

`LoRABatch` is built once per step from the tokens' adapter slots; every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # proj id = index
NUM_PROJS = len(PROJS)


def pow2_divisor(values, most: int = 16) -> int:
    """The largest power of two up to `most` dividing every value (row alignments, vector widths)."""
    align = most
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


@dataclass
class LoRALayout:
    """Device tensors describing every resident adapter; rebuilt/updated by the pool on load/evict."""

    pool: Tensor  # [num_pages, page_elems] model dtype; rows addressed in pool.view(-1)
    ranks: Tensor  # int32 [num_layers, 7, max_slots]; 0 = module not adapted
    scales: Tensor  # float32 [num_layers, 7, max_slots]; alpha/r or alpha/sqrt(r), per module
    a_offsets: Tensor  # int64 [num_layers, 7, max_slots, max_rank]: element offset of A row j
    b_offsets: Tensor  # int64 [num_layers, 7, max_slots, max_rank]: element offset of B^T row j
    row_align: int = 1  # every row offset is a multiple of this (a power of two); lets kernels vectorize loads
    # (in, out) features of each projection, by proj id: the launchers refuse activations of other widths (an A
    # row read with the wrong K reads the wrong pool elements). None: not recorded, the caller's contract.
    widths: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.pool.dim() != 2 or not self.pool.is_contiguous():
            raise ValueError(f"LoRALayout.pool must be a contiguous [num_pages, page_elems] tensor, got {tuple(self.pool.shape)}")
        shape = tuple(self.ranks.shape)
        if len(shape) != 3 or shape[1] != NUM_PROJS:
            raise ValueError(f"LoRALayout.ranks must be [num_layers, {NUM_PROJS}, max_slots], got {shape}")
        if self.ranks.dtype != torch.int32 or self.scales.dtype != torch.float32:
            raise ValueError("LoRALayout.ranks must be int32 and LoRALayout.scales float32")
        if tuple(self.scales.shape) != shape:
            raise ValueError(f"LoRALayout.scales must have shape {shape}, got {tuple(self.scales.shape)}")
        for name in ("a_offsets", "b_offsets"):
            offsets = getattr(self, name)
            if offsets.dtype != torch.int64 or offsets.dim() != 4 or tuple(offsets.shape[:3]) != shape:
                raise ValueError(f"LoRALayout.{name} must be int64 [{shape[0]}, {shape[1]}, {shape[2]}, max_rank], got {offsets.dtype} {tuple(offsets.shape)}")
            if not offsets.is_contiguous():
                raise ValueError(f"LoRALayout.{name} must be contiguous")
        if not (self.ranks.is_contiguous() and self.scales.is_contiguous()):
            raise ValueError("LoRALayout.ranks and LoRALayout.scales must be contiguous")
        if self.row_align < 1 or self.row_align & (self.row_align - 1):
            raise ValueError(f"LoRALayout.row_align must be a power of two, got {self.row_align}")
        if not self.pool.dtype.is_floating_point:
            raise ValueError(f"LoRALayout.pool must hold the model's floating dtype, got {self.pool.dtype}")
        if self.b_offsets.shape != self.a_offsets.shape:
            raise ValueError(f"LoRALayout.a_offsets and b_offsets must have one shape, got {tuple(self.a_offsets.shape)} and {tuple(self.b_offsets.shape)}")
        if self.widths is not None:
            self.widths = tuple((int(k), int(n)) for k, n in self.widths)
            if len(self.widths) != NUM_PROJS or any(k <= 0 or n <= 0 for k, n in self.widths):
                raise ValueError(f"LoRALayout.widths must be {NUM_PROJS} positive (in, out) pairs, got {self.widths}")
        devices = {t.device for t in (self.pool, self.ranks, self.scales, self.a_offsets, self.b_offsets)}
        if len(devices) != 1:
            raise ValueError(f"LoRALayout's tensors must share one device, got {sorted(map(str, devices))}")

    def check_alignment(self) -> None:
        """Raise if a live row offset is not a multiple of row_align (one host sync; for tests and debugging)."""
        live = torch.arange(self.max_rank, device=self.ranks.device) < self.ranks[..., None]
        for offsets in (self.a_offsets, self.b_offsets):
            if bool((offsets[live] % self.row_align).any()):
                raise ValueError(f"a LoRA row offset is not a multiple of row_align={self.row_align}")

    @property
    def num_layers(self) -> int:
        return self.ranks.shape[0]

    @property
    def max_slots(self) -> int:
        return self.ranks.shape[2]

    @property
    def max_rank(self) -> int:
        return self.a_offsets.shape[3]

    def max_rank_by_slot(self) -> Tensor:
        """int32 [max_slots]: each slot's largest rank over all layers and projections."""
        return self.ranks.amax(dim=(0, 1))


@dataclass
class LoRABatch:
    """Per-token adapter slots of one step, grouped into segments; built once, used by every layer.

    Running example: token_slots = [2, -1, 0, 2, 0] gives sorted_token_ids = [2, 4, 0, 3],
    seg_starts = [0, 2, 4], seg_slots = [0, 2]: segment 0 holds tokens 2 and 4 (slot 0), segment 1
    holds tokens 0 and 3 (slot 2); token 1 has no adapter and is in no segment.

    Ungrouped batches (one segment per token, `seg_slots` may repeat and hold -1, which kernels skip at
    once) need no sort and have fixed shapes, so a decode step can be captured in a CUDA graph.
    """

    token_slots: Tensor  # int32 [T]; -1 = base model only
    sorted_token_ids: Tensor  # int32 [T_lora]: token indices with slot >= 0, grouped by slot
    seg_starts: Tensor  # int32 [S+1] into sorted_token_ids
    seg_slots: Tensor  # int32 [S]: slot of each segment (a long run of one slot is cut into several)
    max_rank: int  # largest rank among the batch's slots (sizes the shrink buffer)
    mean_rank: float = 0.0  # mean rank over the batch's tokens with a slot; 0: unknown (kernels plan for max_rank)
    every_token: bool = False  # every token is in a segment (slot -1 segments count): a write-mode expand covers all rows
    # (layer, projection) pairs some slot of the batch adapts, where the host knows them without a device sync (CPU
    # tensors); None: not known, every pair is computed. A pair none adapts costs no delta (`adapts`).
    adapted: frozenset[tuple[int, int]] | None = None
    # What the torch reference derives from a CPU batch once for every layer's calls (kernels/lora_reference.py).
    host_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Once per step, not per kernel call: the kernels index these with stride 1 (a strided view
        would be read wrongly) and read seg_starts[num_segments]; all on one device."""
        meta = (("token_slots", self.token_slots), ("sorted_token_ids", self.sorted_token_ids), ("seg_starts", self.seg_starts),
                ("seg_slots", self.seg_slots))
        for label, t in meta:
            if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
                raise ValueError(f"LoRABatch: batch.{label} must be a contiguous 1-D int32 (or int64) tensor, got {t.dtype} "
                                 f"{tuple(t.shape)} strides {t.stride()}")
            if t.device != self.token_slots.device:
                raise ValueError(f"LoRABatch: batch.{label} is on {t.device}, batch.token_slots on {self.token_slots.device}")
        if self.seg_starts.shape[0] != self.num_segments + 1:
            raise ValueError(f"LoRABatch: batch.seg_starts must hold num_segments + 1 = {self.num_segments + 1} entries, "
                             f"got {self.seg_starts.shape[0]}")

    def adapts(self, layer: int, proj_ids: list[int]) -> bool:
        """Whether some token's adapter adapts one of `proj_ids` in `layer` (true where that is not known)."""
        return self.adapted is None or any((layer, p) in self.adapted for p in proj_ids)

    @property
    def planning_rank(self) -> float:
        """The rank kernels size their grids for: the mean where known, else the largest."""
        return self.mean_rank or float(self.max_rank)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_segments(self) -> int:
        return self.seg_slots.shape[0]


SEGMENT_LEN_MIN = 16  # tokens per segment of a small step (decode)
SEGMENTS_PER_STEP = 16  # a step of one adapter's tokens keeps at least this many segments


def segment_len(num_tokens: int, most: int = 64) -> int:
    """Most tokens of one adapter per kernel segment in a step of num_tokens tokens.

    16 for a small step, so one adapter's tokens still spread over several kernel programs; longer,
    up to `most`, as the step grows (a power of two when `most` is one; at least 16 segments if every
    token has one adapter). Long segments read each adapter's rows fewer times and fill the kernels'
    64-token tiles (H200, T=1024 over 8 adapters, what the layer's LoRA adds to its base GEMMs at 16, 32
    and 64 tokens: 14.5%, 12.1% and 11.3% with every delta written first; 13.9%, 11.8% and 9.0% with the
    gate|up delta folded into the activation; bench/results/kernels_segments_20261130_h200.json); short
    ones keep a decode step of one adapter on many programs. Running example: 64 -> 16, 512 -> 32,
    1024 -> 64, 8192 -> 64.
    """
    fit = 1 << max(0, (max(num_tokens, 1) // SEGMENTS_PER_STEP).bit_length() - 1)
    return max(1, min(most, max(SEGMENT_LEN_MIN, fit)))


def make_lora_batch(token_slots: Tensor, max_rank_by_slot: Tensor, *, grouped: bool = True, max_segment_len: int | None = None) -> LoRABatch:
    """Group a step's tokens by adapter slot with torch ops (no Python loop over tokens).

    token_slots: int [T] slot of each token, -1 for none. max_rank_by_slot: int [max_slots] (for example
    `layout.max_rank_by_slot()`). `grouped=False` makes one segment per token (see `LoRABatch`).
    A slot's run longer than max_segment_len tokens (default: `segment_len` of the step) becomes
    consecutive segments of that slot, so a long prefill spreads over many kernel programs (each
    re-reads the adapter from L2, not from memory).
    A few host syncs (the number of segments and the batch's max rank are Python ints).
    """
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be an int32 or int64 tensor, got {token_slots.dtype}")
    if max_rank_by_slot.dim() != 1:
        raise ValueError(f"max_rank_by_slot must be 1-D [max_slots] (layout.max_rank_by_slot()), got shape {tuple(max_rank_by_slot.shape)}")
    device = token_slots.device
    num_tokens = token_slots.shape[0]
    # Checked before the cast to int32, which would wrap an int64 slot past it into a valid one.
    if num_tokens and bool((token_slots >= max_rank_by_slot.shape[0]).any()):
        raise ValueError(f"token_slots hold a slot >= max_slots ({max_rank_by_slot.shape[0]})")
    if num_tokens and bool((token_slots < -1).any()):
        raise ValueError("token_slots must be >= -1 (-1 means no adapter)")
    slots = token_slots.to(torch.int32)
    max_rank_by_slot = max_rank_by_slot.to(device=device, dtype=torch.int32)
    if max_segment_len is None:
        max_segment_len = segment_len(num_tokens)
    if max_segment_len < 1:
        raise ValueError(f"max_segment_len must be >= 1, got {max_segment_len}")
    valid = slots >= 0
    used = slots[valid].long()
    max_rank, mean_rank = 0, 0.0
    if used.numel():
        ranks = max_rank_by_slot[used].float()
        top, mean = torch.stack([ranks.max(), ranks.mean()]).tolist()  # one host sync for both
        max_rank, mean_rank = int(top), mean

    if not grouped:
        ids = torch.arange(num_tokens, dtype=torch.int32, device=device)
        starts = torch.arange(num_tokens + 1, dtype=torch.int32, device=device)
        return LoRABatch(slots, ids, starts, slots.clone(), max_rank, mean_rank, every_token=True)

    # A stable sort keeps tokens of one slot in their original order; -1 sorts first and is cut off.
    order = torch.sort(slots, stable=True).indices
    num_base = int((~valid).sum())
    sorted_ids = order[num_base:].to(torch.int32)
    seg_slots, counts = torch.unique_consecutive(slots[order[num_base:]], return_counts=True)
    # Cut runs into chunks: chunk c of run s starts at run_start[s] + c * max_segment_len.
    # Running example (max_segment_len=2): counts [3, 1] -> chunks [2, 1] -> starts [0, 2, 3], slots [a, a, b].
    chunks = (counts + max_segment_len - 1) // max_segment_len
    num_chunks = int(chunks.sum())
    run_of_chunk = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), chunks, output_size=num_chunks)
    first_chunk = torch.cumsum(chunks, 0) - chunks
    run_start = torch.cumsum(counts, 0) - counts
    index_in_run = torch.arange(num_chunks, device=device) - first_chunk[run_of_chunk]
    seg_starts = torch.empty(num_chunks + 1, dtype=torch.int32, device=device)
    seg_starts[:-1] = run_start[run_of_chunk] + index_in_run * max_segment_len
    seg_starts[-1] = sorted_ids.shape[0]
    return LoRABatch(slots, sorted_ids, seg_starts, seg_slots[run_of_chunk].to(torch.int32), max_rank, mean_rank, every_token=num_base == 0)


def place_rows(row_lengths: list[int], page_elems: int) -> list[tuple[int, int]]:
    """(page index, offset in page) of each row, in order: a row that does not fit in the rest of the
    current page starts on the next one (rows never straddle a page; no padding)."""
    placements: list[tuple[int, int]] = []
    page, used = 0, 0
    for n in row_lengths:
        if n > page_elems:
            raise ValueError(f"a row of {n} elements does not fit a page of {page_elems}")
        if used + n > page_elems:
            page, used = page + 1, 0
        placements.append((page, used))
        used += n
    return placements


def pack_lora_layout(
    modules: dict[tuple[int, int, int], tuple[Tensor, Tensor, float]],
    *,
    num_layers: int,
    max_slots: int,
    page_elems: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    num_pages: int | None = None,
    page_order: Tensor | None = None,
) -> LoRALayout:
    """Write adapters into a fresh page pool row by row (no row straddles a page) and describe them.

    modules: (slot, layer, proj_id) -> (a [r, in], b [out, r], scale). Pages are taken in
    `page_order` (default 0, 1, 2, ...), so a shuffled order checks that kernels follow the offsets.
    This is the packing rule the adapter pool follows; tests, benchmarks and a pool-less engine use it.
    """
    rows: list[Tensor] = []
    for key in sorted(modules):
        slot, layer, proj = key
        if not (0 <= slot < max_slots and 0 <= layer < num_layers and 0 <= proj < NUM_PROJS):
            raise ValueError(f"module {key}: (slot, layer, proj_id) must lie in [0, {max_slots}) x [0, {num_layers}) x [0, {NUM_PROJS})")
        a, b, _ = modules[key]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"module {key}: a must be [r, in] and b [out, r], got {tuple(a.shape)} and {tuple(b.shape)}")
        rows.extend(a.unbind(0))
        rows.extend(b.t().unbind(0))
    max_rank = max((a.shape[0] for a, _, _ in modules.values()), default=1)
    placements = place_rows([row.numel() for row in rows], page_elems)
    needed = placements[-1][0] + 1 if rows else 0
    num_pages = needed if num_pages is None else num_pages
    if num_pages < needed:
        raise ValueError(f"the adapters need {needed} pages, only {num_pages} given")
    order = list(range(num_pages)) if page_order is None else page_order.tolist()
    if sorted(order) != list(range(num_pages)):
        raise ValueError(f"page_order must be a permutation of range({num_pages}) (num_pages), got {order}")
    pool = torch.zeros(num_pages, page_elems, dtype=dtype)
    offsets = [order[p] * page_elems + off for p, off in placements]
    if rows:
        # One scatter for all rows: element e of row i goes to offsets[i] + e.
        lengths = torch.tensor([row.numel() for row in rows])
        shift = torch.tensor(offsets) - (torch.cumsum(lengths, 0) - lengths)
        index = torch.repeat_interleave(shift, lengths) + torch.arange(int(lengths.sum()))
        pool.view(-1)[index] = torch.cat(rows).to(dtype)

    ranks = torch.zeros(num_layers, NUM_PROJS, max_slots, dtype=torch.int32)
    scales = torch.zeros(num_layers, NUM_PROJS, max_slots, dtype=torch.float32)
    a_off = torch.zeros(num_layers, NUM_PROJS, max_slots, max_rank, dtype=torch.int64)
    b_off = torch.zeros(num_layers, NUM_PROJS, max_slots, max_rank, dtype=torch.int64)
    align = pow2_divisor(offsets)
    cursor = 0
    for slot, layer, proj in sorted(modules):
        a, _, scale = modules[(slot, layer, proj)]
        r = a.shape[0]
        ranks[layer, proj, slot] = r
        scales[layer, proj, slot] = scale
        a_off[layer, proj, slot, :r] = torch.tensor(offsets[cursor : cursor + r])
        b_off[layer, proj, slot, :r] = torch.tensor(offsets[cursor + r : cursor + 2 * r])
        cursor += 2 * r
    return LoRALayout(
        pool=pool.to(device),
        ranks=ranks.to(device),
        scales=scales.to(device),
        a_offsets=a_off.to(device),
        b_offsets=b_off.to(device),
        row_align=align,
    )
