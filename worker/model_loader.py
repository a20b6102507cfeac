"""Model loading: safetensors weights of an HF-style directory (one file or a sharded index).

Only safetensors are read; a directory holding nothing but pickle checkpoints (`*.bin`, `*.pt`) is
refused rather than unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from lorafleet.worker.llama import LlamaModel
from lorafleet.worker.model_config import ModelConfig, ModelConfigError


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in index order when sharded."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
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
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype, device: torch.device | str, config: ModelConfig | None = None
) -> LlamaModel:
    config = config or ModelConfig.from_dir(model_dir)
    model = LlamaModel(config, dtype=dtype, device=device)
    model.load_weights(iter_weights(model_dir))
    return model.eval()
