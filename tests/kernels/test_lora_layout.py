"""LoRABatch grouping and the pool packing rule (rows never straddle a page)."""

import pytest
import torch

from lorafleet.kernels.lora_layout import LoRALayout, make_lora_batch, pack_lora_layout, segment_len
from tests.kernels.kernel_cases import POPULARITIES, random_adapters, token_slots


def test_running_example():
    batch = make_lora_batch(torch.tensor([2, -1, 0, 2, 0], dtype=torch.int32), torch.tensor([4, 8, 16], dtype=torch.int32))
    assert batch.sorted_token_ids.tolist() == [2, 4, 0, 3]
    assert batch.seg_starts.tolist() == [0, 2, 4]
    assert batch.seg_slots.tolist() == [0, 2]
    assert batch.max_rank == 16  # slot 1 (rank 8) is not in the batch; the largest used rank is 16
    assert batch.mean_rank == pytest.approx((16 + 4 + 16 + 4) / 4)  # over the tokens with a slot
    assert batch.planning_rank == batch.mean_rank
    assert not batch.every_token  # token 1 has no adapter and is in no segment
    assert make_lora_batch(torch.tensor([2, 0], dtype=torch.int32), torch.tensor([4, 8, 16], dtype=torch.int32)).every_token
    assert make_lora_batch(torch.tensor([2, -1], dtype=torch.int32), torch.tensor([4, 8, 16], dtype=torch.int32), grouped=False).every_token


@pytest.mark.parametrize("popularity", POPULARITIES)
def test_groups_every_token_with_a_slot_once(popularity, gen):
    slots = token_slots(popularity, 37, 9, gen)
    ranks = torch.randint(1, 65, (9,), generator=gen, dtype=torch.int32)
    batch = make_lora_batch(slots, ranks, max_segment_len=64)
    ids = batch.sorted_token_ids.long()
    assert sorted(ids.tolist()) == [t for t, s in enumerate(slots.tolist()) if s >= 0]
    assert batch.seg_slots.unique().numel() == batch.num_segments  # distinct (no run above 64 tokens here)
    for s in range(batch.num_segments):
        seg = ids[batch.seg_starts[s] : batch.seg_starts[s + 1]]
        assert seg.numel() > 0
        assert (slots[seg] == batch.seg_slots[s]).all()
        assert seg.tolist() == sorted(seg.tolist())  # stable: original order inside a segment
    used = slots[slots >= 0].long()
    assert batch.max_rank == (int(ranks[used].max()) if used.numel() else 0)
    assert batch.mean_rank == pytest.approx(float(ranks[used].float().mean()) if used.numel() else 0.0)


def test_long_runs_are_cut_into_segments_of_bounded_length():
    slots = torch.tensor([1, 0, 1, 1, -1, 1, 0, 1, 1], dtype=torch.int32)
    batch = make_lora_batch(slots, torch.tensor([4, 8], dtype=torch.int32), max_segment_len=2)
    assert batch.sorted_token_ids.tolist() == [1, 6, 0, 2, 3, 5, 7, 8]
    assert batch.seg_starts.tolist() == [0, 2, 4, 6, 8]
    assert batch.seg_slots.tolist() == [0, 1, 1, 1]
    batch = make_lora_batch(slots, torch.tensor([4, 8], dtype=torch.int32), max_segment_len=4)
    assert batch.seg_starts.tolist() == [0, 2, 6, 8] and batch.seg_slots.tolist() == [0, 1, 1]


def test_segment_length_grows_with_the_step():
    # 16 tokens while a step is small (decode: one adapter's tokens on several programs), then the
    # largest power of two keeping 16 segments, capped by `most`.
    assert [segment_len(n) for n in (0, 1, 64, 256, 511, 512, 1023, 1024, 8192)] == [16, 16, 16, 16, 16, 32, 32, 64, 64]
    assert segment_len(8192, most=128) == 128 and segment_len(1024, most=32) == 32 and segment_len(64, most=8) == 8
    rank = torch.tensor([16], dtype=torch.int32)
    for num_tokens, expected in ((64, 16), (512, 32), (1024, 64)):
        batch = make_lora_batch(torch.zeros(num_tokens, dtype=torch.int32), rank)  # one adapter's prefill
        assert batch.num_segments == num_tokens // expected
        assert set(torch.diff(batch.seg_starts).tolist()) == {expected}
    batch = make_lora_batch(torch.zeros(1024, dtype=torch.int32), rank, max_segment_len=16)  # an explicit bound wins
    assert batch.num_segments == 64


