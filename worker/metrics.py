"""Prometheus metrics of one worker: a registry per app, never the process-global one.

Request-side series (counts, TTFT, inter-token and end-to-end latency, tokens) are observed by the
HTTP handlers, labelled with the adapter's name and the version the request resolved to (`version`,
empty for the base model and for requests refused before a version was chosen), so a canary's
latency and errors can be compared with its stable version's. A name keeps the series of the versions
it serves: after each admin change (a push, a load, an unload) `retain_served` retires the names and
versions no longer served, and a request that finishes on a version retired meanwhile retires it too
(`retain_versions`). A retired version's series stay while requests hold it (`acquire` / `release`) and
for `retired_grace_s` after its last one was counted, so a scrape sees the final counts of a rolled-back
canary (retired_series.py); then they go, so /metrics shows what is served, not what was. The latency
histograms (about 45 series a label set) carry the adapter and version only while that name rolls out a
version (a canary, or a new stable version loading beside the old: `LatencySeries` "rollouts", the default),
so that a worker serving thousands of adapters does not export a histogram per adapter; the others are
counted under adapter `__other__`. "all" labels every adapter's. Batch size and adapters per batch
are observed once per engine step; queue depth, KV usage, preemptions and the running/waiting adapters
are read at scrape time from an `EngineSnapshot`. The adapter pool's own series (tier hits/misses, load
latency, evictions, bytes per tier: adapter_metrics.py) are registered into the same registry with
`register()`. A scrape is rendered off the event loop (`render_async`), from engine figures read on the loop.
The vLLM-compatible names let existing routers (Gateway API inference extension) pick
workers by queue length, KV usage and resident adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.registry import Collector

from lorafleet.worker.admission import (
    INTAKE_FULL,
    QUEUE_FULL,
    REQUEST_TIMEOUT,
    TENANT_INTAKE_FULL,
    TENANT_QUEUE_FULL,
)
from lorafleet.worker.engine_metrics import (  # noqa: F401 (EngineSnapshot, prefix_tokens: the server's)
    FROZEN,
    THROUGHPUT_WINDOW_S,
    EngineCollector,
    EngineSnapshot,
    prefix_tokens,
)
from lorafleet.worker.retired_series import RetiredSeries

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BASE_MODEL_LABEL = "__base__"  # the adapter label of requests without an adapter
UNRESOLVED_LABEL = "__unresolved__"  # the adapter label of requests refused before `model` was resolved
OTHER_LABEL = "__other__"  # the adapter label of latencies of names not rolling out a version ("rollouts")
ENDPOINTS, FAILURES = ("completions", "chat"), ("500", "503", "504")  # a rollout's 5xx series, made at 0
LatencySeries = Literal["rollouts", "all"]
# A `_created` series per counter and histogram child doubles what a scrape of thousands of adapters carries, for a
# timestamp that rate() does not read.
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_HELP = ("Arrival to first scheduling: waiting for a seat, KV pages, the adapter's GPU slot or the "
               "tenant's turn.")
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_ADAPTER_COUNT_BUCKETS = (0, *_COUNT_BUCKETS)  # 0: a step of base-model requests only
# Seconds a retired version's series outlive its last request: several scrapes at the chart's 15 s, two at
# Prometheus' default 1 min.
RETIRED_GRACE_S = 120.0


REJECTED_REASONS = (QUEUE_FULL, TENANT_QUEUE_FULL, INTAKE_FULL, TENANT_INTAKE_FULL, REQUEST_TIMEOUT)


class WorkerMetrics:
    """All series of one worker, on a registry of its own."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot] = EngineSnapshot, *,
                 retired_grace_s: float = RETIRED_GRACE_S, clock: Callable[[], float] = time.monotonic,
                 latency_series: LatencySeries = "rollouts", lora_info: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.latency_series = latency_series
        self._rolling: set[str] = set()  # names serving more than one version (latencies labelled by adapter)
        self._zeros: dict[str, set[tuple[str, str, str]]] = {}  # name -> 5xx series a rollout made, still at 0
        r = self.registry
        self.requests = Counter("lorafleet_requests", "Finished HTTP inference requests.",
                                ["adapter", "version", "endpoint", "status"], registry=r)
        self.ttft = Histogram("lorafleet_time_to_first_token_seconds", "Arrival to first token.",
                              ["adapter", "version"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("lorafleet_inter_token_latency_seconds", "Gap between streamed tokens.",
                                     ["adapter", "version"], buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("lorafleet_e2e_request_latency_seconds", "Arrival to last token.",
                             ["adapter", "version"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("lorafleet_request_queue_time_seconds", _QUEUE_HELP, ["adapter", "version"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lorafleet_prompt_tokens", "Prompt tokens processed.", ["adapter", "version"],
                                     registry=r)
        self.generation_tokens = Counter("lorafleet_generation_tokens", "Tokens generated.", ["adapter", "version"],
                                         registry=r)
        self.batch_size = Histogram("lorafleet_batch_size", "Sequences per engine step.",
                                    buckets=_COUNT_BUCKETS, registry=r)
        self.adapters_per_batch = Histogram("lorafleet_adapters_per_batch", "Distinct adapters per engine step.",
                                            buckets=_ADAPTER_COUNT_BUCKETS, registry=r)
        self.rejected = Counter("lorafleet_requests_rejected", "Requests refused before reaching the engine.",
                                ["reason"], registry=r)
        for reason in REJECTED_REASONS:  # at 0 from the start: rate() sees a series' first increment only from 0
            self.rejected.labels(reason)
        # vLLM's names, one series set for the worker (labelled by the served base model, as vLLM's are)
        self._model_name = ""  # set once the engine is up (the served model name): `model_name`
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", ["model_name"],
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_inter_token = Histogram("vllm:inter_token_latency_seconds", "Gap between streamed tokens.",
                                          ["model_name"], buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", ["model_name"],
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_queue_time = Histogram("vllm:request_queue_time_seconds", _QUEUE_HELP, ["model_name"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_prefill_time = Histogram("vllm:request_prefill_time_seconds", "First scheduling to first token.",
                                           ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_decode_time = Histogram("vllm:request_decode_time_seconds", "First token to last token.",
                                          ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", ["model_name"], registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", ["model_name"],
                                              registry=r)
        self._recent_tokens: deque[tuple[float, int]] = deque()
        # adapter -> version -> (endpoint, status) of its request series: what retain_versions removes
        self._versions: dict[str, dict[str, set[tuple[str, str]]]] = {}
        self.retired = RetiredSeries(retired_grace_s, clock)
        self.rolled_out = RetiredSeries(retired_grace_s, clock)  # names whose rollout ended: latencies to drop
        self._engine = EngineCollector(snapshot, self.tokens_per_second, lambda: self.model_name, lora_info)
        r.register(self._engine)

    @property
    def model_name(self) -> str:
        return self._model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        """The `model_name` label of the vllm:* series, which then exist at 0 (as vLLM's do from its start):
        a counter series that first appears at its first increment loses that increment to rate()."""
        self._model_name = name
        for metric in (self.vllm_ttft, self.vllm_inter_token, self.vllm_e2e, self.vllm_queue_time,
                       self.vllm_prefill_time, self.vllm_decode_time, self.vllm_prompt_tokens,
                       self.vllm_generation_tokens):
            metric.labels(name)

    def _labels(self, adapter: str | None, version: str) -> tuple[str, str]:
        adapter = adapter or BASE_MODEL_LABEL
        self._versions.setdefault(adapter, {}).setdefault(version, set())
        return adapter, version

    def observe_request(self, *, adapter: str | None, endpoint: str, status: int, version: str = "") -> None:
        labels = self._labels(adapter, version)
        self._versions[labels[0]][version].add((endpoint, str(status)))
        self._zeros.get(labels[0], set()).discard((version, endpoint, str(status)))  # counted: it stays
        self.requests.labels(*labels, endpoint, str(status)).inc()

    def observe_prompt_tokens(self, adapter: str | None, num_tokens: int, *, version: str = "") -> None:
        self.prompt_tokens.labels(*self._labels(adapter, version)).inc(num_tokens)
        self.vllm_prompt_tokens.labels(self.model_name).inc(num_tokens)

    def _latency_labels(self, adapter: str | None, version: str, per_version: bool | None) -> tuple[str, str]:
        """The labels of a latency observation: the adapter's own while it rolls out a version (`per_version`:
        as `acquire` said when the request began; None: now), or with "all", or for the base model and
        unresolved requests; else (__other__, "")."""
        adapter = adapter or BASE_MODEL_LABEL
        rolling = adapter in self._rolling if per_version is None else per_version
        if self.latency_series == "all" or rolling or adapter in (BASE_MODEL_LABEL, UNRESOLVED_LABEL):
            return self._labels(adapter, version)
        return OTHER_LABEL, ""

    @property
    def _latencies(self) -> tuple[Histogram, ...]:
        """The latency series labelled by adapter version (`_latency_labels`)."""
        return self.ttft, self.inter_token, self.e2e, self.queue_time

    def observe_queue_time(self, adapter: str | None, seconds: float, *, version: str = "",
                           per_version: bool | None = None) -> None:
        self.queue_time.labels(*self._latency_labels(adapter, version, per_version)).observe(seconds)
        self.vllm_queue_time.labels(self.model_name).observe(seconds)

    def observe_first_token(self, adapter: str | None, seconds: float, *, version: str = "",
                            per_version: bool | None = None, prefill_s: float | None = None) -> None:
        """`seconds` from arrival; `prefill_s`: from its first scheduling, where known."""
        self.ttft.labels(*self._latency_labels(adapter, version, per_version)).observe(seconds)
        self.vllm_ttft.labels(self.model_name).observe(seconds)
        if prefill_s is not None:
            self.vllm_prefill_time.labels(self.model_name).observe(prefill_s)

    def observe_token_gaps(self, adapter: str | None, seconds: float, count: int, *, version: str = "",
                           per_version: bool | None = None) -> None:
        """`count` tokens that arrived `seconds` apart each."""
        child = self.inter_token.labels(*self._latency_labels(adapter, version, per_version))
        worker = self.vllm_inter_token.labels(self.model_name)
        for _ in range(count):
            child.observe(seconds)
            worker.observe(seconds)

    def observe_e2e(self, adapter: str | None, seconds: float, *, version: str = "",
                    per_version: bool | None = None, decode_s: float | None = None) -> None:
        """`seconds` from arrival; `decode_s`: from its first token, where it had one."""
        self.e2e.labels(*self._latency_labels(adapter, version, per_version)).observe(seconds)
        self.vllm_e2e.labels(self.model_name).observe(seconds)
        if decode_s is not None:
            self.vllm_decode_time.labels(self.model_name).observe(decode_s)

    def observe_tokens(self, adapter: str | None, num_tokens: int, *, version: str = "",
                       now: float | None = None) -> None:
        if num_tokens <= 0:
            return
        self.generation_tokens.labels(*self._labels(adapter, version)).inc(num_tokens)
        self.vllm_generation_tokens.labels(self.model_name).inc(num_tokens)
        now = time.monotonic() if now is None else now
        self._recent_tokens.append((now, num_tokens))
        self._trim(now)

    def acquire(self, adapter: str | None, version: str, endpoint: str | None = None) -> bool:
        """A request resolved to this version: its series stay, retired or not, until `release`. Whether the
        name rolls out a version now (pass it to `release`, and as `per_version` to the request's latencies: they
        keep their labels to its end, a rollback or promotion meanwhile notwithstanding, and per-version series
        stay until a scrape read them). With its `endpoint`, the counters it moves on success exist from now at 0
        (rate() misses a series' first increment)."""
        key = self._labels(adapter, version)
        if endpoint is not None:
            self._zero(*key, endpoint, "200")
            for metric in (self.prompt_tokens, self.generation_tokens):
                metric.labels(*key)
        self.retired.acquire(key)
        if key[0] not in self._rolling:
            return False
        self.rolled_out.acquire((key[0], ""))
        return True

    def _zero(self, adapter: str, version: str, endpoint: str, status: str) -> None:
        self._versions.setdefault(adapter, {}).setdefault(version, set()).add((endpoint, status))
        self.requests.labels(adapter, version, endpoint, status)

    def release(self, adapter: str | None, version: str, rolling: bool = False) -> None:
        """The request of an `acquire` (which answered `rolling`) has been counted."""
        key = (adapter or BASE_MODEL_LABEL, version)
        self.retired.release(key)
        if rolling:
            self.rolled_out.release((key[0], ""))
        self.drop_expired()

    def retain_versions(self, adapter: str, versions: Collection[str]) -> None:
        """Retire the request series of `adapter`'s versions not in `versions` (the ones served): each push
        that rolls out a version would otherwise leave the series of the one it retired, forever. They go
        once no request holds them and their grace is over (`drop_expired`)."""
        for version in self._versions.get(adapter, ()):
            key = (adapter, version)
            if version in versions:
                self.retired.restore(key)
            else:
                self.retired.retire(key)
        if len(versions) <= 1:  # a request's end may end a rollout (a fallback done with), never start one
            self._set_rolling(adapter, False)
        self.drop_expired()

    def _set_rolling(self, adapter: str, rolling: bool, versions: Collection[str] = ()) -> None:
        """Whether `adapter` serves more than one version now (`versions`). A rollout that ends puts its latencies
        back under __other__; its own series leave after the grace, once no request begun during it runs. One
        that begins makes its versions' 5xx series at 0 (the canary's first failure counts in its error share);
        those still at 0 leave with its latencies."""
        if rolling:
            for version, endpoint, status in itertools.product(versions, ENDPOINTS, FAILURES):
                if (endpoint, status) not in self._versions.get(adapter, {}).get(version, ()):
                    self._zero(adapter, version, endpoint, status)
                    self._zeros.setdefault(adapter, set()).add((version, endpoint, status))
            self._rolling.add(adapter)
            self.rolled_out.restore((adapter, ""))
        elif adapter in self._rolling:
            self._rolling.discard(adapter)
            self.rolled_out.retire((adapter, ""))

    def drop_expired(self) -> None:
        """Drop the series of retired versions that no request holds and whose grace is over."""
        for adapter, version in self.retired.expired():
            seen = self._versions.get(adapter, {})
            for endpoint, status in seen.pop(version, ()):
                self.requests.remove(adapter, version, endpoint, status)
            for metric in (*self._latencies, self.prompt_tokens, self.generation_tokens):
                with contextlib.suppress(KeyError):  # never observed: older prometheus-client versions raise
                    metric.remove(adapter, version)
            if not seen:
                self._versions.pop(adapter, None)
        for adapter, _ in self.rolled_out.expired():
            for version, endpoint, status in self._zeros.pop(adapter, ()) if adapter not in self._rolling else ():
                self._versions.get(adapter, {}).get(version, set()).discard((endpoint, status))
                with contextlib.suppress(KeyError):  # its version's series went already
                    self.requests.remove(adapter, version, endpoint, status)
            if adapter not in self._rolling and self.latency_series == "rollouts":
                for version in self._versions.get(adapter, ()):
                    for metric in self._latencies:
                        with contextlib.suppress(KeyError):
                            metric.remove(adapter, version)

    def retain_adapters(self, names: Collection[str]) -> None:
        """Retire every request series of adapter names not in `names` (the ones served), but the base
        model's and the unresolved requests': with tenants' adapters coming and going, the series of
        removed names would otherwise pile up in /metrics for ever."""
        kept = {*names, BASE_MODEL_LABEL, UNRESOLVED_LABEL}
        for adapter in [a for a in self._versions if a not in kept]:
            self.retain_versions(adapter, ())

    def retain_served(self, served: Mapping[str, Collection[str]]) -> None:
        """Keep the series of the names and versions in `served` (name -> its versions), the base model's
        and the unresolved requests'; retire the rest. Called when a change retires versions, so that a
        rolled-back canary or a replaced stable version leaves /metrics once its last request was counted and
        scraped (its grace), not at the name's next request."""
        self.retain_adapters(served)
        for adapter in self._rolling - served.keys():
            self._set_rolling(adapter, False)
        for adapter, versions in served.items():
            self.retain_versions(adapter, versions)
            self._set_rolling(adapter, len(versions) > 1, versions)

    def tokens_per_second(self, *, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        return sum(n for _, n in self._recent_tokens) / THROUGHPUT_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent_tokens and self._recent_tokens[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent_tokens.popleft()

    def observe_step(self, *, num_seqs: int, num_adapters: int) -> None:
        self.batch_size.observe(num_seqs)
        self.adapters_per_batch.observe(num_adapters)

    def register(self, collectors: Iterable[Collector]) -> None:
        """Add series owned elsewhere (the adapter pool's) to this worker's registry."""
        for c in collectors:
            self.registry.register(c)

    def render(self) -> bytes:
        self.drop_expired()  # also without admin changes or requests: a scrape ends the grace of those due
        return generate_latest(self.registry)

    async def render_async(self) -> bytes:
        """`render` with the text written in the default executor: thousands of adapters' series take a
        while, during which the event loop keeps serving. The engine figures are read here, on the loop."""
        self.drop_expired()
        token = FROZEN.set(self._engine.read())
        try:
            return await asyncio.to_thread(generate_latest, self.registry)
        finally:
            FROZEN.reset(token)
