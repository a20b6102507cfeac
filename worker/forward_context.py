"""ForwardContext: everything one forward pass needs besides the weights, as flat device tensors.

Token order inside a step: all decode tokens first (one per sequence), then the prefill chunks, each
sequence's tokens contiguous. Running example, two decodes (seqs a, b) and one 3-token chunk (c):

    input_ids      [a5, b9, c0, c1, c2]          T = 5
    query_start_loc [0, 1, 2, 5]                 B + 1 = 4
    context_lens   [6, 10, 3]                    tokens in the cache after this step's writes
    num_decodes    2                             decode attention on tokens [:2], prefill on [2:]
    logits_indices [0, 1, 4]                     last token of each sequence that samples this step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lorafleet.kernels.lora_layout import LoRABatch, LoRALayout


@dataclass(slots=True)
class ForwardContext:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]: page_id * block_size + offset
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    num_decodes: int  # the first num_decodes sequences (and tokens) are single-token decodes
    logits_indices: torch.Tensor  # int64 [N]: rows of hidden whose logits are needed
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [P, bs, Hkv, D]
    backend: str = "auto"  # kernel backend: "auto" | "reference" | "triton"
    lora: LoRABatch | None = None
    lora_layout: LoRALayout | None = None
    lora_stream: torch.cuda.Stream | None = None  # CUDA: LoRA deltas run here beside the base GEMMs (worker/lora_linear.py)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
