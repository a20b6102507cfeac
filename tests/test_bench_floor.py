"""The structure floor of bench/kernels.py reads, kernel by kernel, exactly the adapter bytes the floor counts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from kernel_floor import kernel_bytes  # noqa: E402
from kernel_setup import adapter_bytes  # noqa: E402


def test_kernel_bytes_split_the_adapter_bytes() -> None:
    for ranks in ([16] * 32, [8, 16, 32, 64], [1]):
        sizes = kernel_bytes(ranks)
        assert len(sizes) == 8 and sum(sizes) == adapter_bytes(ranks)
    # Llama-3-8B, rank 16: q|k|v's shrink reads three 4096-wide A matrices, gate|up's expand two 14336-wide B.
    assert kernel_bytes([16])[0] == 3 * 16 * 4096 * 2 and kernel_bytes([16])[5] == 2 * 16 * 14336 * 2


@pytest.mark.gpu
def test_cluster_barrier_orders_the_clusters_partials() -> None:
    """bench/kernel_cluster_floor.py's clusters: each CTA reads its cluster's partial sums only after all were written."""
    import torch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need a Hopper-or-newer GPU")
    from kernel_cluster_floor import cluster_barrier_works

    assert cluster_barrier_works(size=4, clusters=8) and cluster_barrier_works(size=8, clusters=16)
