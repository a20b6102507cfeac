"""Page-locked host memory of exactly the size asked, given back to the system with the last tensor on it.

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two and keeps freed blocks for
reuse by size: on an H100, the CPU tier's images summing to 994 MiB held 1,920 MiB of page-locked memory, and
2,816 MiB after a mix of adapter sizes, against a 1 GiB budget that the pool's metric said was kept. Here an
anonymous mapping of the image's own size is registered with CUDA (cudaHostRegister): copies from it are as
asynchronous as from torch's, and the mapping is unregistered and unmapped once no tensor uses it.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch


class _Registered(mmap.mmap):
    """An anonymous mapping registered with CUDA while it lives; tensors reach it through numpy, whose array
    holds it: the last tensor gone, it is unregistered, then unmapped."""

    ptr = 0

    def __del__(self) -> None:
        if self.ptr:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.ptr = 0


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of `shape` and `dtype` in page-locked host memory of its exact size (rounded up to the
    system's page size). Raises MemoryError when CUDA refuses to register it (too much locked memory)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = _Registered(-1, nbytes)  # fresh pages of zeros
    raw = np.frombuffer(region, dtype=np.uint8)
    ptr = raw.ctypes.data
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise MemoryError(f"cudaHostRegister of {nbytes} bytes failed ({err})")
    region.ptr = ptr
    return torch.from_numpy(raw).view(dtype).view(shape)
