"""LlamaModel: the Llama architecture (Llama-2/3, SmolLM2) over a paged KV cache.

Base projections are fused per layer (q|k|v and gate|up) so each is one GEMM for the whole batch;
when the ForwardContext carries a LoRABatch, every projection adds its per-token LoRA delta
`scale_i * B_i (A_i x)` through `lora_linear` (worker/lora_linear.py: the kernels' lora_shrink/
lora_expand over tokens grouped by adapter slot, slot -1 = base only, beside the base GEMM on CUDA).
Weights are never merged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorafleet.kernels import attention
from lorafleet.worker.forward_context import ForwardContext
from lorafleet.worker.lora_linear import gate_up_act, lora_linear
from lorafleet.worker.model_config import ModelConfig

# Projection ids as in kernels.lora_layout.PROJS.
Q, K, V, OUT, GATE, UP, DOWN = range(7)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as the reference implementation does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] (halves repeated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype, device=device)
        self.o_proj = _param(config.hidden_size, self.q_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        qkv = lora_linear(x, self.qkv_proj, ctx, self.layer, [Q, K, V], [0, self.q_size, self.q_size + self.kv_size])
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer]
        attention.write_kv(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=ctx.slot_mapping,
                           backend=ctx.backend)
        out = torch.empty_like(q)  # [T, Hq, D]
        nd = ctx.num_decodes
        if nd:
            attention.paged_attention_decode(
                q=q[:nd], k_cache=k_cache, v_cache=v_cache, block_tables=ctx.block_tables[:nd],
                context_lens=ctx.context_lens[:nd], scale=self.scale, out=out[:nd], backend=ctx.backend,
            )
        if nd < T:
            qsl = ctx.query_start_loc[nd:]
            attention.paged_attention_prefill(
                q=q[nd:], k_cache=k_cache, v_cache=v_cache, block_tables=ctx.block_tables[nd:],
                query_start_loc=qsl - qsl[:1], context_lens=ctx.context_lens[nd:], scale=self.scale,
                out=out[nd:], backend=ctx.backend,
            )
        o = out.view(T, self.q_size)
        return lora_linear(o, self.o_proj, ctx, self.layer, [OUT], [0])


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _param(2 * config.intermediate_size, config.hidden_size, dtype=dtype, device=device)
        self.down_proj = _param(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        act = gate_up_act(x, self.gate_up_proj, ctx, self.layer)  # silu(gate) * up, LoRA included
        return lora_linear(act, self.down_proj, ctx, self.layer, [DOWN], [0])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(config, layer, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = LlamaMLP(config, layer, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx)


class LlamaModel(nn.Module):
    """forward(ctx) -> hidden [T, H]; compute_logits(hidden[ctx.logits_indices]) -> float32 [N, V]."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype=dtype, device=device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.register_buffer("inv_freq", config.inv_freq().to(device), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2], float32
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        h = F.embedding(ctx.input_ids, self.embed_tokens)  # [T, H]
        cos, sin = self.rope(ctx.positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, ctx)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [T, V]; out: a float32 [T, V] buffer to write them into (a captured graph's)."""
        if out is None:
            return F.linear(hidden, self.lm_head).float()
        return out.copy_(F.linear(hidden, self.lm_head))

    @torch.inference_mode()
    def load_weights(self, weights) -> None:
        """Copy HF-named tensors (an iterable of (name, tensor)) into the fused parameters."""
        cfg = self.config
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        fused = {
            "q_proj": ("self_attn.qkv_proj", 0, q),
            "k_proj": ("self_attn.qkv_proj", q, kv),
            "v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "gate_proj": ("mlp.gate_up_proj", 0, inter),
            "up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = set(params)
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            proj = name.split(".")[-2] if name.count(".") >= 2 else ""
            if name.startswith("layers.") and proj in fused:
                target, start, size = fused[proj]
                pname = f"{name.rsplit('.', 3)[0]}.{target}"
                dst = params[pname][start:start + size]
                seen.add(f"{pname}[{proj}]")
            else:
                pname = name.removesuffix(".weight") if name.removesuffix(".weight") in params else name
                if pname not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                dst = params[pname]
                seen.add(pname)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
            dst.copy_(tensor)
        want = set()
        for pname in expected:
            if pname.endswith("qkv_proj"):
                want |= {f"{pname}[{p}]" for p in ("q_proj", "k_proj", "v_proj")}
            elif pname.endswith("gate_up_proj"):
                want |= {f"{pname}[{p}]" for p in ("gate_proj", "up_proj")}
            elif not (pname == "lm_head" and cfg.tie_word_embeddings):
                want.add(pname)
        missing = sorted(want - seen)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:4]}")
