"""Random LoRA weights in the shape of `worker/peft_adapter.py`'s `LoRAWeights`, for pool tests and
benchmarks that need many adapters without going through PEFT files."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafleet.worker.adapter_image import ModelDims

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY_DIMS = ModelDims(num_layers=2, hidden_size=64, intermediate_size=128, q_size=64, kv_size=32)


@dataclass
class Module:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class Weights:
    name: str
    version: str
    modules: dict
    nbytes: int
    base_model: str = "tiny"


def random_weights(seed: int, rank: int = 8, dims: ModelDims = TINY_DIMS, projs=PROJS, name: str = "a",
                   version: str = "1", alpha: float = 16.0, dtype=torch.float32) -> Weights:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for layer in range(dims.num_layers):
        for proj in projs:
            fan_in, fan_out = dims.in_out(proj)
            a = torch.randn(rank, fan_in, generator=g, dtype=torch.float32).to(dtype)
            b = torch.randn(fan_out, rank, generator=g, dtype=torch.float32).to(dtype)
            modules[(layer, proj)] = Module(a, b, alpha / rank)
    nbytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    return Weights(name, version, modules, nbytes)


ALL_PROJS = list(PROJS)


def make_peft_adapter(base_dir, out_dir, *, rank: int, seed: int, targets=ALL_PROJS, alpha: float | None = None,
                      use_rslora: bool = False):
    """A real PEFT adapter (peft's own save_pretrained) with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets),
                                            lora_dropout=0.0, use_rslora=use_rslora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero (a no-op adapter): make both matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out_dir)
    return out_dir
