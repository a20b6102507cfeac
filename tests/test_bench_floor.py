"""The structure floor of bench/lora_kernels.py reads, kernel by kernel, exactly the adapter bytes the floor counts;
the benchmarks name their result files by the GPU model."""

import sys
from pathlib import Path

import pytest

# Appended, not put first: no bench module may stand in for an installed package
# (transformers imports Hugging Face's `kernels`; no bench file takes that name).
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))

from bench_io import device_tag  # noqa: E402
from kernel_floor import kernel_bytes  # noqa: E402
from kernel_setup import activation_bytes, adapter_bytes  # noqa: E402


def test_kernel_bytes_split_the_adapter_bytes() -> None:
    for ranks in ([16] * 32, [8, 16, 32, 64], [1]):
        sizes = kernel_bytes(ranks)
        assert len(sizes) == 8 and sum(sizes) == adapter_bytes(ranks)
    # Llama-3-8B, rank 16: q|k|v's shrink reads three 4096-wide A matrices, gate|up's expand two 14336-wide B.
    assert kernel_bytes([16])[0] == 3 * 16 * 4096 * 2 and kernel_bytes([16])[5] == 2 * 16 * 14336 * 2


def test_the_moved_floor_counts_each_group_s_input_and_delta_once() -> None:
    """Llama-3-8B in bf16: q|k|v and gate|up read x (4096), o the attention's output (4096), down the activation
    (14336); the deltas written are q|k|v 6144, o 4096, gate|up 2 x 14336, down 4096 wide."""
    per_token = (3 * 4096 + 14336) + (6144 + 4096 + 2 * 14336 + 4096)
    assert activation_bytes(1) == 2 * per_token and activation_bytes(256) == 256 * 2 * per_token


def test_result_files_name_the_gpu_model() -> None:
    """JSON names carry the GPU's model, not the last word of its name ("HBM3" for an H100 SXM)."""
    assert device_tag("NVIDIA H100 80GB HBM3") == "h100" and device_tag("NVIDIA H200") == "h200"
    assert device_tag("NVIDIA A100-SXM4-80GB") == "a100" and device_tag("NVIDIA L40S") == "l40s"


@pytest.mark.gpu
def test_cluster_barrier_orders_the_clusters_partials() -> None:
    """bench/kernel_cluster_floor.py's clusters: each CTA reads its cluster's partial sums only after all were written."""
    import torch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need a Hopper-or-newer GPU")
    from kernel_cluster_floor import cluster_barrier_works

    assert cluster_barrier_works(size=4, clusters=8) and cluster_barrier_works(size=8, clusters=16)


def test_engine_shaped_layout_and_batch_give_the_exact_delta() -> None:
    """bench/lora_kernels.py's graph-shaped case (rank bound widened to the engine's 64, the batch padded as a
    captured decode step's) computes the same delta as the exact layout and batch, on the reference backend."""
    import torch
    from kernel_setup import graph_batch, widened

    from lorafleet.kernels.lora import lora_delta
    from lorafleet.kernels.lora_layout import make_lora_batch
    from tests.kernels.kernel_cases import random_pool_layout

    gen = torch.Generator().manual_seed(0)
    dims = {p: (32, 48) for p in range(7)}
    layout = random_pool_layout(ranks_by_slot=[1, 7, 16], dims=dims, page_elems=512, dtype=torch.float32, device="cpu", gen=gen)
    wide = widened(layout, 64)
    assert wide.max_rank == 64 and torch.equal(wide.a_offsets[..., :16], layout.a_offsets) and not wide.a_offsets[..., 16:].any()
    slots = torch.tensor([2, -1, 0, 2, 1, 0], dtype=torch.int32)
    exact, padded, old = make_lora_batch(slots, layout.max_rank_by_slot()), graph_batch(slots, wide, 64), graph_batch(slots, wide, 64, pool_bound=True)
    assert padded.max_rank == 16 and padded.num_segments == 1 + 3 and padded.mean_rank == 16  # ceil(6 / 16) + 3 slots
    assert old.max_rank == 64 and old.num_segments == len(slots)
    x = torch.randn(len(slots), 32, generator=gen)
    ys = []
    for lay, batch in ((layout, exact), (wide, padded), (wide, old)):
        y = torch.zeros(len(slots), 96)
        lora_delta(x=x, layout=lay, layer=0, proj_ids=[4, 5], batch=batch, y=y, out_offsets=[0, 48], backend="reference", accumulate=True)
        ys.append(y)
    assert ys[0].abs().sum() > 0
    torch.testing.assert_close(ys[1], ys[0])
    torch.testing.assert_close(ys[2], ys[0])


def test_gather_bmm_baseline_computes_each_tokens_delta() -> None:
    """bench/lora_kernels.py's gather+bmm baseline: ranks mixed (stacks padded to the largest with zeros), slot -1
    rows zero, each token's delta that of its own adapter."""
    import torch
    from kernel_setup import gather_bmm, stack_adapters

    gen = torch.Generator().manual_seed(0)
    k, n = 24, 40
    dense = {(s, 3): (torch.randn(r, k, generator=gen), torch.randn(n, r, generator=gen)) for s, r in enumerate([1, 8, 5])}
    stacks = stack_adapters(dense, 3)
    assert stacks[3][0].shape == (3, 8, k) and stacks[3][1].shape == (3, n, 8)
    slots = torch.tensor([2, -1, 0, 2, 1, 1], dtype=torch.int32)
    x = torch.randn(len(slots), k, generator=gen)
    got = gather_bmm(x, slots, *stacks[3], 0.5)
    for t, s in enumerate(slots.tolist()):
        want = torch.zeros(n) if s < 0 else (x[t] @ dense[(s, 3)][0].t()) @ dense[(s, 3)][1].t() * 0.5
        torch.testing.assert_close(got[t], want)