def test_ungrouped_batch_has_one_segment_per_token():
    slots = torch.tensor([3, -1, 3, 0], dtype=torch.int32)
    batch = make_lora_batch(slots, torch.tensor([8, 0, 0, 32], dtype=torch.int32), grouped=False)
    assert batch.seg_slots.tolist() == [3, -1, 3, 0]
    assert batch.seg_starts.tolist() == [0, 1, 2, 3, 4]
    assert batch.sorted_token_ids.tolist() == [0, 1, 2, 3]
    assert batch.max_rank == 32


def test_refuses_bad_slots():
    with pytest.raises(ValueError, match="max_slots"):
        make_lora_batch(torch.tensor([0, 5], dtype=torch.int32), torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=">= -1"):
        make_lora_batch(torch.tensor([-2], dtype=torch.int32), torch.ones(3, dtype=torch.int32))


def test_packing_never_straddles_a_page_and_keeps_metadata(gen):
    dims = {0: (64, 64), 1: (64, 32), 6: (96, 64)}
    modules = random_adapters(num_slots=5, num_layers=2, dims=dims, gen=gen)
    page_elems = 200  # not a multiple of any row width: forces page breaks
    order = torch.randperm(1000, generator=gen)
    layout = pack_lora_layout(modules, num_layers=2, max_slots=6, page_elems=page_elems, dtype=torch.float32, num_pages=1000, page_order=order)
    flat = layout.pool.view(-1)
    for (slot, layer, proj), (a, b, scale) in modules.items():
        r = a.shape[0]
        assert int(layout.ranks[layer, proj, slot]) == r  # rank travels with the weights
        assert float(layout.scales[layer, proj, slot]) == pytest.approx(scale)
        for j in range(r):
            for offs, row in ((layout.a_offsets, a[j]), (layout.b_offsets, b[:, j])):
                start = int(offs[layer, proj, slot, j])
                assert start // page_elems == (start + row.numel() - 1) // page_elems
                assert torch.equal(flat[start : start + row.numel()], row)
    assert int(layout.ranks[:, :, 5].abs().sum()) == 0  # an empty slot adapts nothing


def test_layout_checks_its_tensors():
    good = dict(
        pool=torch.zeros(2, 8),
        ranks=torch.zeros(1, 7, 2, dtype=torch.int32),
        scales=torch.zeros(1, 7, 2),
        a_offsets=torch.zeros(1, 7, 2, 4, dtype=torch.int64),
        b_offsets=torch.zeros(1, 7, 2, 4, dtype=torch.int64),
    )
    LoRALayout(**good)
    with pytest.raises(ValueError, match="ranks"):
        LoRALayout(**{**good, "ranks": torch.zeros(1, 6, 2, dtype=torch.int32)})
    with pytest.raises(ValueError, match="a_offsets"):
        LoRALayout(**{**good, "a_offsets": torch.zeros(1, 7, 2, 4, dtype=torch.int32)})


def test_make_lora_batch_refuses_a_rank_table_that_is_not_per_slot():
    layout = pack_lora_layout({(0, 0, 0): (torch.ones(2, 8), torch.ones(8, 2), 1.0)}, num_layers=1, max_slots=2, page_elems=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_rank_by_slot must be 1-D"):
        make_lora_batch(torch.tensor([0, 0], dtype=torch.int32), layout.ranks)  # layout.max_rank_by_slot() meant


def test_packing_refuses_bad_keys_and_page_order():
    a, b = torch.ones(2, 8), torch.ones(8, 2)
    kw = dict(num_layers=1, max_slots=2, page_elems=16, dtype=torch.float32)
    for key in [(-1, 0, 0), (2, 0, 0), (0, 1, 0), (0, 0, 7)]:  # slot -1 used to land silently in the last slot
        with pytest.raises(ValueError, match=r"\(slot, layer, proj_id\) must lie in"):
            pack_lora_layout({key: (a, b, 1.0)}, **kw)
    with pytest.raises(ValueError, match="page_order must be a permutation"):
        pack_lora_layout({(0, 0, 0): (a, b, 1.0), (1, 0, 0): (a, b, 1.0)}, **kw, page_order=torch.tensor([0, 0, 1, 2]))  # 4 pages, two rows each


def test_layout_refuses_mismatched_offsets_devices_and_dtypes():
    lay = pack_lora_layout({(0, 0, 0): (torch.ones(2, 8), torch.ones(8, 2), 1.0)}, num_layers=1, max_slots=2, page_elems=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="a_offsets and b_offsets must have one shape"):
        LoRALayout(lay.pool, lay.ranks, lay.scales, lay.a_offsets, lay.b_offsets[..., :1].contiguous())
    with pytest.raises(ValueError, match="share one device"):
        LoRALayout(lay.pool, lay.ranks.to("meta"), lay.scales, lay.a_offsets, lay.b_offsets)
    with pytest.raises(ValueError, match="floating dtype"):
        LoRALayout(lay.pool.int(), lay.ranks, lay.scales, lay.a_offsets, lay.b_offsets)
