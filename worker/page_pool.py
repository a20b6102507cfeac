"""PagePool: one device tensor of fixed-size pages shared by the KV cache and adapter weights.

S-LoRA's unified paging. The pool is `pool: [num_pages, page_elems]` in the model dtype; a KV block
is one page, an adapter occupies whole pages (rows laid out so none straddles a page, see
adapter_pool.py). Whatever one kind does not use, the other may take, within per-kind floors
(pages the other kind can never take) and ceilings (pages this kind can never exceed).

Owners are `("kv", seq_id)`, `("kv", "prefix")` (KV blocks the prefix cache keeps while sequences use them)
or `("adapter", key)`; the first element is the kind. Every page is free or owned by exactly one owner;
`check()` proves it. A free page is plain or idle: an idle one still holds a block the prefix cache keeps
(prefix_cache.py), and is taken only once no plain one is left, least recently idle first (`on_evict` is told).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

KINDS = ("kv", "adapter")

Owner = tuple[str, object]
PREFIX: Owner = ("kv", "prefix")


class PagePoolError(RuntimeError):
    """A caller broke the pool's rules (double free, foreign page, over-allocation)."""


@dataclass(slots=True)
class PagePoolConfig:
    num_pages: int
    page_elems: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    # Floors are reserved for a kind (the other kind cannot allocate into them); ceilings cap it.
    # None ceiling = the whole pool.
    min_pages: dict[str, int] = field(default_factory=lambda: {"kv": 0, "adapter": 0})
    max_pages: dict[str, int | None] = field(default_factory=lambda: {"kv": None, "adapter": None})

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or self.page_elems <= 0:
            raise ValueError(f"num_pages and page_elems must be > 0, got {self.num_pages}, {self.page_elems}")
        for kind in (*self.min_pages, *self.max_pages):
            if kind not in KINDS:
                raise ValueError(f"unknown page kind {kind!r}; kinds are {KINDS}")
        floors = sum(self.min_pages.get(k, 0) for k in KINDS)
        if floors > self.num_pages:
            raise ValueError(f"page floors {self.min_pages} add up to more than num_pages={self.num_pages}")
        for kind in KINDS:
            floor = self.min_pages.get(kind, 0)
            ceiling = self.max_pages.get(kind)
            if floor < 0 or (ceiling is not None and ceiling < floor):
                raise ValueError(f"{kind}: need 0 <= min_pages ({floor}) <= max_pages ({ceiling})")


