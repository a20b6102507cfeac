"""A PEFT adapter's safetensors file read into its LoRA tensors: each tensor's name told apart (layer, projection,
lora_A or lora_B) and checked, with its shape, against the base model from the file's header, before any tensor
is copied (peft_adapter.load_peft_adapter checks the pairs then)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lorafleet.kernels.lora_layout import PROJS
from lorafleet.worker.peft_config import PARENT, WEIGHTS_FILE, AdapterError, refuse_ranks_above
from lorafleet.worker.safetensors_bytes import SafetensorsError, load_tensors

# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
_KEY = re.compile(
    r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<proj>[a-z_]+))"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# Tensors PEFT saves beside lora_A/lora_B for LoRA variants that are plain LoRA at inference (eval mode):
# VeLoRA's activation projection serves only its training backward pass, MonteCLoRA's sampler perturbs
# lora_A only in training. Exactly these are ignored, and only when adapter_config.json enables the variant.
_MODULE = r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>[a-z_]+))"
_TRAINING_ONLY = {
    "velora_config": re.compile(_MODULE + r"\.lora_velora_embed(?:\.[^.]+)?$"),
    "monteclora_config": re.compile(
        _MODULE + r"\.lora_monteclora_sampler(?:\.[^.]+)?\.(?:expert_weights|expert_weights_prior|gaussian_var_prior"
        r"|std_prior)$"),
}


MAX_HEADER_BYTES = 2 << 20  # a safetensors header (its JSON index of the tensors): 10x what 70B needs


def read_tensors(raw: bytes, path: Path, num_layers: int, config: dict, max_rank: int | None,
                 shapes: dict[str, tuple[int, int]]) -> tuple[dict, dict]:
    """(layer, proj) -> {"A": lora_A, "B": lora_B}, and the module name each came with (a variant's
    training-only tensors, `_TRAINING_ONLY`, are dropped); a rank above `max_rank`, a tensor of no Llama projection
    or layer, and one whose shape does not fit the base's projection (`shapes`: projection_shapes) refused from
    the header, before any copy (a rank-4 lora_A of 33M columns cost twice the file's size in memory first).

    From the file's bytes, read once, never from a memory map of the file: the tensors own their
    memory, so a file rewritten in place later changes nothing served (and truncating it cannot
    kill the process with SIGBUS)."""
    header = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else 0
    if MAX_HEADER_BYTES < header <= len(raw) - 8:  # its entries cost far more parsed than as bytes (longer than
        # the file: a truncated or foreign one, refused below)
        raise AdapterError(f"{path / WEIGHTS_FILE}: a safetensors header of {header} bytes, over the "
                           f"{MAX_HEADER_BYTES} a LoRA's tensors need (a 70B model's every projection: about "
                           f"200 KB); refused before parsing it")
    variants = [pattern for field, pattern in _TRAINING_ONLY.items() if config.get(field) is not None]

    def before_copy(header: dict[str, list[int]]) -> None:
        refuse_ranks_above(header, max_rank, path)
        for key, shape in sorted(header.items()):
            if not any(p.match(key) for p in variants):
                layer, proj, ab, _ = _checked_key(key, path, num_layers)
                pair_a = header.get(key.replace(".lora_B.", ".lora_A."))
                if ab == "B" and pair_a is not None and _fits(shape, ab, shapes[proj]) and \
                        _fits(pair_a, "A", shapes[proj]) and pair_a[0] != shape[1]:
                    raise AdapterError(f"{path}: layer {layer} {proj}: lora_A {pair_a} has rank {pair_a[0]} and lora_B "
                                       f"{shape} rank {shape[1]}; the two must share one rank: {WEIGHTS_FILE} is "
                                       f"corrupt or mixes two adapters")
                if not _fits(shape, ab, shapes[proj]):
                    out_f, in_f = shapes[proj]
                    pair = {x: key.replace(f".lora_{ab}.", f".lora_{x}.") for x in "AB"}
                    found = " and ".join(f"lora_{x} {header[k]}" for x, k in pair.items() if k in header)
                    raise AdapterError(f"{path}: layer {layer} {proj}: expected lora_A [r, {in_f}] and lora_B "
                                       f"[{out_f}, r] for this base model, found {found}; the adapter was "
                                       f"trained on a different base model")

    try:
        tensors = load_tensors(raw, check=before_copy)  # no lock held
    except SafetensorsError as exc:  # a truncated or foreign file
        raise AdapterError(f"{path / WEIGHTS_FILE}: cannot read safetensors ({exc})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    module_names: dict[tuple[int, str], str] = {}
    key_of: dict[tuple[int, str, str], str] = {}
    ignored: dict[tuple[int, str], str] = {}
    for key in sorted(tensors):
        extra = next((m for m in (p.match(key) for p in variants) if m), None)
        if extra:
            ignored.setdefault((int(extra["layer"]), extra["proj"]), key)
            continue
        layer, proj, ab, module = _checked_key(key, path, num_layers)
        first = key_of.setdefault((layer, proj, ab), key)
        if first != key:  # e.g. two PEFT adapter names in one file: one would silently replace the other
            raise AdapterError(f"{path}: tensors {first!r} and {key!r} are both lora_{ab} of layer {layer} {proj}; "
                               f"save one adapter per directory (PEFT save_pretrained of a single adapter)")
        pairs.setdefault((layer, proj), {})[ab] = tensors[key]
        module_names.setdefault((layer, proj), module)
    stray = [key for module, key in ignored.items() if module not in pairs]
    if stray:
        raise AdapterError(f"{path}: tensor {stray[0]!r} belongs to a module without lora_A/lora_B weights; "
                           f"the file is incomplete or mixed up")
    return pairs, module_names


def _checked_key(key: str, path: Path, num_layers: int) -> tuple[int, str, str, str]:
    """_classify_key's (layer, proj, "A" or "B", module) of a tensor of a Llama projection and layer."""
    layer, proj, ab, module = _classify_key(key, path)
    if proj not in PROJS:
        raise AdapterError(f"{path}: tensor {key!r} adapts {proj!r}, which is not a Llama projection; "
                           f"supported: {', '.join(PROJS)}")
    if not module.endswith(f".{PARENT[proj]}.{proj}"):  # mlp.q_proj: no such module in a Llama layer
        raise AdapterError(f"{path}: tensor {key!r} puts {proj} under {module.rsplit('.', 2)[-2]}, but a Llama "
                           f"layer has it under {PARENT[proj]}; wrong base architecture or a bad conversion?")
    if layer >= num_layers:
        raise AdapterError(f"{path}: tensor {key!r} is for layer {layer}, but the base model has "
                           f"{num_layers} layers (0..{num_layers - 1}); wrong base model?")
    return layer, proj, ab, module


def _fits(shape: list[int], ab: str, proj_shape: tuple[int, int]) -> bool:
    """Whether a lora_A (`ab` "A") or lora_B header shape fits a projection of (out_features, in_features)."""
    out_f, in_f = proj_shape
    return len(shape) == 2 and (shape[1] == in_f if ab == "A" else shape[0] == out_f)


def _classify_key(key: str, path: Path) -> tuple[int, str, str, str]:
    match = _KEY.match(key)
    if match:
        module = match["module"]
        module = module[len("base_model.model."):] if module.startswith("base_model.model.") else module
        return int(match["layer"]), match["proj"], match["ab"], module
    if "lora_embedding_" in key or "embed_tokens" in key:
        raise AdapterError(f"{path}: tensor {key!r}: embedding LoRA is not supported; "
                           f"target only q/k/v/o/gate/up/down_proj")
    if "lora_magnitude_vector" in key:
        raise AdapterError(f"{path}: tensor {key!r}: DoRA is not supported; train a plain LoRA adapter")
    if "modules_to_save" in key or "lm_head" in key:
        raise AdapterError(f"{path}: tensor {key!r}: fully trained modules / lm_head LoRA are not supported; "
                           f"retrain without modules_to_save and without targeting lm_head")
    if key.endswith(".bias"):
        raise AdapterError(f"{path}: tensor {key!r}: LoRA biases are not supported; train with bias='none'")
    raise AdapterError(f"{path}: unexpected tensor {key!r}; expected "
                       f"'...layers.N.(self_attn|mlp).<proj>.lora_(A|B).weight'")
