"""HostArena: the host memory of the CPU tier's adapter images, in whole pages of fixed-size slabs.

An image used to be one tensor of its own, page-locked on GPU hosts. torch's pinned allocator rounds
each allocation up to a power of two and keeps freed blocks in bins of that size, for reuse only by an
allocation of the same bin, so a tier of 1 GiB of images held 2 to 3 GiB of page-locked memory. The
arena allocates slabs of one size instead: a power of two of bytes, `SLAB_BYTES`, or more where a page is
so large that a slab would hold fewer than `SLAB_MIN_PAGES` (the tail no whole page fits is then under
1/16 of a slab). It cuts each into pages of the device pool's size and gives an image any free pages:
from the fullest slabs first, so that others empty out, and within a slab its longest runs first. An
image needs no contiguous memory, as its pages are copied to the device run by run anyway
(page_copier.py), so no free page is ever unusable. The arena adds slabs only when its free pages are
too few, one thread at a time, so it never holds more than the most pages its images held at once plus
one slab.

Images exceed the tier's budget for a while (a new image is read before older ones are trimmed, and
images waiting for a GPU slot are never trimmed). The arena gives empty slabs back while it holds more
than the budget and `spare_bytes` (`SPARE_BYTES`). A slab given back leaves the arena; on GPU hosts
torch's pinned allocator keeps it, page-locked, for the next slab (same size: no new page-locking),
elsewhere it goes back to the system.

Pages come back once the `HostPages` holding them is garbage (every reference dropped: the image's, and
that of a device copy still reading it); the arena frees them at its next call.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator

import torch

SLAB_BYTES = 64 << 20  # bytes of one slab, at least (a power of two: the pinned allocator's bins)
SLAB_MIN_PAGES = 16  # pages a slab holds at least: the tail no whole page fits wastes under 1/16 of it
SPARE_BYTES = 256 << 20  # empty slabs kept beyond the budget (an image being read before the tier is trimmed)


class HostPages:
    """`num_pages` pages of `page_elems` elements in host memory, as chunks of consecutive pages in page
    order (each a `[n, page_elems]` tensor). Read and write them through `page`, `slices` and `chunks`
    while holding this object: the memory returns to its arena once it is garbage."""

    __slots__ = ("chunks", "starts", "num_pages", "page_elems", "__weakref__")

    def __init__(self, chunks: list[torch.Tensor], page_elems: int) -> None:
        self.chunks, self.page_elems = chunks, page_elems
        self.starts, n = [], 0
        for chunk in chunks:
            self.starts.append(n)
            n += chunk.shape[0]
        self.num_pages = n

    @classmethod
    def standalone(cls, num_pages: int, page_elems: int, dtype: torch.dtype, pin: bool = False) -> HostPages:
        """Zeroed pages of their own (one tensor), outside any arena."""
        return cls([torch.zeros(num_pages, page_elems, dtype=dtype, pin_memory=pin)], page_elems)

    @property
    def dtype(self) -> torch.dtype:
        return self.chunks[0].dtype if self.chunks else torch.float32

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)

    def is_pinned(self) -> bool:
        return all(c.is_pinned() for c in self.chunks)

    def _chunk_of(self, page: int) -> int:
        lo, hi = 0, len(self.starts) - 1
        while lo < hi:  # the last chunk starting at or before `page`
            mid = (lo + hi + 1) // 2
            if self.starts[mid] <= page:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def page(self, index: int) -> torch.Tensor:
        """Page `index` as a 1-D view of `page_elems` elements."""
        if not 0 <= index < self.num_pages:
            raise IndexError(f"page {index} of {self.num_pages}")
        c = self._chunk_of(index)
        return self.chunks[c][index - self.starts[c]]

    def slices(self, first: int, count: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Pages [first, first + count) as (offset from `first`, `[n, page_elems]` view) pieces, one per chunk."""
        if count <= 0:
            return
        if first < 0 or first + count > self.num_pages:
            raise IndexError(f"pages {first}..{first + count} of {self.num_pages}")
        c, done = self._chunk_of(first), 0
        while done < count:
            local = first + done - self.starts[c]
            n = min(count - done, self.chunks[c].shape[0] - local)
            yield done, self.chunks[c][local : local + n]
            done += n
            c += 1

    def tensor(self) -> torch.Tensor:
        """The pages as one new contiguous `[num_pages, page_elems]` tensor (a copy, for tests and checks)."""
        if not self.chunks:
            return torch.zeros(0, self.page_elems)
        return torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0].clone()


class _Slab:
    __slots__ = ("memory", "pages", "free")

    def __init__(self, memory: torch.Tensor, pages: torch.Tensor) -> None:
        self.memory, self.pages = memory, pages  # the allocation (bytes), its whole pages
        self.free: list[tuple[int, int]] = [(0, pages.shape[0])]  # free runs (first page, count), in order


