"""ChoiceTimer: the latency metrics of one OpenAI request, its queue time and TTFT over all its choices and
inter-token gaps per choice, labelled by the adapter version serving it."""

from __future__ import annotations

import time
from collections.abc import Callable

from lorafleet.worker.adapter_entry import split_key
from lorafleet.worker.completion_job import CompletionJob


class ChoiceTimer:
    """Queue time (to the first choice admitted to a batch), TTFT (first token of any choice), inter-token gaps
    (per choice) and the time from the first token to the end of one request."""

    def __init__(self, metrics, job: CompletionJob, per_version: Callable[[str | None], bool]) -> None:
        self.metrics = metrics
        self.job = job
        self.per_version = per_version  # engine key -> whether its latencies are labelled by version (metrics.acquire)
        self.arrived = job.arrived
        self.scheduled: float | None = None  # time.monotonic() its first choice was admitted to a batch
        self.first: float | None = None
        self.last: dict[int, float] = {}  # choice index -> time of its latest tokens

    @property
    def labels(self) -> tuple[str | None, str]:
        """(adapter, version) of the version serving the job: read each time, as a re-resolve changes it."""
        return request_labels(self.job.adapter)

    def tokens(self, choice: int, num_tokens: int, scheduled_at: float | None = None) -> None:
        """`num_tokens` new tokens of `choice`, whose sequence was first admitted at `scheduled_at` (an
        engine output's)."""
        if scheduled_at is not None and self.scheduled is None:
            self.scheduled = scheduled_at
            adapter, version = self.labels
            self.metrics.observe_queue_time(adapter, max(0.0, scheduled_at - self.arrived), version=version,
                                            per_version=self.per_version(self.job.adapter))
        if num_tokens <= 0 or self.job.score_only:  # scored only: the token generated is not the caller's
            return
        now = time.monotonic()
        adapter, version = self.labels
        per_version = self.per_version(self.job.adapter)
        if self.first is None:
            self.first = now
            prefill_s = None if self.scheduled is None else now - self.scheduled
            self.metrics.observe_first_token(adapter, now - self.arrived, version=version, per_version=per_version,
                                             prefill_s=prefill_s)
        last = self.last.get(choice)
        if last is not None:
            self.metrics.observe_token_gaps(adapter, (now - last) / num_tokens, num_tokens, version=version,
                                            per_version=per_version)
        self.last[choice] = now
        self.metrics.observe_tokens(adapter, num_tokens, version=version)

    def done(self) -> None:
        adapter, version = self.labels
        now = time.monotonic()
        self.metrics.observe_e2e(adapter, now - self.arrived, version=version, per_version=self.per_version(self.job.adapter),
                                 decode_s=None if self.first is None else now - self.first)


def request_labels(key: str | None) -> tuple[str | None, str]:
    """Metrics labels of engine key `name@version`: (name, version); the base model's: (None, "")."""
    return split_key(key) if key else (None, "")
