"""worker/safetensors_bytes.py against the safetensors library itself: the same tensors from every valid file,
a refusal of every file the library refuses, and no stall of other threads while it copies."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import safetensors
import safetensors.torch
import torch

from lorafleet.worker.safetensors_bytes import DTYPES, SafetensorsError, load_tensors
from tests.ticker import ticking


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"t_{name}": torch.randn(3, 5, generator=g).mul(7).to(dtype) for name, dtype in DTYPES.items()}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    out["odd"] = torch.arange(7, dtype=torch.int8)  # leaves the next tensor's data at an odd byte
    out["after_odd"] = torch.randn(2, 3, generator=g, dtype=torch.float32)
    return out


def _split(raw: bytes) -> tuple[dict, bytes]:
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _join(header: dict | bytes, data: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def test_valid_files_give_the_librarys_tensors_owning_their_memory():
    raw = safetensors.torch.save(_sample(), metadata={"format": "pt"})
    ours, theirs = load_tensors(raw), safetensors.torch.load(raw)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        mine, bytes_of = ours[name].reshape(-1), tensor.reshape(-1).view(torch.uint8)
        assert torch.equal(mine.view(torch.uint8), bytes_of), name  # bit for bit (NaNs too)
        mine.view(torch.uint8).fill_(1)  # writable: its own memory, not the file's bytes
    assert _split(raw)[1] == _split(safetensors.torch.save(theirs, metadata={"format": "pt"}))[1]


def _corruptions(raw: bytes):
    header, data = _split(raw)
    names = [n for n in header if n != "__metadata__" and math.prod(header[n]["shape"]) > 1]  # a change shows
    rng = random.Random(1)
    yield "empty", b""
    yield "short", raw[:5]
    yield "truncated data", raw[:-3]
    yield "trailing data", raw + b"\0" * 4
    yield "header past the end", (len(raw)).to_bytes(8, "little") + raw[8:]
    yield "not json", _join(b"{nope", data)
    yield "not utf-8", _join(b'{"\xff": 1}', data)
    yield "a list", _join(b"[]", data)
    yield "metadata not strings", _join({**header, "__metadata__": {"a": 1}}, data)
    for name in rng.sample(names, 6):
        info = header[name]
        begin, end = info["data_offsets"]
        yield f"{name} unknown dtype", _join({**header, name: {**info, "dtype": "F7"}}, data)
        yield f"{name} bool shape", _join({**header, name: {**info, "shape": [True] * len(info["shape"])}}, data)
        yield f"{name} negative shape", _join({**header, name: {**info, "shape": [-1, *info["shape"]]}}, data)
        yield f"{name} bigger shape", _join({**header, name: {**info, "shape": [2, *info["shape"]]}}, data)
        yield f"{name} reversed", _join({**header, name: {**info, "data_offsets": [end, begin]}}, data)
        yield f"{name} shifted", _join({**header, name: {**info, "data_offsets": [begin + 1, end + 1]}}, data)
        yield f"{name} no offsets", _join({**header, name: {k: v for k, v in info.items() if k != "data_offsets"}},
                                          data)
        yield f"{name} dropped", _join({k: v for k, v in header.items() if k != name}, data)
        yield f"{name} entry not an object", _join({**header, name: 3}, data)
    empty = {"dtype": "F32", "data_offsets": [len(data), len(data)]}
    for shape in ([0, 2**64], [0, 2**40, 2**40]):  # no bytes, sizes torch cannot hold
        yield f"empty of shape {shape}", _join({**header, "huge": {**empty, "shape": shape}}, data)
    name = names[0]
    text = json.dumps(header)
    yield "NaN in a field", _join(text.replace('"dtype"', '"x": NaN, "dtype"', 1).encode(), data)
    yield "a lone surrogate", _join(text.replace(f'"{name}"', '"\\ud800"', 1).encode(), data)
    first, second = sorted(names, key=lambda n: header[n]["data_offsets"])[1:3]
    swapped = {**header, first: {**header[first], "data_offsets": header[second]["data_offsets"]}}
    yield "two tensors on one span", _join(swapped, data)


def test_what_the_library_accepts_beyond_what_torch_writes_is_read_too():
    """Null __metadata__ and unsigned tensors, as other writers make them."""
    tensors = {"u16": torch.arange(6).to(torch.uint16).view(2, 3), "u32": torch.arange(3).to(torch.uint32)}
    header, data = _split(safetensors.torch.save(tensors))
    raw = _join({**header, "__metadata__": None}, data)
    ours, theirs = load_tensors(raw), safetensors.torch.load(raw)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_tensor_listed_twice_is_refused_by_its_name():
    """The header names one tensor twice: the same entry (the library keeps the last and loads) or another span
    (refused, as a gap at the first's bytes): each is refused, naming the tensor listed twice."""
    raw = safetensors.torch.save({"a": torch.ones(2), "b": torch.zeros(3)})
    size = int.from_bytes(raw[:8], "little")
    header, data = raw[8:8 + size].rstrip(), raw[8 + size:]  # the header is padded with spaces
    a, b = (json.dumps(_split(raw)[0][k]).encode() for k in ("a", "b"))
    for twice in (header[:-1] + b',"a":' + a + b"}", header[:-1] + b',"a":' + b + b"}"):
        with pytest.raises(SafetensorsError, match="the header gives 'a' twice"):
            load_tensors(_join(twice, data))
    assert json.loads(twice)["a"] == json.loads(b)  # the JSON itself is well formed: its last "a" stands


CORRUPT = dict(_corruptions(safetensors.torch.save(_sample())))


@pytest.mark.parametrize("label", CORRUPT)
def test_a_file_the_library_refuses_is_refused(label):
    raw = CORRUPT[label]
    with pytest.raises(Exception):  # noqa: B017 - the library raises SafetensorError, ValueError, ...
        safetensors.torch.load(raw)  # each case does break the format
    with pytest.raises(SafetensorsError):
        load_tensors(raw)


def test_other_threads_run_while_a_large_file_is_copied_out():
    """A 256 MiB file in 32 tensors: a thread ticking every millisecond is never held up for the whole load
    (safetensors.torch.load holds the interpreter lock over all of it)."""
    raw = safetensors.torch.save({f"w{i}": torch.full((1024, 2048), float(i)) for i in range(32)})
    with ticking(0.001) as ticks:
        time.sleep(0.01)
        started = time.perf_counter()
        tensors = load_tensors(raw)
        took = time.perf_counter() - started
    assert float(tensors["w31"][0, 0]) == 31.0
    during = [b - a for a, b in zip(ticks, ticks[1:], strict=False) if b > started and a < started + took]
    assert len(during) > 1 and max(during) < took  # the ticker kept running during the load
