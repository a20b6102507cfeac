"""RequestOutput: what one engine step reports for one request; OutputTracker builds them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

from lorafleet.worker.sequence import Sequence, TokenLogprob
from lorafleet.worker.stop_checker import StopChecker


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
    # Per prompt token (None for the first) with SamplingParams.prompt_logprobs; complete from the first
    # output that has tokens on.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # with "stop": the stop string or stop token id (not EOS) that ended it
    error: str | None = None  # set with finish_reason "error" (e.g. the adapter failed to load)
    exception: Exception | None = field(default=None, repr=False, compare=False)  # the failure, to re-raise
    adapter: str | None = None  # "name@version" that served it, None for the base model
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (not computed for it)
    scheduled_at: float | None = None  # time.monotonic() of its first admission to the batch

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the `later` one of the same request as one: the new tokens, text and logprobs of
        both, the rest as `later` says (a consumer that fell behind holds one output per request, not one per
        step, each with a copy of everything generated so far)."""
        new_logprobs = None if later.new_logprobs is None else (self.new_logprobs or []) + later.new_logprobs
        return dataclasses.replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                                   new_text=self.new_text + later.new_text, new_logprobs=new_logprobs)


class Prefix(Sequence_):
    """The first `n` items of a list only ever appended to (a sequence's generated tokens, their logprobs), as a
    read-only list: made in O(1) each step (a copy of everything generated so far made each step quadratic over a
    long output), copied only where read. Equal to a list or tuple of the same items."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int) -> None:
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._items[: self._n][index]
        if not -self._n <= index < self._n:
            raise IndexError("index out of range")
        return self._items[index % self._n]

    def __iter__(self):
        return iter(self._items[: self._n])

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, Prefix | tuple) else other)

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __radd__(self, other) -> list:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))


class OutputTracker:
    """Per request in flight, how many tokens and characters it was told about; builds each step's
    RequestOutput with only what is new (text held back while it may still be cut by a stop string)."""

    def __init__(self) -> None:
        self._emitted: dict[str, tuple[int, int]] = {}  # request_id -> (tokens, chars) reported

    def start(self, request_id: str) -> None:
        self._emitted[request_id] = (0, 0)

    def forget(self, request_id: str) -> None:
        self._emitted.pop(request_id, None)

    def next(self, seq: Sequence) -> RequestOutput:
        done_tokens, done_chars = self._emitted.get(seq.request_id, (0, 0))
        text = seq.text
        final_chars = StopChecker.final_text_len(seq, done_chars)
        done = len(seq.output_token_ids)
        self._emitted[seq.request_id] = (done, final_chars)
        want_lp = seq.params.logprobs is not None
        if seq.is_finished:
            self.forget(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=seq.output_token_ids[done_tokens:],
            new_text=text[done_chars:final_chars],
            new_logprobs=seq.logprobs[done_tokens:] if want_lp else None,
            # All so far: a copy once finished, else a view (the engine appends while a consumer reads).
            token_ids=list(seq.output_token_ids) if seq.is_finished else Prefix(seq.output_token_ids, done),
            text=text,
            logprobs=(list(seq.logprobs) if seq.is_finished else Prefix(seq.logprobs, len(seq.logprobs))) if want_lp else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,  # filled by prefill only: shared, not copied per output
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            error=seq.error,
            exception=seq.exception,
            adapter=seq.adapter,
            num_preemptions=seq.num_preemptions,
            scheduled_at=seq.scheduled_at,
            num_cached_tokens=seq.first_cached_tokens or 0,
        )
