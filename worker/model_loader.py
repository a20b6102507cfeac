"""Model loading: safetensors weights of an HF-style directory (one file or a sharded index).

Which files, as transformers picks them: `model.safetensors` when present (an index beside it is
ignored), else the shards `model.safetensors.index.json` names, else every `*.safetensors` file. A tensor
found in two files is refused rather than one copy silently replacing the other.

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


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file, each shard a plain `*.safetensors` name in its directory."""
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
    return weight_map


def _weight_source(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files to read and, when they come from the shard index, its weight_map. Same order as
    transformers: model.safetensors first, then the index (a stale index beside a whole file is ignored)."""
    single = model_dir / "model.safetensors"
    index = model_dir / INDEX_FILE
    if single.is_file():
        if index.is_file():
            log.warning("%s: both model.safetensors and %s are present; reading model.safetensors, as "
                        "transformers does (the index is ignored)", model_dir, INDEX_FILE)
        return [single], None
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ModelConfigError(f"{index} names shards that are not there: {missing}")
        return [model_dir / f for f in files], weight_map
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found, None
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelConfigError(f"{model_dir} holds only pickle checkpoints; convert them to safetensors")
    raise ModelConfigError(f"no safetensors weights in {model_dir}")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in index order when sharded."""
    return _weight_source(Path(model_dir))[0]


def _check_shards(model_dir: Path, files: list[Path], weight_map: dict[str, str] | None) -> None:
    """From the files' headers, before any tensor is read: a tensor in two files is refused (one would
    silently replace the other). Like transformers, every tensor of every shard is read, wherever the index
    places it; a tensor the index names but no shard holds is refused (shards of another download)."""
    owner: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())  # noqa: SIM118 (safe_open is not a mapping)
        except SafetensorError as exc:  # truncated or not a safetensors file at all
            raise ModelConfigError(f"{path} is not a readable safetensors file: {exc}") from None
        for name in names:
            first = owner.setdefault(name, path)
            if first != path:
                raise ModelConfigError(f"tensor {name!r} is in two weight files, {first} and {path}; a checkpoint "
                                       f"holds each tensor once (remove the stale file or download the model again)")
    absent = [name for name in (weight_map or {}) if name not in owner]
    if absent:
        raise ModelConfigError(
            f"{model_dir / INDEX_FILE} places tensor {absent[0]!r} in {weight_map[absent[0]]}, but no shard holds it "
            f"({len(absent)} such tensor(s)); the shards do not belong to this index (download the model again)")


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files, weight_map = _weight_source(Path(model_dir))
    _check_shards(Path(model_dir), files, weight_map)
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


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the base model's weights at `dtype`: embeddings, each layer's projections and norms, the
    final norm and the LM head (unless tied to the embeddings)."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h  # q, o; k, v; gate, up, down; two norms
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return (config.num_hidden_layers * layer + embeddings + h) * torch.empty((), dtype=dtype).element_size()


def check_fits_one_device(config: ModelConfig, dtype: torch.dtype, free_bytes: int, device: str) -> None:
    """A worker holds one whole copy of the base model on one GPU: there is no tensor parallelism, so no
    adapter is ever split into shards that could disagree between GPUs (a model too large for one GPU is
    refused here, before anything is allocated, instead of failing with an out-of-memory error mid-load)."""
    need = weight_bytes(config, dtype)
    if need > free_bytes:
        raise ModelConfigError(
            f"the base model's weights take {_gib(need)} in {str(dtype).removeprefix('torch.')}, more than the "
            f"{_gib(free_bytes)} free on {device}: a worker serves one whole copy of the model per GPU (no tensor "
            "parallelism); use a GPU with more memory, a smaller model, or --dtype bfloat16 for a float32 one")


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype, device: torch.device | str, config: ModelConfig | None = None
) -> LlamaModel:
    config = config or ModelConfig.from_dir(model_dir)
    if torch.device(device).type == "cuda":
        check_fits_one_device(config, dtype, torch.cuda.mem_get_info(torch.device(device))[0], str(device))
    model = LlamaModel(config, dtype=dtype, device=device)
    model.load_weights(iter_weights(model_dir))
    return model.eval()
