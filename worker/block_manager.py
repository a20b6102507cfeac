"""BlockManager: per-sequence KV block tables over a page allocator.

The allocator is anything with `can_allocate(n, kind) / allocate(n, owner) / free(ids)` (the
PagePool); a KV block is one page, owned by `("kv", seq_id)`. With a prefix cache (prefix_cache.py) a sequence's
table begins with the kept blocks it found (`seq.prefix_blocks`), and its own full blocks are kept when it leaves.
"""

from __future__ import annotations

from typing import Protocol

from lorafleet.worker.prefix_cache import PrefixCache
from lorafleet.worker.sequence import Sequence


class PageAllocator(Protocol):
    def can_allocate(self, num_pages: int, kind: str = "kv") -> bool: ...
    def allocate(self, num_pages: int, owner: tuple[str, object]) -> list[int]: ...
    def free(self, page_ids: list[int]) -> None: ...


class BlockManager:
    def __init__(self, allocator: PageAllocator, block_size: int, *, prefix_caching: bool = False) -> None:
        """`prefix_caching` needs a PagePool as `allocator` (its idle pages hold the kept blocks)."""
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = PrefixCache(allocator, block_size) if prefix_caching else None

    def attach(self, seq: Sequence) -> None:
        """A sequence about to be admitted with nothing computed starts from the kept blocks its tokens begin with
        (none when it asks for prompt logprobs: they need every position computed)."""
        if self.prefix_cache is None or seq.block_table or seq.params.prompt_logprobs is not None:
            return
        seq.prefix_blocks = self.prefix_cache.lookup(seq)
        seq.block_table = [b.page for b in seq.prefix_blocks]
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs so that `num_new_tokens` more tokens fit in its cache."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, *, reserve: int = 0) -> bool:
        """`reserve`: blocks already promised to other sequences of the same step."""
        return self.allocator.can_allocate(self.num_blocks_needed(seq, num_new_tokens) + reserve, "kv")

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need:
            seq.block_table.extend(self.allocator.allocate(need, ("kv", seq.seq_id)))

    def keep_computed(self, seq: Sequence) -> None:
        """After a step that ran: `seq`'s blocks it filled are kept now, for the sequences admitted while it runs."""
        if self.prefix_cache is not None:
            self.prefix_cache.grow(seq)

    def free(self, seq: Sequence, *, keep: bool = False) -> None:
        """Give back `seq`'s pages; `keep`: its full computed blocks go to the prefix cache (their KV is sound)."""
        held, own = seq.prefix_blocks, seq.block_table[len(seq.prefix_blocks):]
        if self.prefix_cache is not None and (held or keep):
            made = self.prefix_cache.insert(seq, held, own) if keep else []
            kept = {b.page for b in made}
            own = [p for p in own if p not in kept]
            self.prefix_cache.release(held + made)
        if own:
            self.allocator.free(own)
        seq.block_table, seq.prefix_blocks, seq.num_computed_tokens = [], [], 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat KV slot of token `position`: page_id * block_size + offset."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
