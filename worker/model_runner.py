"""ModelRunner: turns a ScheduledBatch into a ForwardContext, runs the model, returns logits.

All per-step metadata is built on the host from the sequences and copied to the device in one go;
the forward itself never syncs with the host.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from lorafleet.kernels.lora_layout import LoRABatch, LoRALayout
from lorafleet.worker.block_manager import BlockManager
from lorafleet.worker.cuda_graphs import DecodeGraphs, DecodeInputs, group_by_slot
from lorafleet.worker.forward_context import ForwardContext
from lorafleet.worker.llama import LlamaModel
from lorafleet.worker.prompt_logprobs import fill_prompt_logprobs
from lorafleet.worker.scheduler import ScheduledBatch
from lorafleet.worker.sequence import Sequence

log = logging.getLogger("lorafleet.engine")

LORA_SEGMENT_LEN = 64  # default most tokens per LoRA kernel segment (a step's own: kernels.lora_layout.segment_len)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        block_manager: BlockManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device,
        backend: str = "auto",
        lora_layout: Callable[[], LoRALayout | None] = lambda: None,
        slot_max_rank: Callable[[int], int] = lambda slot: 0,
        lora_segment_len: int = LORA_SEGMENT_LEN,
        graphs: DecodeGraphs | None = None,
        lora_stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.model = model
        self.block_manager = block_manager
        self.kv_caches = kv_caches
        self.device = device
        self.backend = backend
        self.lora_layout = lora_layout  # the adapter pool's current layout (it changes on load/evict)
        self.slot_max_rank = slot_max_rank  # host-side rank of a slot's adapter (sizes the shrink buffer)
        self.lora_segment_len = lora_segment_len
        self._pin = device.type == "cuda"
        self.graphs = graphs  # pure decode steps are replayed from CUDA graphs when set
        self.lora_stream = lora_stream  # LoRA deltas beside the base GEMMs when set
        self.prompt_logprobs_lists: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # prompt_logprobs.py
        self.tenant_eras: dict[str, int] = {}  # tenant -> times its name was taken away (a later holder shares none)

    def _to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardContext, list[Sequence]]:
        """The step's ForwardContext and the sequences that sample a token (in logits row order)."""
        bs = self.block_manager.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []
        context_lens: list[int] = []
        query_start_loc = [0]
        logits_indices: list[int] = []
        samplers: list[Sequence] = []
        tables: list[list[int]] = []
        max_rank, rank_tokens, lora_tokens = 0, 0, 0
        for seq, num_new in batch.scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids()[start:end] if num_new > 1 else [seq.token_at(start)])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
            adapter_slot = -1 if seq.adapter_slot is None else seq.adapter_slot
            token_slots.extend([adapter_slot] * num_new)
            if adapter_slot >= 0:
                rank = self.slot_max_rank(adapter_slot)
                max_rank = max(max_rank, rank)
                rank_tokens += rank * num_new
                lora_tokens += num_new
            context_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_new)
            tables.append(seq.block_table)
            if end == seq.num_tokens:  # the whole sequence is in the cache: sample the next token
                logits_indices.append(query_start_loc[-1] - 1)
                samplers.append(seq)
        max_blocks = max(len(t) for t in tables)
        block_tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        lora, layout = None, None
        if max_rank > 0:
            layout = self.lora_layout()
            adapted = None
            if layout.ranks.device.type == "cpu":  # which layers' projections the batch's adapters touch: no sync here
                used = sorted({s for s in token_slots if s >= 0})
                adapted = frozenset(map(tuple, (layout.ranks[:, :, used] > 0).any(-1).nonzero().tolist()))
            lora = self._lora_batch(token_slots, max_rank, rank_tokens / lora_tokens, lora_tokens == len(token_slots), adapted)
        ctx = ForwardContext(
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            slot_mapping=self._to_device(slots, torch.int64),
            block_tables=self._to_device(block_tables, torch.int32),
            context_lens=self._to_device(context_lens, torch.int32),
            query_start_loc=self._to_device(query_start_loc, torch.int32),
            num_decodes=len(batch.decodes),
            logits_indices=self._to_device(logits_indices, torch.int64),
            kv_caches=self.kv_caches,
            backend=self.backend,
            lora=lora,
            lora_layout=layout,
            lora_stream=self.lora_stream,
        )
        return ctx, samplers

    def _lora_batch(self, token_slots: list[int], max_rank: int, mean_rank: float, every_token: bool,
                    adapted: frozenset[tuple[int, int]] | None = None) -> LoRABatch:
        # Grouped on the host (no device syncs); a long run of one slot (a prefill) is cut into segments
        # (16 tokens in a small step, up to lora_segment_len in a long one) so it spreads over many kernel
        # programs. mean_rank: over the tokens with a slot (kernel grids plan for it); every_token: no
        # token without a slot.
        sorted_ids, seg_starts, seg_slots = group_by_slot(token_slots, self.lora_segment_len)
        return LoRABatch(
            token_slots=self._to_device(token_slots, torch.int32),
            sorted_token_ids=self._to_device(sorted_ids, torch.int32),
            seg_starts=self._to_device(seg_starts, torch.int32),
            seg_slots=self._to_device(seg_slots, torch.int32),
            max_rank=max_rank,
            mean_rank=mean_rank,
            every_token=every_token,
            adapted=adapted,
        )

    def decode_inputs(self, batch: ScheduledBatch) -> DecodeInputs:
        """Host inputs of a pure decode step (every sequence adds one token and samples)."""
        bs = self.block_manager.block_size
        inputs = DecodeInputs([], [], [], [], [], [])
        rank_sum, num_lora = 0, 0
        for seq in batch.decodes:
            pos = seq.num_computed_tokens
            table = seq.block_table
            inputs.input_ids.append(seq.token_at(pos))
            inputs.positions.append(pos)
            inputs.slot_mapping.append(table[pos // bs] * bs + pos % bs)
            inputs.context_lens.append(pos + 1)
            inputs.block_tables.append(table)
            inputs.token_slots.append(-1 if seq.adapter_slot is None else seq.adapter_slot)
            if seq.adapter_slot is not None:
                rank = self.slot_max_rank(seq.adapter_slot)
                inputs.max_rank = max(inputs.max_rank, rank)
                rank_sum, num_lora = rank_sum + rank, num_lora + 1
        inputs.mean_rank = rank_sum / num_lora if num_lora else 0.0
        return inputs

    @torch.inference_mode()
    def warmup(self, token_counts: list[int], ranks: list[int]) -> int:
        """Throwaway forwards of one T-token prefill, without adapters and with one adapter slot of each
        rank bound: the Triton kernels of common step shapes compile now, not in a served step.

        Nothing is written to the KV cache (slot_mapping -1); the context read is page 0, whatever it
        holds (the outputs are dropped). Slot 0 may hold no adapter: its kernels then skip their work,
        but they are compiled all the same. Returns the number of forwards run.
        """
        layout = self.lora_layout()
        bs = self.block_manager.block_size
        runs = 0
        for num in token_counts:
            for rank in [0, *ranks]:
                if rank and (layout is None or rank > layout.max_rank):
                    continue
                ctx = ForwardContext(
                    input_ids=torch.zeros(num, dtype=torch.int64, device=self.device),
                    positions=torch.arange(num, device=self.device),
                    slot_mapping=torch.full((num,), -1, dtype=torch.int64, device=self.device),
                    block_tables=torch.zeros(1, -(-num // bs), dtype=torch.int32, device=self.device),
                    context_lens=torch.tensor([num], dtype=torch.int32, device=self.device),
                    query_start_loc=torch.tensor([0, num], dtype=torch.int32, device=self.device),
                    num_decodes=0,
                    logits_indices=torch.tensor([num - 1], device=self.device),
                    kv_caches=self.kv_caches,
                    backend=self.backend,
                    lora=self._lora_batch([0] * num, rank, float(rank), True) if rank else None,
                    lora_layout=layout if rank else None,
                    lora_stream=self.lora_stream,
                )
                self.model.compute_logits(self.model(ctx)[ctx.logits_indices])
                runs += 1
        return runs

    def probe(self) -> bool:
        """Whether the device still runs a forward: one token, no adapter, nothing written to the KV cache
        (a failure of one adapter's requests alone is then that adapter's, else the device's)."""
        try:
            self.warmup([1], [])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # an asynchronous CUDA error surfaces here
        except Exception as exc:
            log.warning("a one-token forward without adapters failed too (%r): the device's failure", exc)
            return False
        return True

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, list[Sequence]]:
        """float32 logits [N, V] for the sequences that sample this step (None if none do)."""
        if self.graphs is not None and batch.decodes and not batch.prefills:
            inputs = self.decode_inputs(batch)
            if self.graphs.fits(inputs):
                return self.graphs.run(inputs), list(batch.decodes)
        ctx, samplers = self.prepare(batch)
        hidden = self.model(ctx)
        # Extra rows, apart from these; choices of one prompt share theirs.
        fill_prompt_logprobs(self.model.compute_logits, hidden, batch.scheduled, self.prompt_logprobs_lists,
                             self.tenant_eras)
        if not samplers:
            return None, samplers
        return self.model.compute_logits(hidden[ctx.logits_indices]), samplers

    def tenant_gone(self, tenant: str) -> None:
        """`tenant` left the keys file: whoever is given its name later shares no prompt logprobs with its requests
        still running (as the prefix cache keeps their blocks apart: prefix_cache.drop_tenant). Any thread."""
        self.tenant_eras[tenant] = self.tenant_eras.get(tenant, 0) + 1
