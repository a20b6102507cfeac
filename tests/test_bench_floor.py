"""The structure floor of bench/kernels.py reads, kernel by kernel, exactly the adapter bytes the floor counts."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from kernel_floor import kernel_bytes  # noqa: E402
from kernel_setup import adapter_bytes  # noqa: E402


def test_kernel_bytes_split_the_adapter_bytes() -> None:
    for ranks in ([16] * 32, [8, 16, 32, 64], [1]):
        sizes = kernel_bytes(ranks)
        assert len(sizes) == 8 and sum(sizes) == adapter_bytes(ranks)
    # Llama-3-8B, rank 16: q|k|v's shrink reads three 4096-wide A matrices, gate|up's expand two 14336-wide B.
    assert kernel_bytes([16])[0] == 3 * 16 * 4096 * 2 and kernel_bytes([16])[5] == 2 * 16 * 14336 * 2
