"""A safetensors file's tensors from its bytes, read once (never a memory map of the file): the format's rules
checked as the safetensors library checks them, then each tensor copied out of the bytes by torch, which lets
go of the interpreter lock while it copies.

`safetensors.torch.load` copies every tensor into a Python bytes object with the lock held: a loader thread
parsing one tenant's 512 MiB adapter stalled the event loop and the step loop (every other tenant's stream)
for 0.03-0.2 s, against 3 ms here (bench: a ticker on the loop while a thread loads).

Format: 8 bytes little-endian N, N bytes of a UTF-8 JSON object {name: {"dtype", "shape", "data_offsets":
[begin, end]}, optional "__metadata__": {str: str}}, then the data, which the tensors' spans cover exactly,
in order, without gaps or overlaps."""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from collections.abc import Callable

import torch

from lorafleet.worker.gc_pause import collections_paused

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# The bytes are never written through the views: each is cloned at once.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class SafetensorsError(ValueError):
    """Not a well-formed safetensors file (truncated, foreign, or its index contradicting its data)."""


def load_tensors(raw: bytes, check: Callable[[dict[str, list[int]]], None] | None = None) -> dict[str, torch.Tensor]:
    """name -> tensor (owning its memory) of the safetensors file whose bytes are `raw`. `check` sees every
    tensor's shape (name -> shape) before any is copied, and may refuse the file by raising."""
    if len(raw) < 8:
        raise SafetensorsError(f"{len(raw)} bytes, shorter than the 8-byte header length")
    size = int.from_bytes(raw[:8], "little")
    if size > len(raw) - 8:
        raise SafetensorsError(f"a header of {size} bytes in a file of {len(raw)}: truncated, or not safetensors")
    try:
        with collections_paused():
            header = json.loads(raw[8:8 + size].decode("utf-8"), object_pairs_hook=_object,
                                parse_constant=_no_constant)
    except SafetensorsError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SafetensorsError(f"the header is not UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) and _utf8(v) for v in metadata.values()):
        raise SafetensorsError("__metadata__ must map names to strings")
    start, data_size = 8 + size, len(raw) - 8 - size
    entries = sorted((_entry(name, info) for name, info in header.items()), key=lambda e: e[3])
    end = 0
    for name, _, _, (begin, stop) in entries:
        if begin != end:
            raise SafetensorsError(f"tensor {name!r} starts at byte {begin} of the data, where {end} was due "
                                   f"(the tensors' spans must follow one another without gaps or overlaps)")
        end = stop
    if end != data_size:
        raise SafetensorsError(f"the tensors cover {end} bytes of data, but the file holds {data_size}")
    if check is not None:
        check({name: shape for name, _, shape, _ in entries})
    return {name: _tensor(raw, start + begin, dtype, shape) for name, dtype, shape, (begin, _) in entries}


def _entry(name: str, info: object) -> tuple[str, torch.dtype, list[int], tuple[int, int]]:
    if not isinstance(info, dict):
        raise SafetensorsError(f"tensor {name!r}: its entry is not an object")
    dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise SafetensorsError(f"tensor {name!r}: dtype {info.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise SafetensorsError(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
    if math.prod(d for d in shape if d) * dtype.itemsize >= 1 << 63:  # torch's sizes and strides are int64
        raise SafetensorsError(f"tensor {name!r}: shape {shape} is too large")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != offsets[1] - offsets[0]:
        raise SafetensorsError(f"tensor {name!r}: shape {shape} of {info['dtype']} is {nbytes} bytes, but its "
                               f"data_offsets span {offsets[1] - offsets[0]}")
    return name, dtype, shape, (offsets[0], offsets[1])


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are text (no lone surrogates), each given once: the library keeps the last of a
    key given twice, a tensor listed twice included (its first span then reads as a gap)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise SafetensorsError(f"the header gives {twice!r} twice (a tensor, or a field of one, listed twice)")
    if not all(_utf8(k) for k in out):
        raise ValueError("a key is not valid Unicode text")
    return out


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(raw: bytes, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    count = math.prod(shape)
    try:
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype, count=count, offset=offset).view(shape).clone()
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:  # a shape torch cannot make
        raise SafetensorsError(f"a tensor of shape {shape} and {dtype} cannot be made ({exc})") from None
