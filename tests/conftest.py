"""Suite-wide settings: Triton runs in its interpreter on machines without a GPU."""

import os

import pytest

# Must be set before any @triton.jit function is imported.
if not os.environ.get("LORAFLEET_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One CPU thread per process for torch's and numpy's own ops (set before either is imported; the
    # worker and stager children inherit it). The CPU tests run tiny tensors, where a parallel region
    # costs more than it saves, and every process of a test (engine thread, worker children, pytest)
    # competes for the same few cores: on a 2-core machine, each tiny op waited on a thread
    # barrier for another process's time slice (tests ran several times slower). Set the variable
    # to run with more threads.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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


@pytest.fixture(autouse=True)
def _forget_finished_apps():
    """aiohttp memoizes each request's middleware chain in a module-level LRU cache (1024 entries) keyed
    by the app: every test app, with its engine, model and KV pool, stayed alive until the end of the
    suite, which then held tens of GB. A server runs one app for its life; a test suite runs hundreds."""
    yield
    from aiohttp import web_app

    cache = getattr(web_app, "_cached_build_middleware", None)
    if cache is not None:
        cache.cache_clear()
