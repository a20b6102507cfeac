"""pack_adapter's refusals name the adapter and the setting that would take it."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.adapter_image import AdapterShapeError, pack_adapter
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import TINY_DIMS, random_weights

PAGE_ELEMS = 1000


def test_rank_above_max_rank_names_adapter_and_flag():
    w = random_weights(0, rank=4, name="shout")
    with pytest.raises(AdapterShapeError) as exc:
        pack_adapter(w.modules, TINY_DIMS, page_elems=PAGE_ELEMS, max_rank=2, dtype=torch.float32, name=w.name)
    message = str(exc.value)
    assert message.startswith("adapter 'shout' has rank 4 (layers.0.q_proj)")
    assert "raise --max-lora-rank (at least 4)" in message


def test_rank_named_is_the_adapters_largest():
    """The flag's minimum covers every module, not only the first one above the limit."""
    w = random_weights(0, rank=4)
    w.modules[(1, "v_proj")] = random_weights(1, rank=16).modules[(1, "v_proj")]
    with pytest.raises(AdapterShapeError, match=r"rank 16 \(layers\.1\.v_proj\).*at least 16\)"):
        pack_adapter(w.modules, TINY_DIMS, page_elems=PAGE_ELEMS, max_rank=2, dtype=torch.float32)


def test_registering_an_adapter_above_max_rank_names_it():
    """What start-up reports (in the log and GET /admin/v1/state, or in the refusal when no adapter of the
    folder loads) for a local --adapters folder of too high a rank."""
    pages = PagePool(PagePoolConfig(num_pages=64, page_elems=PAGE_ELEMS))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=2, max_rank=2, num_load_threads=1))
    with pytest.raises(ValueError, match=r"adapter 'shout' has rank 4 .*raise --max-lora-rank \(at least 4\)"):
        pool.add("shout@1", random_weights(0, rank=4, name="shout"))
