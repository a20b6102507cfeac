"""Page-locked images of exactly their size, unregistered and unmapped with the last tensor on them (GPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from lorafleet.worker import pinned_memory

pytestmark = pytest.mark.gpu


@pytest.fixture
def released(monkeypatch) -> list[int]:
    """Sizes of the regions unregistered so far."""
    gone: list[int] = []

    class Counted(pinned_memory._Registered):
        def __del__(self) -> None:
            if self.ptr:
                gone.append(len(self))
            super().__del__()

    monkeypatch.setattr(pinned_memory, "_Registered", Counted)
    return gone


def test_pinned_zeros_are_page_locked_exact_and_copy_asynchronously(released):
    pages = pinned_memory.pinned_zeros((3, 1000), torch.bfloat16)
    assert pages.is_pinned() and pages.shape == (3, 1000) and pages.dtype == torch.bfloat16
    assert not pages.any() and pages.untyped_storage().nbytes() == 6000  # not rounded up to 8192
    pages.copy_(torch.arange(3000, dtype=torch.bfloat16).view(3, 1000))
    on_gpu = pages.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), pages)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == 0  # none of torch's pinned blocks


def test_the_region_goes_with_the_last_tensor_on_it(released):
    pages = pinned_memory.pinned_zeros((4, 512), torch.float16)
    row = pages[1]  # a view keeps it
    del pages
    gc.collect()
    assert released == [] and row.is_pinned()
    del row
    gc.collect()
    assert released == [4 * 512 * 2]
