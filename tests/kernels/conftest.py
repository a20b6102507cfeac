"""Kernel tests: each test gets its own seed. Their helpers are `tests.kernels.kernel_cases`: this folder is not put
on sys.path, where its conftest.py could be found as the top-level `conftest` in place of another folder's."""

import zlib

import pytest
import torch


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per case, reproducible per run."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
