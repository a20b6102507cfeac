"""BlockManager: per-sequence KV block tables over a page allocator.

The allocator is anything with `can_allocate(n, kind) / allocate(n, owner) / free(ids)` (the
PagePool); a KV block is one page, owned by `("kv", seq_id)`. With a prefix cache (prefix_cache.py) a sequence's
table begins with the kept blocks it holds (`seq.prefix_blocks`): those it found, then its own full blocks, kept as
steps fill them and when it leaves.
"""

from __future__ import annotations

from typing import Protocol

from lorafleet.worker.prefix_cache import PrefixCache
from lorafleet.worker.scheduled_batch import ScheduledBatch
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
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def admitted(self, seq: Sequence) -> None:
        """`seq` was admitted from what `attach` found: its lookup counts (vllm:prefix_cache_queries/hits); one that
        failed to be admitted and let its blocks go does not."""
        if seq.first_cached_tokens is None:  # a preempted sequence admitted again keeps what it first found
            seq.first_cached_tokens = seq.num_cached_tokens
        if self.prefix_cache is not None and seq.params.prompt_logprobs is None:
            self.prefix_cache.queried_tokens += seq.num_tokens
            self.prefix_cache.hit_tokens += seq.num_cached_tokens

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

    def filled_by_another(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Whether waiting `seq` had better wait a step: `batch` fills a block of its tokens (PrefixCache)."""
        return (self.prefix_cache is not None and seq.params.prompt_logprobs is None
                and self.prefix_cache.filled_by_another(seq, batch))

    def keep_computed(self, seq: Sequence) -> None:
        """After a step that ran: `seq`'s blocks it filled are kept now, for the sequences admitted while it runs."""
        if self.prefix_cache is not None:
            self.prefix_cache.grow(seq)

    def free(self, seq: Sequence, *, keep: bool = False) -> None:
        """Give back `seq`'s pages; `keep`: its full computed blocks go to the prefix cache (their KV is sound)."""
        if self.prefix_cache is not None:
            if keep:
                self.prefix_cache.grow(seq)
            self.prefix_cache.release(seq.prefix_blocks)
        if own := seq.block_table[len(seq.prefix_blocks):]:
            self.allocator.free(own)
        seq.block_table, seq.prefix_blocks, seq.num_computed_tokens, seq.num_cached_tokens = [], [], 0, 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat KV slot of token `position`: page_id * block_size + offset."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
