"""PEFT's matching rules for adapter_config.json: which modules an adapter targets, and the rank,
alpha and scale of each (rank_pattern / alpha_pattern / rsLoRA), as PEFT itself applies them."""

from __future__ import annotations

import math
import re

from lorafleet.kernels.lora_layout import PROJS


def pattern_key(pattern_keys: list[str], module_name: str) -> str | None:
    """PEFT's `get_pattern_key`: the first key that matches the end of the module name."""
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def _layer_selected(config: dict, module_name: str) -> bool:
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_name)
    if match is None:
        return False
    idx = int(match["idx"])
    return idx == layers if isinstance(layers, int) else idx in layers


def is_targeted(config: dict, module_name: str) -> bool:
    """PEFT's `check_target_module_exists` for the options a LoRA adapter of ours can carry."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, module_name):
                return False
        elif module_name in exclude or any(module_name.endswith(f".{e}") for e in exclude):
            return False
    targets = config.get("target_modules")
    if targets is None:
        return False
    if isinstance(targets, str):
        if targets.lower() == "all-linear":  # every Linear but the output layer
            return module_name.rsplit(".", 1)[-1] in PROJS
        return re.fullmatch(targets, module_name) is not None
    if module_name in targets:
        return True
    found = any(module_name.endswith(f".{t}") for t in targets)
    return found and _layer_selected(config, module_name)


def module_rank_alpha(config: dict, module_name: str) -> tuple[float, float]:
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    r_key = pattern_key(list(rank_pattern), module_name)
    a_key = pattern_key(list(alpha_pattern), module_name)
    r = rank_pattern[r_key] if r_key is not None else config.get("r", 8)
    alpha = alpha_pattern[a_key] if a_key is not None else config.get("lora_alpha", 8)
    return r, alpha


def lora_scale(config: dict, r: float, alpha: float) -> float:
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