class HostArena:
    """Host pages for adapter images (see the module docstring); thread-safe."""

    def __init__(self, page_elems: int, dtype: torch.dtype, *, pin: bool = False, budget_bytes: int = 0,
                 slab_bytes: int | None = None, spare_bytes: int | None = None) -> None:
        slab_bytes = max(SLAB_BYTES, SLAB_MIN_PAGES * page_elems * dtype.itemsize) if slab_bytes is None else slab_bytes
        if page_elems <= 0 or slab_bytes <= 0:
            raise ValueError("HostArena: page_elems and slab_bytes must be positive")
        self.page_elems, self.dtype, self.pin = page_elems, dtype, pin
        self.page_bytes = page_elems * torch.tensor([], dtype=dtype).element_size()
        self.slab_bytes = 1 << (max(slab_bytes, self.page_bytes) - 1).bit_length()  # a power of two, a page or more
        self.slab_pages = self.slab_bytes // self.page_bytes
        self.budget_bytes = budget_bytes
        self.spare_bytes = SPARE_BYTES if spare_bytes is None else spare_bytes
        self._slabs: list[_Slab] = []
        self._lock = threading.Lock()
        self._grow_lock = threading.Lock()  # one thread adds slabs at a time (loads, never the step loop)
        # Pieces of garbage HostPages, taken back under the lock by the next call: a finalizer may run inside
        # this arena's own locked code (a collection the interpreter starts there), so it only appends.
        self._returned: deque[list[tuple[_Slab, int, int]]] = deque()

    # ---- figures -----------------------------------------------------------------------------------
    def figures(self) -> dict[str, int]:
        """`reserved`: bytes of the slabs the arena holds (the host memory it takes, whole slabs); `used`:
        bytes of the pages images hold. Read together, so `used` never exceeds `reserved`."""
        with self._lock:
            self._take_back()
            free = sum(n for slab in self._slabs for _, n in slab.free)
            return {"reserved": len(self._slabs) * self.slab_bytes,
                    "used": (len(self._slabs) * self.slab_pages - free) * self.page_bytes}

    @property
    def reserved_bytes(self) -> int:
        return self.figures()["reserved"]

    @property
    def used_bytes(self) -> int:
        return self.figures()["used"]

    def set_budget(self, budget_bytes: int) -> None:
        """The tier's byte budget changed: empty slabs beyond it (and the spare) are given back now."""
        with self._lock:
            self.budget_bytes = budget_bytes
            self._take_back()
            self._give_back_empty()

    def collect(self) -> None:
        """Take back the pages of images dropped since the last call, giving back empty slabs beyond the
        budget (the pool calls it after it trims the tier)."""
        with self._lock:
            self._take_back()
            self._give_back_empty()

    # ---- pages -----------------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> HostPages:
        """`num_pages` zeroed pages, in as few runs as the free pages allow; adds slabs when too few are free."""
        if num_pages < 0:
            raise ValueError(f"HostArena.allocate: {num_pages} pages")
        pieces, free = self._take_free(num_pages)
        if pieces is None:
            # Too few pages free: one thread at a time adds slabs (others wait, then look again, so concurrent
            # loads never each add slabs for the same shortfall). Page-locking a slab takes a while: done outside
            # the arena's lock, so frees and figures (the step loop's, a scrape's) never wait on it.
            with self._grow_lock:
                pieces, free = self._take_free(num_pages)
                while pieces is None:
                    new = [self._new_slab() for _ in range(-(-(num_pages - free) // self.slab_pages))]
                    pieces, free = self._take_free(num_pages, add=new)
        chunks = [slab.pages[first : first + n] for slab, first, n in pieces]
        for chunk in chunks:
            chunk.zero_()
        pages = HostPages(chunks, self.page_elems)
        # Not at interpreter exit: the pages of images still held must not be handed out again meanwhile.
        weakref.finalize(pages, self._returned.append, pieces).atexit = False
        return pages

    def _take_free(self, num_pages: int, add: list[_Slab] = ()) -> tuple[list[tuple[_Slab, int, int]] | None, int]:
        """Pages for an image from the free ones, after adding the slabs `add` (None if too few are free), and
        how many were free."""
        with self._lock:
            self._slabs.extend(add)
            self._take_back()
            free = sum(n for slab in self._slabs for _, n in slab.free)
            return (self._take(num_pages) if free >= num_pages else None), free

    def _new_slab(self) -> _Slab:
        memory = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin)
        whole = memory[: self.slab_pages * self.page_bytes].view(self.dtype).view(self.slab_pages, self.page_elems)
        return _Slab(memory, whole)

    def _take(self, num_pages: int) -> list[tuple[_Slab, int, int]]:
        """Free runs for `num_pages` pages (the caller holds the lock): from the fullest slabs first, so that
        others empty out and can leave; within a slab, its longest runs first (fewer pieces to copy)."""
        order = sorted(self._slabs, key=lambda slab: sum(n for _, n in slab.free))
        pieces, need = [], num_pages
        for slab in order:
            if need == 0:
                break
            runs = sorted(slab.free, key=lambda run: -run[1])
            while runs and need:
                first, n = runs.pop(0)
                k = min(n, need)
                pieces.append((slab, first, k))
                if k < n:
                    runs.append((first + k, n - k))
                need -= k
            slab.free = sorted(runs)
        index = {id(slab): i for i, slab in enumerate(self._slabs)}
        pieces.sort(key=lambda p: (index[id(p[0])], p[1]))  # in memory order: neighbours stay neighbours
        return pieces

    def _take_back(self) -> None:
        """Free the returned pieces, merging neighbouring runs (the caller holds the lock)."""
        while self._returned:
            for slab, first, n in self._returned.popleft():
                runs = sorted([*slab.free, (first, n)])
                merged = [runs[0]]
                for start, count in runs[1:]:
                    last_start, last_count = merged[-1]
                    if last_start + last_count == start:
                        merged[-1] = (last_start, last_count + count)
                    else:
                        merged.append((start, count))
                slab.free = merged

    def _give_back_empty(self) -> None:
        """Empty slabs leave while the arena holds more than the budget and the spare (the caller holds the lock)."""
        limit = self.budget_bytes + self.spare_bytes
        for slab in [s for s in self._slabs if s.free == [(0, self.slab_pages)]]:
            if len(self._slabs) * self.slab_bytes <= limit:
                break
            self._slabs.remove(slab)
