"""The adapter-pool benchmark's setup: model shapes, random PEFT adapters, and `Bench`, a page pool and
adapter pool with a synthetic decode step over them (used by bench/adapter_pool.py)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from lorafleet.kernels.attention import paged_attention_decode
from lorafleet.kernels.lora_layout import PROJS, LoRABatch, make_lora_batch
from lorafleet.worker.adapter_image import ModelDims
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.cuda_graphs import padded_groups
from lorafleet.worker.lora_linear import lora_linear
from lorafleet.worker.model_config import ModelConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig, kv_page_elems

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16

    @property
    def dims(self) -> ModelDims:
        return ModelDims(self.layers, self.hidden, self.inter, self.heads * self.head_dim, self.kv_heads * self.head_dim)

    @property
    def page_elems(self) -> int:
        return kv_page_elems(num_layers=self.layers, block_size=self.block_size, num_kv_heads=self.kv_heads,
                             head_dim=self.head_dim)

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=1024, hidden_size=self.hidden, intermediate_size=self.inter,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim, name="synthetic")


LLAMA3_8B = Shape("llama3-8b", 32, 4096, 14336, 32, 8, 128)
SMALL = Shape("small", 4, 512, 1024, 8, 2, 64)


def write_peft(path: Path, shape: Shape, rank: int, seed: int, dtype: torch.dtype, device: torch.device) -> Path:
    """A PEFT-format adapter directory (all seven projections) with random weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(shape.layers):
        for proj in PROJS:
            fan_in, fan_out = shape.dims.in_out(proj)
            base = f"base_model.model.model.layers.{layer}.{PARENT[proj]}.{proj}"
            tensors[f"{base}.lora_A.weight"] = (0.01 * torch.randn(rank, fan_in, generator=g, device=device)).to(dtype).cpu()
            tensors[f"{base}.lora_B.weight"] = (0.01 * torch.randn(fan_out, rank, generator=g, device=device)).to(dtype).cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJS), "bias": "none",
        "base_model_name_or_path": "synthetic", "task_type": "CAUSAL_LM"}))
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the pool and a synthetic decode step over it ---------------------------------------------------------
class Bench:
    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, *, num_pages: int, max_slots: int,
                 cpu_budget: int, batch: int, context: int, pool_kw: dict | None = None) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        self.page_pool = PagePool(PagePoolConfig(num_pages=num_pages, page_elems=shape.page_elems, dtype=dtype,
                                                 device=str(device)))
        self.pool = AdapterPool(self.page_pool, shape.dims, AdapterPoolConfig(
            max_slots=max_slots, max_rank=16, cpu_budget_bytes=cpu_budget, num_load_threads=2, **(pool_kw or {})))
        self.mc = shape.model_config()
        s = shape
        g = torch.Generator(device=device).manual_seed(0)

        def w(o, i):
            return (torch.randn(o, i, generator=g, device=device) / math.sqrt(i)).to(dtype)

        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        # One layer's weights, reused by every layer: the same bytes are read per layer as in a real model.
        self.w_qkv, self.w_o = w(q + 2 * kv, s.hidden), w(s.hidden, q)
        self.w_gu, self.w_down = w(2 * s.inter, s.hidden), w(s.hidden, s.inter)
        self.batch, self.context = batch, context
        blocks = -(-context // s.block_size)
        self.block_tables = torch.tensor([self.page_pool.allocate(blocks, ("kv", b)) for b in range(batch)],
                                         dtype=torch.int32, device=device)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.kv = self.page_pool.kv_caches(num_layers=s.layers, block_size=s.block_size, num_kv_heads=s.kv_heads,
                                           head_dim=s.head_dim)
        self.x0 = torch.randn(batch, s.hidden, generator=g, device=device).to(dtype)
        self._graph: torch.cuda.CUDAGraph | None = None
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None  # LoRA beside the GEMMs

    def step(self, token_slots: torch.Tensor, *, graph: bool = False) -> None:
        """One decode step of `batch` tokens; token_slots: int32 [batch] adapter slot per token.

        graph=False: eager. graph=True: replayed from a CUDA graph as the engine runs decode steps
        (worker/cuda_graphs.py: segments padded to one per token, the pool's max rank as bound).
        """
        if not graph:
            self._layers(make_lora_batch(token_slots, self.pool.layout.max_rank_by_slot()))
        elif self.device.type != "cuda":
            raise ValueError("graph steps need a CUDA device")
        else:
            if self._graph is None:
                self._capture()
            slots = token_slots.tolist()
            ids, starts, seg_slots = padded_groups(slots, 16, self.batch)
            host = torch.tensor([*slots, *ids, *seg_slots, *starts], dtype=torch.int32)
            self._lora_buf.copy_(host, non_blocking=True)
            self._graph.replay()
        sync(self.device)

    def _capture(self) -> None:
        lay = self.pool.layout
        n = self.batch
        self._lora_buf = torch.zeros(4 * n + 1, dtype=torch.int32, device=self.device)  # slots, ids, seg slots, starts
        self._lora_buf[: n].fill_(-1)
        self._lora_buf[2 * n : 3 * n].fill_(-1)
        buf = self._lora_buf
        lora = LoRABatch(token_slots=buf[:n], sorted_token_ids=buf[n : 2 * n], seg_starts=buf[3 * n :],
                         seg_slots=buf[2 * n : 3 * n], max_rank=lay.max_rank)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._layers(lora)  # compiles the kernels before capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._layers(lora)

    def _layers(self, lora: LoRABatch) -> None:
        """Every layer as the engine runs it: base GEMMs with their LoRA deltas (worker/lora_linear.py),
        paged decode attention over the pool's KV pages."""
        s = self.shape
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        ctx = SimpleNamespace(lora=lora, lora_layout=self.pool.layout, backend="auto", lora_stream=self.side)
        x = self.x0
        attn = torch.empty(self.batch, s.heads, s.head_dim, dtype=self.dtype, device=self.device)
        for layer in range(s.layers):
            qkv = lora_linear(x, self.w_qkv, ctx, layer, [0, 1, 2], [0, q_size, q_size + kv_size])
            k_cache, v_cache = self.kv[layer]
            paged_attention_decode(q=qkv[:, :q_size].reshape(self.batch, s.heads, s.head_dim), k_cache=k_cache,
                                   v_cache=v_cache, block_tables=self.block_tables, context_lens=self.context_lens,
                                   scale=s.head_dim ** -0.5, out=attn)
            x = x + lora_linear(attn.reshape(self.batch, q_size), self.w_o, ctx, layer, [3], [0])
            gu = lora_linear(x, self.w_gu, ctx, layer, [4, 5], [0, s.inter])
            act = torch.nn.functional.silu(gu[:, : s.inter]) * gu[:, s.inter :]
            x = x + lora_linear(act, self.w_down, ctx, layer, [6], [0])

    def wait_resident(self, key: str, waiter: object) -> tuple[int, float]:
        """Acquire `key`, polling like a step loop would, until resident; (slot, seconds)."""
        t0 = time.perf_counter()
        while (slot := self.pool.acquire(key, waiter=waiter)) is None:
            self.pool.wait_idle(timeout=600)
        return slot, time.perf_counter() - t0


def random_weights(shape: Shape, rank: int, seed: int, dtype: torch.dtype, device: torch.device):
    from lorafleet.worker.peft_adapter import LoRAWeights, ModuleLoRA

    g = torch.Generator(device=device).manual_seed(seed)
    modules = {}
    for layer in range(shape.layers):
        for proj in PROJS:
            fan_in, fan_out = shape.dims.in_out(proj)
            a = (0.01 * torch.randn(rank, fan_in, generator=g, device=device)).to(dtype).cpu()
            bm = (0.01 * torch.randn(fan_out, rank, generator=g, device=device)).to(dtype).cpu()
            modules[(layer, proj)] = ModuleLoRA(a=a, b=bm, scale=2.0)
    nbytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    return LoRAWeights(name=f"r{seed}", version="1", base_model="synthetic", modules=modules, nbytes=nbytes)

