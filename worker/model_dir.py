"""What the engine reads from a model folder: its config, tokenizer, generation defaults, EOS ids and weights.

A folder whose content cannot be served raises ModelConfigError or TokenizerError naming it (the worker
then exits 2 with that line, worker/startup_refusals.py): a weight of another shape or a file that
cannot be read as well as a config that is wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.model_config import ModelConfig, ModelConfigError, read_json
from lorafleet.worker.model_loader import load_model
from lorafleet.worker.sampling_defaults import SamplingDefaults, read_sampling_defaults
from lorafleet.worker.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)


@dataclass
class ModelDir:
    sampling_defaults: SamplingDefaults
    config: ModelConfig
    tokenizer: Tokenizer | None  # None: the folder (or --tokenizer) has no tokenizer.json
    eos_token_ids: list[int]
    model: torch.nn.Module


def read_model_dir(model_dir: Path, config: EngineConfig, *, dtype: torch.dtype, device: torch.device) -> ModelDir:
    try:
        return _read(model_dir, config, dtype, device)
    except (ModelConfigError, TokenizerError):
        raise
    except (ValueError, OSError) as exc:  # its content (a weight of another shape) or a file it cannot read
        raise ModelConfigError(f"{model_dir}: {exc}") from exc


def _read(model_dir: Path, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> ModelDir:
    defaults = read_sampling_defaults(model_dir) if config.generation_config else SamplingDefaults()
    model_config = ModelConfig.from_dir(model_dir)
    tok_dir = Path(config.tokenizer or model_dir)
    tokenizer = Tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer.json: only prompts of token ids work, text prompts and chat are "
                    "refused (give --tokenizer DIR)", tok_dir)
    eos_ids = _eos_ids(model_dir, model_config, tokenizer)
    model = load_model(model_dir, dtype=dtype, device=device, config=model_config)
    return ModelDir(defaults, model_config, tokenizer, eos_ids, model)


def _eos_ids(model_dir: Path, model_config: ModelConfig, tokenizer: Tokenizer | None) -> list[int]:
    """The model's EOS ids: config.json's, generation_config.json's and the tokenizer's."""
    ids = list(model_config.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        data = read_json(gen)  # ModelConfigError naming the file when it is no JSON
        eos = data.get("eos_token_id") if isinstance(data, dict) else None  # not an object: warned already
        ids += [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
