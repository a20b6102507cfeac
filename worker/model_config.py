"""ModelConfig: the parts of a Llama-architecture `config.json` the engine needs.

Two spellings of RoPE settings exist in the wild: released checkpoints carry `rope_theta` plus an
optional `rope_scaling` dict; transformers 5 writes one `rope_parameters` dict with `rope_theta`
inside. Both are read into the same fields here so nothing downstream cares.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ModelConfigError(ValueError):
    """The model directory cannot be served (missing file, unsupported architecture or option)."""


def read_json(path: Path) -> Any:
    """A model directory's JSON file (config.json, the safetensors index); ModelConfigError naming it if not JSON."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # normalised: has "rope_type"; None = plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    name: str = ""
    name_or_path: str = ""  # config.json's `_name_or_path` (the hub id or path it was saved from), if any

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        factor = (self.rope_scaling or {}).get("factor")
        if rope_type != "default" and not _is_positive(factor):
            raise ModelConfigError(f"{rope_type} rope scaling needs a positive number \"factor\", got {factor!r}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict, *, name: str = "") -> ModelConfig:
        if not isinstance(raw, dict):
            raise ModelConfigError(f"config.json holds a {type(raw).__name__}, not an object")
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise ModelConfigError(f"config.json lacks {', '.join(missing)}: not a complete Llama config")
        bad = [k for k in REQUIRED_KEYS if not (isinstance(raw[k], int) and raw[k] > 0)]
        if bad:
            raise ModelConfigError("config.json: " + ", ".join(f"{k}={raw[k]!r}" for k in bad)
                                   + " (each must be a positive integer)")
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and raw.get("model_type") not in ("llama", "mistral"):
            raise ModelConfigError(f"architecture {archs} is not supported; expected a Llama-architecture model")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ModelConfigError("biases in attention/MLP projections are not supported")
        window = raw.get("sliding_window")
        if window is not None and window < raw.get("max_position_embeddings", 2048):
            raise ModelConfigError(f"sliding-window attention (sliding_window={window}) is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        num_heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            name=name or raw.get("_name_or_path", ""),
            name_or_path=raw["_name_or_path"] if isinstance(raw.get("_name_or_path"), str) else "",
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        if problem := model_dir_problem(model_dir):
            raise ModelConfigError(problem)
        path = Path(model_dir) / "config.json"
        raw = read_json(path)
        try:
            return cls.from_dict(raw, name=_dir_model_name(Path(model_dir)))
        except ModelConfigError as exc:
            raise ModelConfigError(f"{model_dir}: {exc}") from None

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim // 2], float32, with the configured scaling applied."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "linear":
            return inv_freq / scaling["factor"]
        if rope_type == "llama3":
            return _llama3_inv_freq(inv_freq, scaling, self.max_position_embeddings)
        return inv_freq


def model_dir_problem(model_dir: str | Path) -> str | None:
    """Why `model_dir` is not a model directory (config.json, weights, tokenizer), or None."""
    path = Path(model_dir)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return (f"model directory {path} has no config.json; --model takes a Hugging Face-style directory "
                "holding config.json, the *.safetensors weights and tokenizer.json")
    if path.exists():
        hint = f" (such as {path.parent})" if (path.parent / "config.json").is_file() else ""
        return (f"--model {path} is a file, not a directory; --model takes the model directory{hint}, the one "
                "holding config.json, the *.safetensors weights and tokenizer.json")
    if _looks_like_hub_id(str(model_dir)):
        from lorafleet.worker.default_model import MODEL_NAME  # the embedded model; only for this message

        return (f"--model {model_dir}: no such directory, and the worker does not download models from the "
                f"Hugging Face Hub; download it first and pass its local directory (e.g. `hf download "
                f"{model_dir} --local-dir DIR`, then --model DIR), or leave --model unset to serve the embedded "
                f"default model {MODEL_NAME} (as `make run` does)")
    return f"--model {path}: the model directory does not exist; pass a local Hugging Face-style model directory"


def _looks_like_hub_id(name: str) -> bool:
    """`org/name` as the Hugging Face Hub spells repo ids (a path that exists was looked at before)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]", name) is not None


def _is_positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _dir_model_name(model_dir: Path) -> str:
    """The model's name for a directory: its folder name, or the repo id of a Hugging Face cache snapshot
    (`.../models--org--name/snapshots/<commit>` is "org/name", not the commit hash)."""
    repo = model_dir.parent.parent.name
    if model_dir.parent.name == "snapshots" and repo.startswith("models--"):
        return "/".join(repo.split("--")[1:])
    return model_dir.name


def _read_rope(raw: dict) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        params = dict(params)
        theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        theta = raw.get("rope_theta", 10000.0)
        params = dict(raw.get("rope_scaling") or {})
    if params:
        # Old checkpoints spell the key "type".
        params["rope_type"] = params.get("rope_type") or params.pop("type", "default")
    if not params or params["rope_type"] == "default":
        return float(theta), None
    return float(theta), params


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_pos: int) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", max_pos)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
