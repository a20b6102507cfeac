"""PEFT LoRA directories -> validated `LoRAWeights`.

A PEFT adapter dir holds `adapter_config.json` + `adapter_model.safetensors`. Everything that
decides the adapter's output travels with the weights and is checked here, once, on load:

* rank and alpha per module (`r`, `lora_alpha`, `rank_pattern`, `alpha_pattern`, `use_rslora`)
  become one `scale` per (layer, projection); the pool and kernels never see the config again,
  so two adapters with equal matrices but different alphas can never be confused;
* every tensor's shape against the served base model (the error names module and shapes);
* the base model name and, when the dir ships tokenizer files, the tokenizer vocabulary
  (a different vocabulary turns every output into garbage), with strictness strict / warn / off;
* features we cannot serve (DoRA, `modules_to_save`, embedding or lm_head LoRA, LoRA biases, ...)
  are refused with a message instead of being silently ignored;
* pickle files (`adapter_model.bin`, `*.pt`, ...) are refused outright: they are never opened;
* VeLoRA and MonteCLoRA adapters (`velora_config`, `monteclora_config`) are served: in eval mode PEFT's
  forward for them is plain LoRA, so their training-only tensors are ignored (`_TRAINING_ONLY`);
* the weights are copied out of the file's bytes, read once (never a memory map of the file, which a
  file rewritten in place later would change under the server), and must be finite in the served
  dtype; scales must be finite in float32.

The checks of adapter_config.json alone live in worker/peft_config.py.

Precision (merged vs unmerged): the server never merges. In fp32 the unmerged delta equals the
merged weight's output within 1e-4. In bf16 the delta is accumulated in fp32 by the LoRA kernels
and rounded once into y (within one bf16 ulp of base output + exact delta), while a bf16 merge
W + s*B@A would round away deltas below W's resolution (tests/worker/test_peft_adapter.py).

Pattern semantics follow PEFT exactly: a `rank_pattern`/`alpha_pattern` key `k` applies to module
name `m` when `re.match(rf"(.*\\.)?({k})$", m)`, first key in dict order wins; `target_modules` is a
regex (`re.fullmatch`) when a string, otherwise exact names or name suffixes after a dot.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lorafleet.kernels.lora_layout import PROJS
from lorafleet.worker.file_limits import MAX_FILE_BYTES, FileLimitError
from lorafleet.worker.peft_config import (
    CONFIG_FILE,
    PARENT,
    WEIGHTS_FILE,
    AdapterError,
    read_bytes,
    read_config,
    refuse_embedding_targets,
    refuse_pickles,
    refuse_unsupported,
)
from lorafleet.worker.peft_patterns import budgeted, compiled_keys, is_targeted, lora_scale, module_rank_alpha
from lorafleet.worker.peft_tensors import read_tensors
from lorafleet.worker.vocab_digest import tokenizer_mismatch

log = logging.getLogger(__name__)

Strictness = Literal["strict", "warn", "off"]

@dataclass(slots=True)
class ModuleLoRA:
    """One adapted projection of one layer, on CPU."""

    a: torch.Tensor  # [r, in_features]   (PEFT lora_A.weight)
    b: torch.Tensor  # [out_features, r]  (PEFT lora_B.weight)
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (patterns applied)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class LoRAWeights:
    """A validated PEFT adapter."""

    name: str
    version: str  # content digest prefix unless given
    base_model: str  # base_model_name_or_path from adapter_config.json
    modules: dict[tuple[int, str], ModuleLoRA]  # (layer index, proj name) -> weights
    nbytes: int
    # Loads and validates the same adapter again from its directory (None: held in memory only), so
    # the adapter pool can drop its CPU copy and re-read it instead of keeping this one alive.
    reload: Callable[[], LoRAWeights] | None = field(default=None, repr=False, compare=False)

    @property
    def ranks(self) -> set[int]:
        return {m.rank for m in self.modules.values()}


# ---- model dimensions ------------------------------------------------------------------------------

def _cfg(model_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(model_config, Mapping):
        return model_config.get(key, default)
    return getattr(model_config, key, default)


def projection_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """proj name -> (out_features, in_features) of the base model's Linear layers.

    `model_config` is the engine's ModelConfig or any object/dict with HF config.json names."""
    hidden = int(_cfg(model_config, "hidden_size"))
    heads = int(_cfg(model_config, "num_attention_heads"))
    kv_heads = int(_cfg(model_config, "num_key_value_heads") or heads)
    head_dim = int(_cfg(model_config, "head_dim") or hidden // heads)
    inter = int(_cfg(model_config, "intermediate_size"))
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


# ---- base model and tokenizer ----------------------------------------------------------------------

def _strictness(strict_base: bool | str) -> Strictness:
    if isinstance(strict_base, bool):
        return "strict" if strict_base else "warn"
    if strict_base not in ("strict", "warn", "off"):
        raise ValueError(f"strict_base must be True/False or 'strict'/'warn'/'off', got {strict_base!r}")
    return strict_base


def _short_name(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def _mismatch(mode: Strictness, message: str) -> None:
    if mode == "strict":
        raise AdapterError(message)
    if mode == "warn":
        log.warning("%s (accepted: strictness is 'warn')", message)


# ---- loading ---------------------------------------------------------------------------------------

def _is_float32_finite(value: float) -> bool:
    """The layout stores scales as float32: 1e39 is a finite Python float but inf there."""
    return bool(torch.isfinite(torch.tensor(value, dtype=torch.float32)))


@budgeted
def load_peft_adapter(
    path: str | Path,
    model_config: Any,
    *,
    dtype: torch.dtype | str = torch.float32,
    strict_base: bool | Strictness = True,
    base_model_name: str | Sequence[str] | None = None,
    tokenizer_digest: str | None = None,
    tokenizer_encodings: list[list[int]] | None = None,
    base_token_id: Callable[[str], int | None] | None = None,
    name: str | None = None,
    version: str | None = None,
    expect_digest: str | None = None,
    sha256: str | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_rank: int | None = None,
) -> LoRAWeights:
    """Load and validate a PEFT LoRA dir for a base described by `model_config`.

    expect_digest: the content digest the files must still have (a reload of a registered version:
    files rewritten in place since are refused rather than served under the old version).
    sha256: the digest the files must have (a pushed directive's; as `sources.adapter_digest`): a
    mismatch is refused before the weights are parsed. Both are checked against the digest of the
    bytes read for loading, so checking costs nothing more.
    strict_base: "strict" (True) refuses a base-model-name or tokenizer mismatch, "warn" (False)
    logs it, "off" skips both checks. base_model_name: the served base's name, or its names (its folder, its
    config's `_name_or_path`, aliases): the adapter's `base_model_name_or_path` must end as one of them does.
    base_model_name / tokenizer_digest / tokenizer_encodings (`vocab_digest.probe_encodings`) / base_token_id
    (its id of a token, for added tokens declared without a whole vocabulary) describe the served base; None
    skips that check. max_file_bytes: the largest weights or tokenizer file read (refused before reading).
    max_rank: the pool's (a higher rank refused from the file's header, before a copy). Raises AdapterError.
    """
    path = Path(path)
    mode = _strictness(strict_base)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory; an adapter is a PEFT dir with {CONFIG_FILE} + {WEIGHTS_FILE}")
    refuse_pickles(path)
    config, config_raw = read_config(path, max_file_bytes)
    # The digests first: a version read again (an eviction's reload) is its files' bytes as first loaded, checked
    # before anything in them is interpreted or quoted (a file replaced since, by a link, say, is refused unread).
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"{path}: {WEIGHTS_FILE} not found (only safetensors weights are accepted)")
    raw = read_bytes(weights_path, max_file_bytes)
    digest = _content_digest(config_raw, raw)  # of the bytes served
    if sha256 is not None and digest != sha256.lower():
        raise AdapterError(f"{path}: sha256 mismatch: expected {sha256}, the files hash to {digest} (corrupt or "
                           f"changed files; fix the files or the expected sha256)")
    if expect_digest is not None and digest != expect_digest:
        raise AdapterError(f"{path}: the adapter's files changed after version {version} was loaded from them; "
                           f"register the new files as a new version")
    refuse_unsupported(config, path)
    pattern_keys = (compiled_keys(config.get("rank_pattern") or {}, "rank_pattern"),
                    compiled_keys(config.get("alpha_pattern") or {}, "alpha_pattern"))
    num_layers = int(_cfg(model_config, "num_hidden_layers"))
    refuse_embedding_targets(config, path, num_layers)
    base = config.get("base_model_name_or_path") or ""
    if mode != "off" and expect_digest is None:  # read again: its base and tokenizer were checked at its first load
        given = [base_model_name] if isinstance(base_model_name, str) else base_model_name or ()
        names = [n for n in given if n]  # "": no name known, nothing to check against
        if names and base and _short_name(base) not in {_short_name(n) for n in names}:
            known = " or ".join(repr(n) for n in dict.fromkeys(names))
            _mismatch(mode, f"{path}: adapter was trained on base model {base!r}, this server serves {known}; "
                            f"serve it on its own base; if that is this model under another name, start the "
                            f"worker with --base-model-aliases {base.rstrip('/').rsplit('/', 1)[-1]}; --no-strict-base "
                            f"only warns")
        try:
            mismatch = tokenizer_mismatch(path, tokenizer_digest, base_token_id, max_file_bytes, tokenizer_encodings)
        except FileLimitError as exc:  # a limit, not a mismatch: refused whatever the strictness
            raise AdapterError(str(exc)) from None
        if mismatch is not None:
            _mismatch(mode, mismatch)

    shapes = projection_shapes(model_config)
    pairs, module_names = read_tensors(raw, path, num_layers, config, max_rank, shapes)
    del raw  # the tensors hold copies
    if not pairs:
        raise AdapterError(f"{weights_path}: holds no LoRA tensors (lora_A/lora_B of q/k/v/o/gate/up/down_proj)")

    modules: dict[tuple[int, str], ModuleLoRA] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        module = f"model.layers.{layer}.{PARENT[proj]}.{proj}"
        label = f"layer {layer} {proj}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"{path}: {label} has no {missing} weight; the file is incomplete")
        if not is_targeted(config, module) and not is_targeted(config, module_names[(layer, proj)]):
            raise AdapterError(f"{path}: {label} has weights but target_modules={config.get('target_modules')!r} "
                               f"does not select it; adapter_config.json does not belong to these weights")
        a, b = ab["A"], ab["B"]
        out_f, in_f = shapes[proj]
        r, alpha = module_rank_alpha(config, module, pattern_keys)
        if a.dim() == b.dim() == 2 and a.shape[1] == in_f and b.shape[0] == out_f and a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: {label}: lora_A {list(a.shape)} has rank {a.shape[0]} and lora_B "
                               f"{list(b.shape)} rank {b.shape[1]}; the two must share one rank: "
                               f"{WEIGHTS_FILE} is corrupt or mixes two adapters")
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f:
            raise AdapterError(
                f"{path}: {label}: expected lora_A [r, {in_f}] and lora_B [{out_f}, r] for this base model, "
                f"found lora_A {list(a.shape)} and lora_B {list(b.shape)}; the adapter was trained on a "
                f"different base model"
            )
        if a.shape[0] != r:
            raise AdapterError(
                f"{path}: {label}: adapter_config.json gives rank {r} (r / rank_pattern) but the weights have "
                f"rank {a.shape[0]}; the config does not belong to these weights"
            )
        if not torch.is_floating_point(a) or not torch.is_floating_point(b):
            raise AdapterError(f"{path}: {label}: weights are {a.dtype}/{b.dtype}, not floating point")
        # Checked after the cast: a finite float32 weight above 65504 is inf in float16.
        a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            raise AdapterError(f"{path}: {label}: weights contain NaN/inf, or values beyond the range of the "
                               f"served dtype {dtype}; the adapter diverged in training or needs another dtype")
        scale = float(lora_scale(config, r, alpha))
        if not _is_float32_finite(scale):
            raise AdapterError(f"{path}: {label}: scale {scale!r} (lora_alpha {alpha}, rank {r}) is not a finite "
                               f"float32; fix lora_alpha / alpha_pattern in {CONFIG_FILE}")
        modules[(layer, proj)] = ModuleLoRA(a=a, b=b, scale=scale)

    _refuse_missing_targets(config, modules, num_layers, path)
    nbytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    name, version = name or path.name, version or digest[:12]
    reload = functools.partial(load_peft_adapter, path, model_config, dtype=dtype, strict_base=strict_base,
                               base_model_name=base_model_name, tokenizer_digest=tokenizer_digest,
                               tokenizer_encodings=tokenizer_encodings, base_token_id=base_token_id, name=name,
                               version=version, expect_digest=digest, max_file_bytes=max_file_bytes, max_rank=max_rank)
    return LoRAWeights(name=name, version=version, base_model=base, modules=modules, nbytes=nbytes, reload=reload)


def _refuse_missing_targets(config: dict, modules: dict, num_layers: int, path: Path) -> None:
    """target_modules selects a projection the file has no weights for: a truncated or mixed-up file."""
    missing = []
    for layer in range(num_layers):
        for proj in PROJS:
            module = f"model.layers.{layer}.{PARENT[proj]}.{proj}"
            if (layer, proj) not in modules and is_targeted(config, module):
                missing.append(f"layer {layer} {proj}")
    if missing:
        raise AdapterError(f"{path}: target_modules selects {len(missing)} module(s) with no weights in "
                           f"{WEIGHTS_FILE} (first: {missing[0]}); the file is incomplete or for another base")


def _content_digest(config_raw: bytes, weights_raw: bytes) -> str:
    """sha256 over adapter_config.json then adapter_model.safetensors (as `sources.adapter_digest`), of
    the very bytes that were validated and loaded."""
    h = hashlib.sha256(config_raw)
    h.update(weights_raw)
    return h.hexdigest()
