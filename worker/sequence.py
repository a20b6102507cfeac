"""Sequence: one request's tokens, progress, KV block table and adapter binding."""

from __future__ import annotations

import enum
import itertools
import weakref
from dataclasses import dataclass

import torch

from lorafleet.worker.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens, most likely first
    rank: int | None = None  # prompt logprobs: 1 + the tokens more likely than token_id (ties count: vLLM's)


class PromptLogprobs(list):
    """A sequence's prompt logprobs, per prompt token (None for the first). The sequences filling it are its
    `holders`: the n choices of a request share one (prompt_logprobs.py)."""

    __slots__ = ("__weakref__", "holders")

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.holders: weakref.WeakSet[Sequence] = weakref.WeakSet()


_seq_ids = itertools.count()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        tenant: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.adapter = adapter  # "name@version" or None (base model)
        self.tenant = tenant  # the caller's tenant: admission is fair across tenants (waiting_queue.py)
        self.adapter_slot: int | None = None  # GPU slot while the pool reference is held
        self.kv_room_checked = False  # checked against its adapter's known size (kv_room.py): not again once held
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []  # page ids
        self.prefix_blocks: list = []  # the prefix cache's blocks its table begins with (prefix_cache.Block)
        self.num_cached_tokens = 0  # tokens its admission found computed in the prefix cache (0 once let go)
        self.first_cached_tokens: int | None = None  # num_cached_tokens at its first admission (usage reports it)
        self.num_preemptions = 0
        self.scheduled_at: float | None = None  # time.monotonic() of its first admission to the batch
        self.logprobs: list[TokenLogprob] = []
        # Per prompt token with params.prompt_logprobs (the first has none); kept over preemptions, so a
        # recomputed prompt fills only the positions still missing (prompt_logprobs.py).
        self.prompt_logprobs = PromptLogprobs([None] if params.prompt_logprobs is not None else [])
        self.prompt_logprobs.holders.add(self)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids token that ended it
        self.error: str | None = None  # why the request failed (finish_reason "error")
        self.exception: Exception | None = None  # the failure itself (e.g. AdapterLoadError)
        self.text = ""
        self.detok_prefix = 0  # output-token offsets of the Detokenizer (see detokenizer.py)
        self.detok_read = 0
        self.detok_invalid_run = False  # the byte run open at detok_read cannot be UTF-8 (byte fallback)
        self.detok_seen = 0  # output tokens the Detokenizer's last append looked at
        self.generator: torch.Generator | None = None  # per-sequence RNG when seeded
        self.adapter_eos: frozenset[int] = frozenset()  # its adapter's own end token: an EOS too (Engine.adapter_eos)
        self.json_state: tuple[int, object] | None = None  # JSON mode: (output tokens covered, its grammar's state)
        self.grammar_cost = 0.0  # guided rows: estimated seconds of grammar work per draw (grammar_pacing.py)
        self.grammar_build = 0.0  # ... seconds of its last mask builds, and how often its drawn tokens are refused
        self.grammar_refusals: float | None = None  # (None: no draw yet)
        self.grammar_waits = 0  # steps in a row it was left out to hold a step's grammar time to its budget

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Its tokens [start, end) (prompt then output), without copying the rest."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n):end - n]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={len(self.block_table)}, adapter={self.adapter})"
        )


def generator_seed(seed: int, device: torch.device) -> int:
    """The seed a request's generator takes: on the CPU torch keeps only a seed's low 32 bits (5 and 5 + 2**32, -1
    and 2**63 - 1 would draw alike), so there the high 32 bits are mixed into them; seeds in [0, 2**32) are kept
    as they are. A CUDA generator keeps all 64 bits."""
    if device.type != "cpu" or 0 <= seed < 1 << 32:
        return seed
    seed &= (1 << 64) - 1  # a negative seed as torch reads it
    high = seed >> 32
    return (seed ^ ((high * 0x9E3779B97F4A7C15) >> 32) ^ high) & 0xFFFFFFFF
