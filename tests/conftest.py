"""Suite-wide settings: Triton runs in its interpreter on machines without a GPU."""

import os

import pytest

# Must be set before any @triton.jit function is imported.
if not os.environ.get("LORAFLEET_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with LORAFLEET_TEST_GPU=1 on a GPU machine)")
    skip_slow = pytest.mark.skip(reason="slow; set LORAFLEET_SLOW=1")
    has_gpu = _has_cuda() and os.environ.get("LORAFLEET_TEST_GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not os.environ.get("LORAFLEET_SLOW"):
            item.add_marker(skip_slow)
