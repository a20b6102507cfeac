"""BlockManager: per-sequence KV block tables over a page allocator.

The allocator is anything with `can_allocate(n, kind) / allocate(n, owner) / free(ids)` (the
PagePool); a KV block is one page, owned by `("kv", seq_id)`.
"""

from __future__ import annotations

from typing import Protocol

from lorafleet.worker.sequence import Sequence


class PageAllocator(Protocol):
    def can_allocate(self, num_pages: int, kind: str = "kv") -> bool: ...
    def allocate(self, num_pages: int, owner: tuple[str, object]) -> list[int]: ...
    def free(self, page_ids: list[int]) -> None: ...


class BlockManager:
    def __init__(self, allocator: PageAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size

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

    def free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat KV slot of token `position`: page_id * block_size + offset."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
