"""The engine's series of a worker's /metrics, read at scrape time from an `EngineSnapshot`: vLLM's names (queue,
KV usage, preemptions, prefix cache, running and waiting adapters) and lorafleet's own (metrics.py)."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

THROUGHPUT_WINDOW_S = 10.0


@dataclass(slots=True)
class EngineSnapshot:
    """What the engine reports at scrape time."""

    num_running: int = 0
    num_waiting: int = 0  # requests admitted by the server but not yet scheduled
    kv_usage: float = 0.0  # fraction of the page pool's KV capacity in use, 0..1
    max_lora: int = 0  # adapters the GPU pool can hold at once (slots)
    max_num_seqs: int = 0  # sequences a step may run at once (0: not known)
    num_preemptions: int = 0  # running requests preempted for KV pages since the start (recomputed later)
    grammar_deferrals: int = 0  # guided decodes left out of a step for its grammar budget (grammar_pacing.py)
    prefix_cache: tuple[int, int] = (0, 0)  # prompt tokens looked up in the prefix cache, and found there
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)


def prefix_tokens(cache) -> tuple[int, int]:
    """(tokens looked up, tokens found) of a PrefixCache (worker/prefix_cache.py), or of none."""
    return (0, 0) if cache is None else (cache.queried_tokens, cache.hit_tokens)


# The engine figures of a scrape rendered off the loop, read on it first (the thread gets a copy of the context).
FROZEN: contextvars.ContextVar[tuple[EngineSnapshot, float] | None] = contextvars.ContextVar("frozen", default=None)


class EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot], throughput: Callable[[], float],
                 model_name: Callable[[], str] = str, lora_info: bool = True) -> None:
        self._snapshot, self._throughput, self._model_name, self._lora_info = snapshot, throughput, model_name, lora_info

    def read(self) -> tuple[EngineSnapshot, float]:
        return self._snapshot(), self._throughput()

    def collect(self) -> Iterator[Metric]:
        s, throughput = FROZEN.get() or self.read()
        name = [self._model_name()]  # vLLM's label on each of its series: dashboards and HPA rules filter on it
        for family, text, value in (
                (GaugeMetricFamily, ("vllm:num_requests_running", "Requests in the running batch."), s.num_running),
                (GaugeMetricFamily, ("vllm:num_requests_waiting", "Requests waiting to be scheduled."), s.num_waiting),
                (GaugeMetricFamily, ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent."), s.kv_usage),
                # the name older routers (Gateway API inference extension releases) read
                (GaugeMetricFamily, ("vllm:gpu_cache_usage_perc", "KV-cache usage; 1 means 100 percent."), s.kv_usage),
                (CounterMetricFamily, ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
                 s.num_preemptions),
                (CounterMetricFamily, ("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked "
                                       "up."), s.prefix_cache[0]),
                (CounterMetricFamily, ("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found computed."),
                 s.prefix_cache[1])):
            metric = family(*text, labels=["model_name"])
            metric.add_metric(name, value)
            yield metric
        if self._lora_info:  # a series per set of names (vLLM's): each list's first max_lora names, sorted
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            named = [",".join(sorted(a)[:max(s.max_lora, 1)]) for a in (s.running_adapters, s.waiting_adapters)]
            info.add_metric([str(s.max_lora), *named], time.time())
            yield info
        yield GaugeMetricFamily("lorafleet_queue_depth", "Requests waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily("lorafleet_kv_cache_usage_ratio", "Fraction of KV capacity in use.", s.kv_usage)
        yield GaugeMetricFamily("lorafleet_seat_usage_ratio", "Running sequences over --max-num-seqs (a worker full "
                                "at 1 queues requests with KV to spare).", s.num_running / max(s.max_num_seqs, 1))
        yield CounterMetricFamily("lorafleet_preemptions", "Running requests preempted for KV pages.",
                                  s.num_preemptions)
        yield CounterMetricFamily("lorafleet_guided_decodes_deferred", "Guided decodes left out of a step to hold "
                                  "its grammar time to --max-grammar-seconds-per-step.", s.grammar_deferrals)
        yield GaugeMetricFamily("lorafleet_generation_tokens_per_second",
                                f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s.",
                                throughput)
