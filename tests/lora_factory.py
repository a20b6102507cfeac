"""Random LoRA weights in the shape of `worker/peft_adapter.py`'s `LoRAWeights`, for pool tests and
benchmarks that need many adapters without going through PEFT files."""

from __future__ import annotations

import struct
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
                   version: str = "1", alpha: float = 16.0, dtype=torch.float32, std: float = 1.0) -> Weights:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for layer in range(dims.num_layers):
        for proj in projs:
            fan_in, fan_out = dims.in_out(proj)
            a = (std * torch.randn(rank, fan_in, generator=g, dtype=torch.float32)).to(dtype)
            b = (std * torch.randn(fan_out, rank, generator=g, dtype=torch.float32)).to(dtype)
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


def lora_delta(layout, token_slots: torch.Tensor, x: torch.Tensor, layer: int, proj: str, out_features: int):
    """LoRA delta of one projection computed through the pool's layout by the kernels' entry points
    (reference backend): token t uses slot token_slots[t] (-1 = none). x: [T, in] -> [T, out]."""
    from lorafleet.kernels.lora import lora_expand, lora_shrink
    from lorafleet.kernels.lora_layout import make_lora_batch

    pid = PROJS.index(proj)
    batch = make_lora_batch(token_slots.to(torch.int32), layout.max_rank_by_slot())
    xa = torch.zeros(1, x.shape[0], max(batch.max_rank, 1), dtype=torch.float32, device=x.device)
    y = torch.zeros(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    if batch.max_rank == 0:
        return y
    lora_shrink(x=x, layout=layout, layer=layer, proj_ids=[pid], batch=batch, out=xa, backend="reference")
    lora_expand(xa=xa, layout=layout, layer=layer, proj_ids=[pid], batch=batch, y=y, out_offsets=[0],
                backend="reference")
    return y


def dense_delta(weights, x: torch.Tensor, layer: int, proj: str, out_features: int) -> torch.Tensor:
    """scale * (x @ A.T) @ B.T of one adapter alone (zeros where it does not adapt the module)."""
    m = weights.modules.get((layer, proj))
    if m is None:
        return torch.zeros(x.shape[0], out_features, dtype=x.dtype)
    return (m.scale * (x.float() @ m.a.float().T) @ m.b.float().T).to(x.dtype)


def merged_hf_greedy(base_dir, weights, prompt: list[int], max_new_tokens: int):
    """Single-adapter reference: the adapter merged into a plain HF Llama (W + scale * B @ A), greedy.
    Returns (token ids, logprob of each chosen token)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    parents = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    if weights is not None:
        with torch.no_grad():
            for (layer, proj), m in weights.modules.items():
                lin = getattr(getattr(model.model.layers[layer], parents[proj]), proj)
                lin.weight += m.scale * (m.b.float() @ m.a.float())
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():  # plain greedy loop: no EOS handling, like a request with ignore_eos
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return tokens, logprobs


def _varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def protobuf_field(field: int, data: bytes) -> bytes:
    """A length-delimited protobuf field: its key, its length, its bytes."""
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def sentencepiece_model(pieces: list[str]) -> bytes:
    """A tokenizer.model as sentencepiece writes one: each piece with its score (fixed32) and type (varint), then
    a trainer spec and a normalizer spec, which the reader skips."""
    model = b"".join(protobuf_field(1, protobuf_field(1, p.encode()) + b"\x15" + struct.pack("<f", -float(i))
                                    + b"\x18" + _varint(1)) for i, p in enumerate(pieces))
    trainer = protobuf_field(2, protobuf_field(1, b"model.txt") + b"\x18" + _varint(32000))
    return model + trainer + protobuf_field(3, b"\x0a\x03nmt")
