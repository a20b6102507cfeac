"""adapter_config.json of a PEFT LoRA adapter: read, and refused when it asks for what this server
cannot serve (DoRA, modules_to_save, embedding or lm_head LoRA, biases, non-finite ranks or alphas,
PiSSA-style initialisations that change the base weights, ...).
The weights file is checked against it in worker/peft_adapter.py."""

from __future__ import annotations

import errno
import json
import math
import re
from pathlib import Path
from typing import Any

import regex

from lorafleet.kernels.lora_layout import PROJS
from lorafleet.worker.file_limits import (
    CONFIG_FILE,
    MAX_FILE_BYTES,
    WEIGHTS_FILE,
    FileLimitError,
    read_limited,
)
from lorafleet.worker.peft_patterns import (
    MAX_PATTERN_CHARS,
    MAX_PATTERN_KEYS,
    check_budget,
    dialect_difference,
    is_targeted,
    layer_regex,
    written_out_size,
)

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


# Read errors that may pass by themselves: the disk or a network mount, descriptors or memory short.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EMFILE, errno.ENFILE, errno.ENOMEM,
                              errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ENOTCONN, errno.ENOLINK, errno.EREMOTEIO,
                              errno.EHOSTDOWN, errno.ENETUNREACH, errno.ECONNRESET, errno.ECONNABORTED})  # + mounts


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file/module, what was expected,
    what was found, and what to do. `transient`: a read that failed (I/O, descriptors), which may pass, not
    what the files hold."""

    transient = False


def module_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.{PARENT[p]}.{p}" for i in range(num_layers) for p in PROJS]


def refuse_unsupported(config: dict, where: Path) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type is {peft_type!r}; only LoRA adapters (peft_type LORA) are served")
    checks = [
        (config.get("use_dora"), "DoRA (use_dora=true)", "train a plain LoRA adapter (use_dora=false)"),
        (config.get("modules_to_save"), f"modules_to_save={config.get('modules_to_save')}",
         "retrain without modules_to_save: fully trained modules would replace shared base weights"),
        # bias='all' or 'lora_only' train the biases a base has: a Llama's projections have none, so such an
        # adapter is plain LoRA; a bias tensor in its file is refused with the weights (peft_tensors._classify_key).
        (config.get("bias", "none") not in ("none", "all", "lora_only"), f"bias={config.get('bias')!r}",
         "train with bias='none'"),
        (config.get("lora_bias"), "lora_bias=true", "train with lora_bias=false"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out=true (Conv1D layout)", "use a Llama-architecture base"),
        (config.get("target_parameters"), "target_parameters", "target Linear modules (q/k/v/o/gate/up/down_proj)"),
        (config.get("trainable_token_indices"), "trainable_token_indices (embedding training)",
         "retrain without trainable tokens"),
        (config.get("layer_replication"), "layer_replication", "retrain without layer replication"),
        (config.get("alora_invocation_tokens"), "activated LoRA (alora_invocation_tokens)",
         "train a plain LoRA adapter"),
        (config.get("use_qalora"), "QA-LoRA (use_qalora=true)", "train a plain LoRA adapter"),
        (_is_set(config.get("use_bdlora")), "block-diagonal LoRA (use_bdlora)", "train a plain LoRA adapter"),
        (_is_set(config.get("kasa_config")), "KaSA (kasa_config): it truncates the base weights",
         "train a plain LoRA adapter"),
        (_is_set(config.get("arrow_config")), "Arrow routing (arrow_config)", "serve each LoRA expert as its own adapter"),
        (_changes_base_weights(config.get("init_lora_weights")),
         f"init_lora_weights={config.get('init_lora_weights')!r}: this initialisation subtracts its initial "
         f"B @ A from the base weights, so the adapter only fits that residual base, not the served one",
         "convert it into a plain LoRA when saving (PEFT save_pretrained with "
         "path_initial_model_for_weight_conversion), which gives init_lora_weights=true"),
    ]
    for bad, what, todo in checks:
        if bad:
            raise AdapterError(f"{where}: {what} is not supported by this server; {todo}")
    targets = config.get("target_modules")
    if targets is None:
        raise AdapterError(f"{where}: target_modules is missing; it must name the adapted projections")
    _refuse_malformed(config, where)
    for name in ("r", "lora_alpha"):
        value = config.get(name, 8)
        if not _is_positive_number(value):
            raise AdapterError(f"{where}: {name}={value!r} must be a finite positive number")
    for name in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict) or not all(_is_positive_number(v) for v in pattern.values()):
            raise AdapterError(f"{where}: {name} must map module-name patterns to finite positive numbers, "
                               f"got {pattern!r}")


# Initialisations after which PEFT trains against a modified base (W - scale * B0 @ A0, or a quantized W):
# the adapter's B @ A is only right on top of that base, not on the served one (PEFT's loader redoes the
# change for PiSSA/CorDA/OLoRA, not for Astra's, made from calibration data; converted adapters say
# init_lora_weights=true).
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "lora_ga", "loftq", "astra")


def _is_set(value: Any) -> bool:
    """A sub-config is on whenever present: an empty one ({}) means all its defaults."""
    return value is not None and value is not False


def _changes_base_weights(init: Any) -> bool:
    return isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS)


def _refuse_malformed(config: dict, where: Path) -> None:
    """Fields of the wrong JSON type, or regexes that do not compile, refused here with the field's name:
    PEFT's matching rules (worker/peft_patterns.py) would otherwise fail with a TypeError or re.error."""
    def names(field: str, *, regex: bool) -> None:
        value = config.get(field)
        if value is None:
            return
        if isinstance(value, str):
            if regex:
                _compile(field, value, where)
            return
        if not isinstance(value, list | dict) or not all(isinstance(v, str) for v in value):
            raise AdapterError(f"{where}: {field} must be a list of module names or a regex string, got {value!r}")

    names("target_modules", regex=config.get("target_modules") != "all-linear")
    names("exclude_modules", regex=True)
    patterns = config.get("layers_pattern")
    listed = [patterns] if isinstance(patterns, str) else patterns
    if patterns is not None and not (isinstance(listed, list) and all(isinstance(p, str) for p in listed)):
        raise AdapterError(f"{where}: layers_pattern must be a regex string or a list of them, got "
                           f"{patterns!r}")
    for pattern in listed or ():
        _compile("layers_pattern", layer_regex(pattern), where, shown=pattern)
    layers = config.get("layers_to_transform")
    if layers is not None and not (_is_int(layers) or isinstance(layers, list) and all(map(_is_int, layers))):
        raise AdapterError(f"{where}: layers_to_transform must be a layer index or a list of them, got {layers!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field)
        if isinstance(pattern, dict) and len(pattern) > MAX_PATTERN_KEYS:
            raise AdapterError(f"{where}: {field} has {len(pattern)} keys, over the {MAX_PATTERN_KEYS} an adapter "
                               f"may carry; group modules under patterns in {CONFIG_FILE}")
        for key in pattern if isinstance(pattern, dict) else ():
            _compile(field, rf"(.*\.)?({key})$", where, shown=key)
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise AdapterError(f"{where}: base_model_name_or_path must be a string, got {base!r}")


def _compile(field: str, pattern: str, where: Path, *, shown: str | None = None) -> None:
    shown = pattern if shown is None else shown
    if len(shown) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{where}: {field} {shown[:60]!r}... is {len(shown)} characters, over the "
                           f"{MAX_PATTERN_CHARS} a pattern may have; use a shorter one in {CONFIG_FILE}")
    check_budget()  # a load's compiles share the budget of its matches (under the admin lock)
    try:
        re.compile(pattern)  # what PEFT matches it with: a pattern PEFT refuses is refused here
        if differs := dialect_difference(pattern):  # it would select or scale other modules than PEFT does
            raise AdapterError(f"{where}: {field} {shown[:60]!r} has {differs} (PEFT matches it with Python's "
                               f"re); write it without that in {CONFIG_FILE}")
        size = written_out_size(pattern)
        if size <= MAX_PATTERN_CHARS:
            regex.compile(pattern, cache_pattern=False)  # what worker/peft_patterns.py matches it with
    except (re.error, regex.error, RecursionError, OverflowError, MemoryError) as exc:
        raise AdapterError(f"{where}: {field} {shown!r} is not a valid regex ({exc}); "
                           f"fix {CONFIG_FILE}") from None
    if size > MAX_PATTERN_CHARS:  # the regex engine would write it out in full: memory and time, the lock held
        raise AdapterError(f"{where}: {field} {shown[:60]!r} has counted repeats that write out to over "
                           f"{MAX_PATTERN_CHARS} characters, the most a pattern may have; use a shorter one in "
                           f"{CONFIG_FILE}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_number(value: Any) -> bool:
    """A finite number > 0: json.loads accepts NaN and Infinity, and NaN <= 0 is False."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int beyond float's range
        return False


def refuse_embedding_targets(config: dict, where: Path, num_layers: int) -> None:
    """target_modules that hit the embedding or lm_head (or nothing of a Llama) are refused."""
    targets = config.get("target_modules")
    extra = {"model.embed_tokens": "embedding LoRA (embed_tokens)", "lm_head": "LoRA on lm_head"}
    for name, what in extra.items():
        if isinstance(targets, str) and targets.lower() == "all-linear":
            continue
        if is_targeted(config, name):
            raise AdapterError(f"{where}: {what} is not supported; target only q/k/v/o/gate/up/down_proj")
    if isinstance(targets, list | tuple | set):
        # As PEFT: names a Llama does not have (a training script's list for several architectures: fc1, dense)
        # select nothing and are passed over, while one name selects a projection; the weights say the rest.
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in PROJS and t not in module_names(num_layers)]
        if unknown and len(unknown) == len(targets):
            raise AdapterError(
                f"{where}: target_modules {sorted(unknown)} are not projections of a Llama model; "
                f"supported: {', '.join(PROJS)}"
            )


def read_config(path: Path, max_bytes: int = MAX_FILE_BYTES) -> tuple[dict, bytes]:
    """adapter_config.json parsed, and its bytes (for the content digest); at most 1 MiB or `max_bytes`."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{path}: {CONFIG_FILE} not found; a PEFT adapter dir needs {CONFIG_FILE} + {WEIGHTS_FILE}")
    raw = read_bytes(config_path, max_bytes)
    try:
        config = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise AdapterError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: expected a JSON object")
    return config, raw