def kv_page_elems(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements of one KV block: a page viewed as [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim


class PagePool:
    """Hands out page ids of one device tensor; `can_allocate / allocate / free`."""

    def __init__(self, config: PagePoolConfig, pool: torch.Tensor | None = None) -> None:
        self.config = config
        if pool is None:
            pool = torch.zeros(config.num_pages, config.page_elems, dtype=config.dtype, device=config.device)
        if tuple(pool.shape) != (config.num_pages, config.page_elems):
            raise ValueError(f"pool tensor shape {tuple(pool.shape)} != ({config.num_pages}, {config.page_elems})")
        self.pool = pool  # [num_pages, page_elems]
        # LIFO free list, low ids first out: deterministic, and recently freed pages are reused.
        self._free: list[int] = list(range(config.num_pages - 1, -1, -1))
        self._owner_of: dict[int, Owner] = {}
        self._pages_of: dict[Owner, list[int]] = {}
        self._used_elems: dict[Owner, int] = {}
        self._used_by_kind = dict.fromkeys(KINDS, 0)
        self._lock = threading.RLock()
        self._reclaimers: dict[str, Callable[[int], int]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # free pages the prefix cache keeps, oldest first
        self.on_evict: Callable[[int], None] | None = None  # told of an idle page taken (on any thread)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    @property
    def page_elems(self) -> int:
        return self.config.page_elems

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def num_used(self, kind: str | None = None) -> int:
        if kind is None:
            return self.num_pages - len(self._free)
        return self._used_by_kind[kind]

    def most(self, kind: str) -> int:
        """Pages `kind` could ever hold at once: the pool less the other kinds' floors, capped by its ceiling."""
        _check_kind(kind)
        room = self.num_pages - sum(self.config.min_pages.get(other, 0) for other in KINDS if other != kind)
        ceiling = self.config.max_pages.get(kind)
        return max(0, room if ceiling is None else min(room, ceiling))

    def pages_of(self, owner: Owner) -> list[int]:
        return list(self._pages_of.get(owner, ()))

    def owner_of(self, page_id: int) -> Owner | None:
        return self._owner_of.get(page_id)

    def owners(self, kind: str | None = None) -> list[Owner]:
        return [o for o in self._pages_of if kind is None or o[0] == kind]

    def available(self, kind: str = "kv") -> int:
        """Pages `kind` could allocate now: free pages minus the other kinds' unmet floors, capped by
        this kind's ceiling."""
        _check_kind(kind)
        with self._lock:
            reserved = 0
            for other in KINDS:
                if other != kind:
                    reserved += max(0, self.config.min_pages.get(other, 0) - self._used_by_kind[other])
            room = self.num_free - reserved
            ceiling = self.config.max_pages.get(kind)
            if ceiling is not None:
                room = min(room, ceiling - self._used_by_kind[kind])
            return max(0, room)

    # ---- paired verbs --------------------------------------------------------------------------
    def can_allocate(self, num_pages: int, kind: str = "kv") -> bool:
        """True if `kind` can take `num_pages` now. When short, the other kinds' reclaimers are asked
        to give pages back first (the adapter pool evicts idle adapters for the KV cache)."""
        short = num_pages - self.available(kind)
        if short <= 0:
            return True
        ceiling = self.config.max_pages.get(kind)
        if ceiling is not None and self._used_by_kind[kind] + num_pages > ceiling:
            return False  # over its own ceiling: pages the others give back would not help
        for other, reclaim in list(self._reclaimers.items()):
            if other != kind:
                reclaim(short)  # called without our lock: the reclaimer takes its own, then ours
                short = num_pages - self.available(kind)
                if short <= 0:
                    return True
        return False

    def set_reclaimer(self, kind: str, reclaim: Callable[[int], int]) -> None:
        """`reclaim(n)` frees up to n pages of `kind` (and returns how many) when another kind is short."""
        _check_kind(kind)
        self._reclaimers[kind] = reclaim

    def allocate(self, num_pages: int, owner: Owner, *, used_elems: int | None = None) -> list[int]:
        """Take `num_pages` pages for `owner` (appended to what it already holds).

        `used_elems`: elements of these pages that carry data (default: all); the rest counts as
        internal fragmentation.
        """
        kind = owner[0]
        _check_kind(kind)
        if num_pages < 0:
            raise PagePoolError(f"cannot allocate {num_pages} pages")
        with self._lock:
            if num_pages > self.available(kind):
                raise PagePoolError(
                    f"{owner}: asked for {num_pages} pages, {self.available(kind)} available to {kind!r} "
                    f"({self.num_free} free of {self.num_pages}); check can_allocate() first"
                )
            if num_pages == 0:
                return []
            ids = [self._free.pop() for _ in range(min(num_pages, len(self._free)))]
            for _ in range(num_pages - len(ids)):
                ids.append(self._idle.popitem(last=False)[0])
                if self.on_evict is not None:
                    self.on_evict(ids[-1])
            for pid in ids:
                self._owner_of[pid] = owner
            self._pages_of.setdefault(owner, []).extend(ids)
            full = num_pages * self.page_elems
            self._used_elems[owner] = self._used_elems.get(owner, 0) + (full if used_elems is None else used_elems)
            self._used_by_kind[kind] += num_pages
            return ids

    def free(self, page_ids: list[int]) -> None:
        """Give pages back. A page not currently owned (double free) raises; nothing is changed then."""
        with self._lock:
            seen: set[int] = set()
            for pid in page_ids:
                if pid in seen or pid not in self._owner_of:
                    raise PagePoolError(f"page {pid} is not allocated (double free or foreign id)")
                seen.add(pid)
            for pid in page_ids:
                self._disown(pid)
                self._free.append(pid)

    def _disown(self, pid: int) -> Owner:
        owner = self._owner_of.pop(pid)
        pages = self._pages_of[owner]
        pages.remove(pid)
        self._used_by_kind[owner[0]] -= 1
        if pages:
            # Partial free: used elements shrink proportionally (KV frees whole blocks).
            self._used_elems[owner] = min(self._used_elems[owner], len(pages) * self.page_elems)
        else:
            del self._pages_of[owner]
            del self._used_elems[owner]
        return owner

    def _own(self, pid: int, owner: Owner) -> None:
        self._owner_of[pid] = owner
        self._pages_of.setdefault(owner, []).append(pid)
        self._used_elems[owner] = self._used_elems.get(owner, 0) + self.page_elems
        self._used_by_kind[owner[0]] += 1

    # ---- the prefix cache's pages (prefix_cache.py) ---------------------------------------------
    def keep(self, pid: int) -> None:
        """A KV page a sequence owns becomes the prefix cache's (`PREFIX`), in use."""
        with self._lock:
            if self._owner_of.get(pid, ("",))[0] != "kv" or self._owner_of[pid] == PREFIX:
                raise PagePoolError(f"page {pid} is not a sequence's KV page")
            self._disown(pid)
            self._own(pid, PREFIX)

    def idle(self, pid: int) -> None:
        """A `PREFIX` page no sequence uses any more: free, taken last (its block stays until then)."""
        with self._lock:
            if self._owner_of.get(pid) != PREFIX:
                raise PagePoolError(f"page {pid} is not the prefix cache's")
            self._disown(pid)
            self._idle[pid] = None

    def reuse(self, pid: int) -> bool:
        """An idle page in use again (`PREFIX`); False when it was taken for another use meanwhile (or the KV
        cache may take no page now)."""
        with self._lock:
            if pid not in self._idle or self.available("kv") < 1:
                return False
            del self._idle[pid]
            self._own(pid, PREFIX)
            return True

    def forget(self, pid: int) -> None:
        """An idle page whose block the prefix cache dropped: plain free (nothing, if it was taken meanwhile)."""
        with self._lock:
            if pid in self._idle:
                del self._idle[pid]
                self._free.append(pid)

    def free_owner(self, owner: Owner) -> int:
        """Free every page of `owner`; returns how many."""
        with self._lock:
            ids = self.pages_of(owner)
            self.free(ids)
            return len(ids)

    # ---- accounting ----------------------------------------------------------------------------
    def fragmentation(self, kind: str | None = "adapter") -> float:
        """Internal fragmentation: share of allocated elements (of `kind`, or all) that hold no data."""
        with self._lock:
            owners = [o for o in self._pages_of if kind is None or o[0] == kind]
            allocated = sum(len(self._pages_of[o]) for o in owners) * self.page_elems
            if allocated == 0:
                return 0.0
            used = sum(self._used_elems[o] for o in owners)
            return 1.0 - used / allocated

    def check(self) -> None:
        """Raise PagePoolError unless every page is free xor owned by exactly one owner."""
        with self._lock:
            free = [*self._free, *self._idle]
            if len(set(free)) != len(free):
                raise PagePoolError("a page is on the free list twice")
            owned: list[int] = [p for pages in self._pages_of.values() for p in pages]
            if len(set(owned)) != len(owned):
                raise PagePoolError("a page is owned twice")
            if set(free) & set(owned):
                raise PagePoolError(f"pages both free and owned: {sorted(set(free) & set(owned))[:8]}")
            if set(free) | set(owned) != set(range(self.num_pages)):
                leaked = set(range(self.num_pages)) - set(free) - set(owned)
                raise PagePoolError(f"leaked pages (neither free nor owned): {sorted(leaked)[:8]}")
            for pid, owner in self._owner_of.items():
                if pid not in self._pages_of.get(owner, ()):
                    raise PagePoolError(f"page {pid}: owner index disagrees ({owner})")
            if len(self._owner_of) != len(owned):
                raise PagePoolError("owner index and page lists differ in size")
            for kind in KINDS:
                n = sum(len(p) for o, p in self._pages_of.items() if o[0] == kind)
                if n != self._used_by_kind[kind]:
                    raise PagePoolError(f"{kind}: counted {self._used_by_kind[kind]} pages, owns {n}")
                ceiling = self.config.max_pages.get(kind)
                if ceiling is not None and n > ceiling:
                    raise PagePoolError(f"{kind}: {n} pages over its ceiling {ceiling}")

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "num_pages": self.num_pages,
                "page_elems": self.page_elems,
                "page_bytes": self.page_elems * self.pool.element_size(),
                "free_pages": self.num_free,
                "idle_cached_pages": len(self._idle),
                "kv_pages": self._used_by_kind["kv"],
                "adapter_pages": self._used_by_kind["adapter"],
                "adapter_fragmentation": self.fragmentation("adapter"),
            }

    # ---- views ---------------------------------------------------------------------------------
    def kv_caches(
        self, *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each a strided [num_pages, block_size, num_kv_heads, head_dim]
        view of the pool (a KV block = one page)."""
        need = kv_page_elems(
            num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        if need != self.page_elems:
            raise ValueError(f"KV block of {need} elements does not match page_elems={self.page_elems}")
        view = self.pool.view(self.num_pages, num_layers, 2, block_size, num_kv_heads, head_dim)
        return [(view[:, layer, 0], view[:, layer, 1]) for layer in range(num_layers)]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise PagePoolError(f"unknown page kind {kind!r}; kinds are {KINDS}")
