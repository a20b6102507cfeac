"""worker/metrics.py: a registry per app, request/engine series and the vLLM-compatible names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from lorafleet.worker.metrics import EngineSnapshot, WorkerMetrics


def _samples(m: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_engine_snapshot_feeds_vllm_compatible_gauges():
    snap = EngineSnapshot(num_running=3, num_waiting=2, kv_usage=0.25, max_lora=8,
                          running_adapters=["b@1", "a@1"], waiting_adapters=["c@2"])
    s = _samples(WorkerMetrics(lambda: snap))
    assert s[("vllm:num_requests_running", ())] == 3
    assert s[("vllm:num_requests_waiting", ())] == 2
    assert s[("vllm:kv_cache_usage_perc", ())] == 0.25
    info = [k for k in s if k[0] == "vllm:lora_requests_info"]
    assert info == [("vllm:lora_requests_info", (("max_lora", "8"), ("running_lora_adapters", "a@1,b@1"),
                                                  ("waiting_lora_adapters", "c@2")))]
    assert s[("lorafleet_queue_depth", ())] == 2


def test_request_and_step_observations():
    m = WorkerMetrics()
    m.observe_request(adapter="sql", endpoint="completions", status=200)
    m.observe_request(adapter=None, endpoint="chat", status=429)
    m.ttft.labels("sql").observe(0.02)
    m.observe_step(num_seqs=6, num_adapters=3)
    m.observe_tokens("sql", 20, now=100.0)
    m.observe_tokens("sql", 10, now=105.0)
    assert m.tokens_per_second(now=106.0) == 3.0
    assert m.tokens_per_second(now=112.0) == 1.0  # the first batch left the window
    s = _samples(m)
    assert s[("lorafleet_requests_total", (("adapter", "sql"), ("endpoint", "completions"), ("status", "200")))] == 1
    assert s[("lorafleet_requests_total", (("adapter", "__base__"), ("endpoint", "chat"), ("status", "429")))] == 1
    assert s[("lorafleet_time_to_first_token_seconds_count", (("adapter", "sql"),))] == 1
    assert s[("lorafleet_adapters_per_batch_sum", ())] == 3
    assert s[("lorafleet_batch_size_bucket", (("le", "8.0"),))] == 1
    assert s[("lorafleet_generation_tokens_total", (("adapter", "sql"),))] == 30


def test_registries_are_per_instance():
    a, b = WorkerMetrics(), WorkerMetrics()
    a.observe_request(adapter="x", endpoint="completions", status=200)
    assert ("lorafleet_requests_total", (("adapter", "x"), ("endpoint", "completions"), ("status", "200"))) \
        not in _samples(b)


def test_adapter_pool_series_join_the_registry():
    from lorafleet.worker.adapter_metrics import AdapterMetrics

    m, pool = WorkerMetrics(), AdapterMetrics()
    m.register(pool.collectors())
    pool.hits.labels("gpu").inc(3)
    assert _samples(m)[("lorafleet_adapter_hits_total", (("tier", "gpu"),))] == 3
