"""RequestOutput: what one engine step reports for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.worker.sequence import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # generated in this step (empty when only finishing)
    new_text: str  # text that became final in this step (stream it)
    new_logprobs: list[TokenLogprob] | None
    token_ids: list[int]  # all generated tokens so far
    text: str  # all generated text so far (stop strings cut off)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set with finish_reason "error" (e.g. the adapter failed to load)
    exception: Exception | None = field(default=None, repr=False, compare=False)  # the failure, to re-raise
    adapter: str | None = None  # "name@version" that served it, None for the base model
    num_preemptions: int = 0
