"""SamplingParams: the per-request decoding options."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # a temperature below it samples greedily (vLLM's): logits / 1e-38 overflow to NaN


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed, prompt and adapter -> same tokens whatever the batch (float32; README)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # end the request like EOS (not in the text)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    # Before this many tokens are generated, EOS and stop_token_ids are never sampled (their logits are
    # -inf) and stop strings are not searched (vLLM's). 0 = off.
    min_tokens: int = 0
    skip_special_tokens: bool = True  # special tokens left out of the text (they are in logprobs' tokens)
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the k most likely
    # vLLM's: per prompt token (but the first), its logprob given the tokens before it, plus the k most
    # likely alternatives; None: off. See prompt_logprobs.py.
    prompt_logprobs: int | None = None
    # Penalties (vLLM's): presence/frequency over the generated tokens (OpenAI's), repetition over the
    # prompt and the generated tokens (transformers'); 0, 0 and 1 change nothing. See sampler.py.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # {token id: bias in [-100, 100]} added to the raw logits, greedy requests included (OpenAI's).
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability, after temperature; 0 = off
    # JSON mode (OpenAI's response_format json_object): the output is a prefix of one JSON object, and EOS or
    # a stop token only ends a complete one (json_guide.py).
    json_object: bool = False
    # Structured output: the grammar the output is held to instead of "any JSON object" (a schema's,
    # json_schema_grammar.SchemaGrammar, or a list of choices', choice_grammar.py); it sets json_object (the
    # sampler's constrained rows are those).
    grammar: Any = None
    # max_tokens was not given: it is the context left after the prompt, lowered to what the KV pages the
    # request's adapter and pinned adapters leave can hold, instead of refusing it (kv_room.py).
    max_tokens_to_fit: bool = False
    # vLLM's: only requests with the same salt (or none) share prefix-cache blocks, within one tenant; a caller
    # that serves several users under one key keeps them apart (one's hit would show in another's TTFT).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None:
            self.json_object = True
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()} or None
        bad = {t: b for t, b in (self.logit_bias or {}).items() if t < 0 or not -100.0 <= b <= 100.0}
        if bad:
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {bad}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1