def read_bytes(file: Path, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of an adapter file, refused before it is read when it is not a regular file or over its
    limit (worker/file_limits.py: adapter_config.json at most 1 MiB, other files max_bytes)."""
    try:
        return read_limited(file, max_bytes)
    except FileLimitError as exc:
        raise AdapterError(str(exc)) from None
    except OSError as exc:
        error = AdapterError(f"{file}: cannot be read ({exc})")
        error.transient = exc.errno in TRANSIENT_ERRNOS  # a missing file or a permission does not pass by itself
        raise error from exc


def refuse_ranks_above(shapes: dict[str, list[int]], max_rank: int | None, path: Path) -> None:
    """Refuse an adapter whose lora_A rows (its rank) exceed the pool's max_rank, from the safetensors header's
    shapes, before a tensor is copied or converted: a rank the pool can never hold cost the whole file's copies
    (several times its size in host memory) only to be refused after them."""
    if max_rank is None:
        return
    ranks = [(shape[0 if ".lora_A." in name else 1], name) for name, shape in shapes.items()
             if (".lora_A." in name or ".lora_B." in name) and len(shape) == 2]  # lora_B [out_features, r]
    rank, name = max(ranks, default=(0, ""), key=lambda found: (found[0], ".lora_A." in found[1]))  # A's on a tie
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} ({name}) is above the pool's max_rank {max_rank}: raise "
                           f"--max-lora-rank (at least {rank}), or serve a version of it trained at rank {max_rank} "
                           f"or less")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def refuse_pickles(path: Path) -> None:
    """Pickles are never opened: beside the safetensors weights they are ignored (a copy staged from the object
    store leaves them out too); a folder whose weights are only pickled is refused, saying why."""
    pickles = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles and not (path / WEIGHTS_FILE).is_file():
        raise AdapterError(
            f"{path}: refusing pickle file(s) {pickles}: loading a pickle can run arbitrary code. "
            f"Convert the adapter to {WEIGHTS_FILE} (e.g. save it with PEFT's save_pretrained, "
            f"safe_serialization=True) and remove the pickle files"
        )
