"""AdapterImage: one adapter packed into whole pages, ready for a single host-to-device copy per run of
pages. This is the CPU tier's form of an adapter (pinned memory on GPU machines).

Packing rule (the same as `kernels.lora_layout.pack_lora_layout`): modules in (layer, proj id) order;
per module the `r` rows of A (`[r, in]`) then the `r` rows of B^T (`[r, out]`); a row that does not fit
in the rest of a page starts on the next page. No padding to a maximum rank: a rank-4 module takes 8
rows, a rank-64 module 128. Waste is under one row per page and is reported as fragmentation.

Running example (page_elems=10, one module, r=2, in=4, out=3): A rows at offsets 0 and 4; B^T row 0
would end at 8+3 > 10, so it starts page 1 (offset 10), row 1 at 13. Two pages, 14 of 20 elements
used, fragmentation 30 %.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorafleet.kernels.lora_layout import NUM_PROJS, PROJS, pow2_divisor
from lorafleet.worker.host_arena import HostPages

PROJ_IDS = {p: i for i, p in enumerate(PROJS)}


class AdapterShapeError(ValueError):
    """An adapter does not fit the served base model or the pool (names the module and the shapes)."""


@dataclass(slots=True, frozen=True)
class ModelDims:
    """What the pool needs of the base model to validate and lay out adapters."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int

    @classmethod
    def from_model_config(cls, cfg) -> ModelDims:
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size)

    def in_out(self, proj: str) -> tuple[int, int]:
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }[proj]

    def row_align(self, page_elems: int) -> int:
        """The largest power of two up to 16 dividing every pool row offset `pack_adapter` can give: rows start
        at a page start plus whole rows of the model's widths (the kernels' vector loads rely on it)."""
        return pow2_divisor((page_elems, self.hidden_size, self.intermediate_size, self.q_size, self.kv_size))


