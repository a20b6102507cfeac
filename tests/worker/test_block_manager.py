"""BlockManager over the PagePool: block tables grow by whole blocks and every page comes back."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.block_manager import BlockManager
from lorafleet.worker.page_pool import PagePool, PagePoolConfig, PagePoolError
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence


def _setup(num_pages=8, block_size=4):
    pool = PagePool(PagePoolConfig(num_pages=num_pages, page_elems=16, dtype=torch.float32))
    return pool, BlockManager(pool, block_size)


def _seq(n):
    return Sequence("r", list(range(n)), SamplingParams())


def test_allocate_grows_by_whole_blocks():
    pool, bm = _setup()
    seq = _seq(6)
    assert bm.num_blocks_needed(seq, 6) == 2
    bm.allocate(seq, 6)
    seq.num_computed_tokens = 6
    assert len(seq.block_table) == 2 and pool.owner_of(seq.block_table[0]) == ("kv", seq.seq_id)
    assert bm.num_blocks_needed(seq, 2) == 0  # tokens 7, 8 fit the second block
    assert bm.num_blocks_needed(seq, 3) == 1
    bm.allocate(seq, 3)
    assert len(seq.block_table) == 3
    assert bm.slot(seq, 8) == seq.block_table[2] * 4
    assert bm.slot(seq, 5) == seq.block_table[1] * 4 + 1


def test_can_allocate_respects_capacity_and_reserve():
    pool, bm = _setup(num_pages=3)
    seq = _seq(12)
    assert bm.can_allocate(seq, 12)
    assert not bm.can_allocate(seq, 13)
    assert not bm.can_allocate(seq, 8, reserve=2)
    other = _seq(4)
    bm.allocate(other, 4)
    assert not bm.can_allocate(seq, 12)


def test_free_returns_every_page_and_is_idempotent():
    pool, bm = _setup()
    seqs = [_seq(n) for n in (1, 4, 5, 9)]
    for s in seqs:
        bm.allocate(s, s.num_tokens)
    assert pool.num_used("kv") == 1 + 1 + 2 + 3
    for s in seqs:
        bm.free(s)
        bm.free(s)  # a second free is a no-op (the table is empty), never a double free
        assert s.block_table == [] and s.num_computed_tokens == 0
    pool.check()
    assert pool.num_free == pool.num_pages


def test_a_leaked_or_double_freed_page_is_caught():
    pool, bm = _setup()
    seq = _seq(4)
    bm.allocate(seq, 4)
    page = seq.block_table[0]
    bm.free(seq)
    with pytest.raises(PagePoolError):
        pool.free([page])
