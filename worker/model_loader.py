"""Model loading: safetensors weights of an HF-style directory (one file or a sharded index).

Only safetensors are read; a directory holding nothing but pickle checkpoints (`*.bin`, `*.pt`) is
refused rather than unpickled, and so is an index that names anything but safetensors files inside
the directory.

A load logs a line per file read (files, bytes and seconds so far): a large sharded model takes minutes,
and the log shows it advancing rather than hung.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorafleet.worker.llama import LlamaModel
from lorafleet.worker.model_config import ModelConfig, ModelConfigError, read_json

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def _shard_names(index: Path) -> list[str]:
    """The shard files an index names, each a plain `*.safetensors` name in the index's directory."""
    try:
        weight_map = read_json(index)["weight_map"]
    except (KeyError, TypeError):
        raise ModelConfigError(f"{index} has no \"weight_map\" object (tensor name -> shard file)") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelConfigError(f"{index}: \"weight_map\" must map tensor names to shard file names")
    files = sorted(set(weight_map.values()))
    bad = [f for f in files if Path(f).name != f or not f.endswith(".safetensors")]
    if bad:
        raise ModelConfigError(f"{index} names shards that are not safetensors files in its directory: {bad}")
    if not files:
        raise ModelConfigError(f"{index} names no shards")
    return files


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in index order when sharded."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        files = _shard_names(index)
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ModelConfigError(f"{index} names shards that are not there: {missing}")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelConfigError(f"{model_dir} holds only pickle checkpoints; convert them to safetensors")
    raise ModelConfigError(f"no safetensors weights in {model_dir}")


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = weight_files(model_dir)
    sizes = [path.stat().st_size for path in files]
    total, done, start = sum(sizes), 0, time.monotonic()
    log.info("loading %s: %d safetensors file(s), %s", model_dir, len(files), _gib(total))
    for i, (path, size) in enumerate(zip(files, sizes, strict=True), 1):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:  # truncated or not a safetensors file at all
            raise ModelConfigError(f"{path} is not a readable safetensors file: {exc}") from None
        done += size
        log.info("loaded %s: file %d/%d, %s of %s in %.1f s", path.name, i, len(files), _gib(done), _gib(total),
                 time.monotonic() - start)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype, device: torch.device | str, config: ModelConfig | None = None
) -> LlamaModel:
    config = config or ModelConfig.from_dir(model_dir)
    model = LlamaModel(config, dtype=dtype, device=device)
    model.load_weights(iter_weights(model_dir))
    return model.eval()