@dataclass(slots=True)
class AdapterImage:
    """An adapter as whole pages plus page-local row offsets (offset = local_page * page_elems + col)."""

    pages: HostPages  # num_pages pages of page_elems, model dtype (pinned on GPU hosts; host_arena.py)
    ranks: torch.Tensor  # int32 [num_layers, 7]
    scales: torch.Tensor  # float32 [num_layers, 7]
    a_local: torch.Tensor  # int64 [num_layers, 7, max_rank]
    b_local: torch.Tensor  # int64 [num_layers, 7, max_rank]
    used_elems: int  # elements that hold weights (the rest of the pages is fragmentation)
    digest: str  # sha256 over the packed pages and metadata: identifies the content

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes

    @property
    def max_rank(self) -> int:
        return int(self.ranks.max()) if self.ranks.numel() else 0

    def global_offsets(self, page_ids: list[int], page_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Offsets into pool.view(-1) once the image sits in `page_ids` (local page k -> page_ids[k])."""
        ids = torch.tensor(page_ids, dtype=torch.int64)
        out = []
        for local in (self.a_local, self.b_local):
            out.append(ids[local // page_elems] * page_elems + local % page_elems)
        return out[0], out[1]


    def write_slot(self, layout, slot: int, page_ids: list[int]) -> None:
        """Describe this adapter, now sitting in `page_ids`, in `layout` under `slot`. The ranks are
        written last: until then the slot reads as "no adapter", never as half an adapter."""
        a_glob, b_glob = self.global_offsets(page_ids, layout.pool.shape[1])
        device, width = layout.ranks.device, a_glob.shape[-1]
        layout.a_offsets[:, :, slot].zero_()
        layout.b_offsets[:, :, slot].zero_()
        layout.a_offsets[:, :, slot, :width] = a_glob.to(device)
        layout.b_offsets[:, :, slot, :width] = b_glob.to(device)
        layout.scales[:, :, slot] = self.scales.to(device)
        layout.ranks[:, :, slot] = self.ranks.to(device)


def clear_slot(layout, slot: int) -> None:
    """The slot holds no adapter any more (rank 0 everywhere: kernels skip it)."""
    layout.ranks[:, :, slot] = 0
    layout.scales[:, :, slot] = 0.0


def _rank_refusal(modules: dict, name: str | None, max_rank: int) -> str:
    """Why an adapter above the pool's max_rank is refused, and the --max-lora-rank that would take it."""
    ordered = sorted(modules, key=lambda k: (k[0], PROJ_IDS.get(k[1], 99)))  # the packing order
    (layer, proj), top = max(((key, modules[key].a.shape[0]) for key in ordered), key=lambda kv: kv[1])
    who = f"adapter {name!r}" if name else "the adapter"
    return (f"{who} has rank {top} (layers.{layer}.{proj}), above the pool's max_rank {max_rank}: "
            f"raise --max-lora-rank (at least {top}), or serve a version of it trained at rank {max_rank} or less")


def pack_adapter(
    modules: dict,
    dims: ModelDims,
    *,
    page_elems: int,
    max_rank: int,
    dtype: torch.dtype,
    pin: bool = False,
    name: str | None = None,
    allocate: Callable[[int], HostPages] | None = None,
) -> AdapterImage:
    """Validate `modules` ((layer, proj name) -> ModuleLoRA-like with .a [r,in], .b [out,r], .scale)
    against the base model and pack them into pages: `allocate(num_pages)`'s (zeroed, of `dtype` and
    `page_elems`; a `HostArena`'s), else pages of their own (pinned with `pin`). `name` (the adapter's) is
    named in refusals."""
    mats: list[torch.Tensor] = []  # per module: A [r, in], then B^T [r, out]; each row is one pool row
    entries: list[tuple[int, int, int, float]] = []  # layer, proj id, rank, scale
    for (layer, proj), mod in sorted(modules.items(), key=lambda kv: (kv[0][0], PROJ_IDS.get(kv[0][1], 99))):
        if proj not in PROJ_IDS:
            raise AdapterShapeError(f"module {proj!r} of layer {layer} is not a Llama projection {PROJS}")
        if not 0 <= layer < dims.num_layers:
            raise AdapterShapeError(f"{proj} of layer {layer}: the base model has {dims.num_layers} layers")
        a, b = mod.a, mod.b
        fan_in, fan_out = dims.in_out(proj)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or b.shape[1] != r:
            raise AdapterShapeError(
                f"layers.{layer}.{proj}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match the base "
                f"model (expected A [r, {fan_in}] and B [{fan_out}, r])"
            )
        if r > max_rank:
            raise AdapterShapeError(_rank_refusal(modules, name, max_rank))
        if max(fan_in, fan_out) > page_elems:
            raise AdapterShapeError(f"a row of {max(fan_in, fan_out)} elements does not fit a page of {page_elems}")
        mats += [a, b.t()]
        entries.append((layer, PROJ_IDS[proj], r, float(mod.scale)))

    # Place rows; consecutive rows of one matrix that land in one page are copied as one block.
    offsets: list[torch.Tensor] = []  # per matrix: int64 [r] page-local offsets of its rows
    blocks: list[tuple[int, int, int, int]] = []  # (dst offset, matrix index, first row, rows)
    page, col, used = 0, 0, 0
    for m, mat in enumerate(mats):
        num_rows, length = mat.shape
        row, offs = 0, []
        while row < num_rows:
            fit = (page_elems - col) // length
            if fit == 0:
                page, col = page + 1, 0
                continue
            k = min(fit, num_rows - row)
            start = page * page_elems + col
            offs.append(start + length * torch.arange(k, dtype=torch.int64))
            blocks.append((start, m, row, k))
            col += k * length
            row += k
        offsets.append(torch.cat(offs) if offs else torch.zeros(0, dtype=torch.int64))
        used += num_rows * length
    num_pages = page + 1 if mats else 0
    pages = allocate(num_pages) if allocate is not None else HostPages.standalone(num_pages, page_elems, dtype, pin)
    for start, m, row, k in blocks:  # a block's rows lie in one page
        src = mats[m][row : row + k]
        col = start % page_elems
        pages.page(start // page_elems)[col : col + src.numel()] = src.reshape(-1).to(dtype)

    width = max(1, max((e[2] for e in entries), default=1))
    ranks = torch.zeros(dims.num_layers, NUM_PROJS, dtype=torch.int32)
    scales = torch.zeros(dims.num_layers, NUM_PROJS, dtype=torch.float32)
    a_local = torch.zeros(dims.num_layers, NUM_PROJS, width, dtype=torch.int64)
    b_local = torch.zeros(dims.num_layers, NUM_PROJS, width, dtype=torch.int64)
    for i, (layer, pid, r, scale) in enumerate(entries):
        ranks[layer, pid], scales[layer, pid] = r, scale
        a_local[layer, pid, :r] = offsets[2 * i]
        b_local[layer, pid, :r] = offsets[2 * i + 1]

    digest = hashlib.sha256()  # hashlib releases the GIL on large buffers: loads do not stall the step loop
    for t in (ranks, scales, a_local, *pages.chunks):
        if t.numel():
            digest.update(t.contiguous().view(torch.uint8).numpy())
    return AdapterImage(pages, ranks, scales, a_local, b_local, used, digest.hexdigest())
