"""worker/metrics.py: a registry per app, request/engine series and the vLLM-compatible names."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from lorafleet.worker.metrics import EngineSnapshot, WorkerMetrics


def _samples(m: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_engine_snapshot_feeds_vllm_compatible_gauges():
    snap = EngineSnapshot(num_running=3, num_waiting=2, kv_usage=0.25, max_lora=8, max_num_seqs=4,
                          running_adapters=["b@1", "a@1"], waiting_adapters=["c@2"])
    metrics = WorkerMetrics(lambda: snap)
    metrics.model_name = "llama"
    s = _samples(metrics)
    name = (("model_name", "llama"),)  # vLLM's label: its dashboards and HPA rules filter on it
    assert s[("vllm:num_requests_running", name)] == 3
    assert s[("vllm:num_requests_waiting", name)] == 2
    assert s[("vllm:kv_cache_usage_perc", name)] == s[("vllm:gpu_cache_usage_perc", name)] == 0.25
    info = [k for k in s if k[0] == "vllm:lora_requests_info"]
    assert info == [("vllm:lora_requests_info", (("max_lora", "8"), ("running_lora_adapters", "a@1,b@1"),
                                                  ("waiting_lora_adapters", "c@2")))]
    assert s[("lorafleet_queue_depth", ())] == 2
    assert s[("lorafleet_seat_usage_ratio", ())] == 0.75  # 3 of --max-num-seqs 4: the autoscaler's seats


def test_the_lora_info_lists_are_bounded_and_the_series_can_be_left_out():
    """The waiting list named every adapter queued (up to --max-queued-requests names, kilobytes in one label
    value); each list now names its first max_lora, sorted. --no-lora-info-metric leaves the series out: each new
    set of names is a new series, about one a scrape on a busy worker of many adapters."""
    waiting = [f"w{i:03d}@1" for i in range(300)]
    snap = EngineSnapshot(max_lora=4, running_adapters=["r9@1", "r1@1", "r5@1", "r3@1", "r7@1"],
                          waiting_adapters=waiting[::-1])
    (info,) = [dict(k[1]) for k in _samples(WorkerMetrics(lambda: snap)) if k[0] == "vllm:lora_requests_info"]
    assert info["running_lora_adapters"] == "r1@1,r3@1,r5@1,r7@1"
    assert info["waiting_lora_adapters"] == ",".join(waiting[:4])
    assert not [k for k in _samples(WorkerMetrics(lambda: snap, lora_info=False)) if k[0].startswith("vllm:lora")]


def test_preemptions_are_counters_under_both_names():
    s = _samples(WorkerMetrics(lambda: EngineSnapshot(num_preemptions=7)))
    assert s[("vllm:num_preemptions_total", (("model_name", ""),))] == s[("lorafleet_preemptions_total", ())] == 7


async def test_metrics_count_the_preemptions_of_a_run(aiohttp_client, tiny_llama_dir):
    """Three requests of 8 + 20 tokens (7 pages each) on a pool of 12 pages preempt one another: /metrics
    reports as many preemptions as the scheduler made."""
    from lorafleet.worker import EngineConfig, SamplingParams
    from lorafleet.worker.app_keys import ENGINE
    from lorafleet.worker.server import create_app
    from lorafleet.worker.worker_config import WorkerConfig

    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_pages=12)
    client = await aiohttp_client(create_app(WorkerConfig(engine=config, served_model_name="tiny")))
    engine = client.app[ENGINE]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = await asyncio.wrap_future(engine.call(lambda e: e.generate([[i] * 8 for i in (1, 2, 3)], params)))
    assert [o.finish_reason for o in outs] == ["length"] * 3 and engine.engine.num_preemptions > 0
    text = await (await client.get("/metrics")).text()
    s = {m.name: m.value for fam in text_string_to_metric_families(text) for m in fam.samples
         if not m.labels or m.labels == {"model_name": "tiny"}}
    assert s["vllm:num_preemptions_total"] == s["lorafleet_preemptions_total"] == engine.engine.num_preemptions


async def test_the_worker_observes_distinct_adapters_per_step_not_sequences(aiohttp_client, tiny_llama_dir,
                                                                           qv_adapters_dir):
    """The checklist's adapters-per-batch distribution as /metrics shows it: one request for 4 choices on
    alpha runs steps of 4 sequences and 1 adapter (a worker that observed sequences would show 4)."""
    from lorafleet.worker import EngineConfig
    from lorafleet.worker.server import create_app
    from lorafleet.worker.worker_config import WorkerConfig

    config = EngineConfig(model=str(tiny_llama_dir), adapters=str(qv_adapters_dir), dtype="float32")
    client = await aiohttp_client(create_app(WorkerConfig(engine=config, served_model_name="tiny")))
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "hello", "max_tokens": 4, "n": 4,
                                                      "temperature": 0, "ignore_eos": True})
    assert resp.status == 200, await resp.text()
    text = await (await client.get("/metrics")).text()
    s = {m.name: m.value for fam in text_string_to_metric_families(text) for m in fam.samples if not m.labels}
    steps = s["lorafleet_adapters_per_batch_count"]
    assert steps > 0 and s["lorafleet_adapters_per_batch_sum"] == steps and s["lorafleet_batch_size_sum"] == 4 * steps


def test_request_and_step_observations():
    m = WorkerMetrics()
    m.observe_request(adapter="sql", version="v1", endpoint="completions", status=200)
    m.observe_request(adapter=None, endpoint="chat", status=429)
    m.observe_first_token("sql", 0.02, version="v1")
    m.observe_step(num_seqs=6, num_adapters=3)
    m.observe_tokens("sql", 20, version="v1", now=100.0)
    m.observe_tokens("sql", 10, version="v1", now=105.0)
    assert m.tokens_per_second(now=106.0) == 3.0
    assert m.tokens_per_second(now=112.0) == 1.0  # the first batch left the window
    s = _samples(m)
    assert s[("lorafleet_requests_total", (("adapter", "sql"), ("endpoint", "completions"), ("status", "200"),
                                           ("version", "v1")))] == 1
    assert s[("lorafleet_requests_total", (("adapter", "__base__"), ("endpoint", "chat"), ("status", "429"),
                                           ("version", "")))] == 1
    # sql rolls out no version: its latencies are counted with every such name's
    assert s[("lorafleet_time_to_first_token_seconds_count", (("adapter", "__other__"), ("version", "")))] == 1
    assert s[("lorafleet_adapters_per_batch_sum", ())] == 3
    assert s[("lorafleet_batch_size_bucket", (("le", "8.0"),))] == 1
    assert s[("lorafleet_generation_tokens_total", (("adapter", "sql"), ("version", "v1")))] == 30


def _observe_one(m: WorkerMetrics, adapter: str, version: str, status: int = 200) -> None:
    m.observe_prompt_tokens(adapter, 5, version=version)
    m.observe_first_token(adapter, 0.1, version=version)
    m.observe_token_gaps(adapter, 0.01, 2, version=version)
    m.observe_tokens(adapter, 3, version=version)
    m.observe_e2e(adapter, 0.2, version=version)
    m.observe_request(adapter=adapter, version=version, endpoint="completions", status=status)


def _versions(m: WorkerMetrics, adapter: str) -> dict[str, set[str]]:
    """metric family -> versions of `adapter` it has series of"""
    out: dict[str, set[str]] = {}
    for name, labels in _samples(m):
        labels = dict(labels)
        if labels.get("adapter") == adapter:
            out.setdefault(name, set()).add(labels["version"])
    return out


def test_canary_and_stable_versions_are_separate_series():
    """During a rollout the operator compares the canary's latency and errors with the stable version's:
    each version a request resolved to has its own series of every request metric."""
    m = WorkerMetrics()
    m.retain_served({"sql": {"v1", "v2"}})  # the rollout: latencies per version for this name
    _observe_one(m, "sql", "v1")
    _observe_one(m, "sql", "v2", status=503)
    s = _samples(m)
    for version, status in (("v1", "200"), ("v2", "503")):
        assert s[("lorafleet_requests_total", (("adapter", "sql"), ("endpoint", "completions"), ("status", status),
                                               ("version", version)))] == 1
    assert set(_versions(m, "sql")) >= {
        "lorafleet_requests_total", "lorafleet_time_to_first_token_seconds_count",
        "lorafleet_inter_token_latency_seconds_count", "lorafleet_e2e_request_latency_seconds_count",
        "lorafleet_prompt_tokens_total", "lorafleet_generation_tokens_total"}
    assert all(versions == {"v1", "v2"} for versions in _versions(m, "sql").values())


def test_series_of_versions_no_longer_served_are_dropped():
    """Every rollout brings a new version: the series of the ones it retired must go, or a long-lived
    worker exposes (and Prometheus stores) one more set per rollout, for ever."""
    m = WorkerMetrics(latency_series="all", retired_grace_s=0)  # no grace (see below): retired series go at once
    for version in ("v1", "v2", "v3"):
        _observe_one(m, "sql", version)
    _observe_one(m, "chat", "c1")
    _observe_one(m, None, "")  # the base model
    m.retain_versions("sql", {"v2", "v3"})
    assert all(versions == {"v2", "v3"} for versions in _versions(m, "sql").values()), _versions(m, "sql")
    assert all(versions == {"c1"} for versions in _versions(m, "chat").values())
    assert _versions(m, "__base__")["lorafleet_requests_total"] == {""}
    _observe_one(m, "sql", "v1")  # a request that resolved v1 before it retired, finishing late: counted anew
    m.retain_versions("sql", {"v3"})
    assert all(versions == {"v3"} for versions in _versions(m, "sql").values()), _versions(m, "sql")


def test_series_of_names_no_longer_served_are_dropped():
    """Tenants' adapters come and go: every series of a name no longer served goes, the base model's and
    the unresolved requests' stay."""
    m = WorkerMetrics(latency_series="all", retired_grace_s=0)
    for adapter, version in (("sql", "v1"), ("sql", "v2"), ("chat", "c1"), ("gone", "g1"), (None, ""),
                             ("__unresolved__", "")):
        _observe_one(m, adapter, version)
    m.retain_adapters(["sql", "chat"])
    assert {adapter for _, labels in _samples(m) for key, adapter in labels if key == "adapter"} == {
        "sql", "chat", "__base__", "__unresolved__"}
    m.retain_adapters([])
    assert {adapter for _, labels in _samples(m) for key, adapter in labels if key == "adapter"} == {
        "__base__", "__unresolved__"}
    assert set(m._versions) == {"__base__", "__unresolved__"}  # nothing kept per removed name either
    _observe_one(m, "sql", "v3")  # the name served again: counted anew
    assert _versions(m, "sql")["lorafleet_requests_total"] == {"v3"}


def test_retain_served_drops_retired_names_and_versions_at_once():
    """One call after an admin change: names gone and versions retired of the names kept."""
    m = WorkerMetrics(latency_series="all", retired_grace_s=0)
    for adapter, version in (("sql", "v1"), ("sql", "v2"), ("chat", "c1"), ("gone", "g1"), (None, "")):
        _observe_one(m, adapter, version)
    m.retain_served({"sql": {"v2"}, "chat": {"c1", "c2"}, "new": {"n1"}})
    assert all(versions == {"v2"} for versions in _versions(m, "sql").values())
    chat = _versions(m, "chat")
    assert chat.pop("lorafleet_requests_total") == {"c1", "c2"}  # c2's 5xx at 0: chat rolls it out
    assert all(versions == {"c1"} for versions in chat.values())
    assert _versions(m, "gone") == {} and _versions(m, "__base__")["lorafleet_requests_total"] == {""}
    assert set(m._versions) == {"sql", "chat", "__base__"}


def test_latencies_have_series_of_their_own_only_while_a_name_rolls_out_a_version():
    """Thousands of adapters with a histogram set each (about 45 series a version) made a scrape megabytes
    long: latencies are labelled by adapter and version only while the name serves two versions (a canary,
    a new version loading beside the old), and those series leave after the grace once the rollout ends."""
    clock = _Clock()
    m = WorkerMetrics(retired_grace_s=60, clock=clock)
    m.retain_served({"sql": {"v1"}, "chat": {"c1"}})
    for adapter, version in (("sql", "v1"), ("chat", "c1"), (None, "")):
        _observe_one(m, adapter, version)
    ttft = "lorafleet_time_to_first_token_seconds_count"
    assert {k[1] for k in _samples(m) if k[0] == ttft} == {(("adapter", "__other__"), ("version", "")),
                                                          (("adapter", "__base__"), ("version", ""))}
    assert _samples(m)[(ttft, (("adapter", "__other__"), ("version", "")))] == 2
    assert _versions(m, "sql")["lorafleet_requests_total"] == {"v1"}  # counters stay per adapter and version
    m.retain_served({"sql": {"v1", "v2"}, "chat": {"c1"}})  # sql's canary
    _observe_one(m, "sql", "v1")
    _observe_one(m, "sql", "v2")
    assert _versions(m, "sql")[ttft] == {"v1", "v2"}
    m.retain_served({"sql": {"v2"}, "chat": {"c1"}})  # promoted: the rollout is over
    _observe_one(m, "sql", "v2")
    assert _samples(m)[(ttft, (("adapter", "__other__"), ("version", "")))] == 3
    clock.now = 59.0
    assert _versions(m, "sql")[ttft] == {"v1", "v2"}  # a scrape still reads the rollout's last latencies
    clock.now = 60.0
    assert ttft not in _versions(m, "sql") and _versions(m, "sql")["lorafleet_requests_total"] == {"v2"}
    every = WorkerMetrics()
    every.latency_series = "all"
    _observe_one(every, "chat", "c1")
    assert _versions(every, "chat")[ttft] == {"c1"}


def test_a_scrape_is_written_off_the_event_loop_from_figures_read_on_it():
    """Writing thousands of series takes a while: the text is written in another thread, while the engine's
    figures (read from structures the loop changes) are read on the loop."""
    import threading

    from prometheus_client.core import GaugeMetricFamily

    threads = {}

    def snapshot() -> EngineSnapshot:
        threads["snapshot"] = threading.current_thread()
        return EngineSnapshot(num_waiting=4)

    class Probe:
        def collect(self):
            threads["collect"] = threading.current_thread()
            yield GaugeMetricFamily("probe", "where the scrape is written", 1)

    m = WorkerMetrics(snapshot)
    m.registry.register(Probe())
    text = asyncio.run(m.render_async()).decode()
    assert "lorafleet_queue_depth 4.0" in text and "_created" not in text
    assert threads["snapshot"] is threading.main_thread() and threads["collect"] is not threading.main_thread()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_retired_version_keeps_its_series_while_held_and_for_its_grace():
    """A canary rolled back while requests run on it: its series stay until the last of them was counted
    and, after that, for the grace a scrape needs to read the final counts; then they go."""
    clock = _Clock()
    m = WorkerMetrics(latency_series="all", retired_grace_s=60, clock=clock)
    _observe_one(m, "sql", "v1")
    for _ in range(2):  # two requests resolved to the canary
        m.acquire("sql", "v2")
        m.observe_prompt_tokens("sql", 5, version="v2")
    m.retain_versions("sql", {"v1"})  # the rollback
    clock.now = 1000.0
    m.observe_request(adapter="sql", version="v2", endpoint="completions", status=500)
    m.release("sql", "v2")
    assert "v2" in _versions(m, "sql")["lorafleet_requests_total"]  # the other request still runs
    _observe_one(m, "sql", "v2", status=500)
    m.release("sql", "v2")
    clock.now = 1059.0
    s = _samples(m)
    assert s[("lorafleet_requests_total", (("adapter", "sql"), ("endpoint", "completions"), ("status", "500"),
                                           ("version", "v2")))] == 2
    clock.now = 1060.0
    assert all(versions == {"v1"} for versions in _versions(m, "sql").values()), _versions(m, "sql")
    assert set(m._versions["sql"]) == {"v1"}


def test_a_rolled_back_canary_keeps_its_latencies_to_the_last_request_by_default():
    """Latency histograms per version only while a name rolls out (the default): a canary rolled back while
    requests ran on it put their last latencies under __other__ and dropped its own after the grace, while
    they still ran, so its final latencies were never read. A request begun during the rollout keeps its
    version's labels to its end; the series stay until a scrape read them; a request after it counts under
    __other__."""
    clock = _Clock()
    m = WorkerMetrics(retired_grace_s=60, clock=clock)
    m.retain_served({"sql": {"v1", "v2"}})  # the canary
    rolling = m.acquire("sql", "v2")
    m.observe_first_token("sql", 0.1, version="v2", per_version=rolling)
    m.retain_served({"sql": {"v1"}})  # rolled back while the request runs
    clock.now = 1000.0  # long past the grace: the request still runs
    m.observe_e2e("sql", 5.0, version="v2", per_version=rolling)
    m.observe_request(adapter="sql", version="v2", endpoint="completions", status=200)
    _observe_one(m, "sql", "v1")  # a request after the rollout: under __other__
    m.release("sql", "v2", rolling)
    e2e = "lorafleet_e2e_request_latency_seconds_count"
    assert rolling and _samples(m)[(e2e, (("adapter", "sql"), ("version", "v2")))] == 1
    assert _samples(m)[(e2e, (("adapter", "__other__"), ("version", "")))] == 1
    clock.now = 1059.0
    assert _versions(m, "sql")[e2e] == {"v2"}
    clock.now = 1060.0
    assert e2e not in _versions(m, "sql") and _versions(m, "sql")["lorafleet_requests_total"] == {"v1"}


def test_a_request_keeps_the_labels_it_began_with():
    """A canary promoted while a request on it runs; a request begun after the promotion put its first token
    under the version's labels (the older request still held them) and its end under __other__."""
    m = WorkerMetrics(retired_grace_s=0)
    m.retain_served({"sql": {"v1", "v2"}})
    old = m.acquire("sql", "v2")
    m.retain_served({"sql": {"v2"}})  # promoted
    new = m.acquire("sql", "v2")
    assert old and not new
    m.observe_first_token("sql", 0.1, version="v2", per_version=new)
    m.observe_e2e("sql", 0.2, version="v2", per_version=old)
    m.release("sql", "v2", old)
    m.observe_e2e("sql", 0.3, version="v2", per_version=new)
    m.release("sql", "v2", new)
    s = _samples(m)
    other = (("adapter", "__other__"), ("version", ""))
    assert s[("lorafleet_time_to_first_token_seconds_count", other)] == 1
    assert s[("lorafleet_e2e_request_latency_seconds_count", other)] == 1


def test_a_stable_swap_s_latencies_go_back_under_other_once_the_fallback_is_done():
    """A new stable version loading beside the old one labels the name's latencies per version; once a
    request ran on the new one (the fallback retired), the swap is over. The name stayed labelled per version
    until the next push, which may be days away."""
    m = WorkerMetrics(retired_grace_s=0)
    m.retain_served({"sql": {"v1", "v2"}})  # v2 loading, v1 the fallback
    _observe_one(m, "sql", "v2")
    m.retain_versions("sql", {"v2"})  # a request ran on v2: the fallback is gone (as the server tells it)
    m.retain_versions("sql", {"v1", "v2"})  # a request that ran on the fallback ends: no rollout again
    _observe_one(m, "sql", "v2")
    ttft = "lorafleet_time_to_first_token_seconds_count"
    assert _samples(m)[(ttft, (("adapter", "__other__"), ("version", "")))] == 1 and ttft not in _versions(m, "sql")


def test_a_retired_version_no_request_holds_goes_after_its_grace():
    clock = _Clock()
    m = WorkerMetrics(latency_series="all", retired_grace_s=60, clock=clock)
    _observe_one(m, "sql", "v1")
    _observe_one(m, "gone", "g1")
    m.retain_served({"sql": set()})  # every version of sql and the name gone retired at t=0
    clock.now = 59.0
    assert _versions(m, "sql") and _versions(m, "gone")  # a scrape still reads their last counts
    clock.now = 60.0
    assert _versions(m, "sql") == _versions(m, "gone") == {} and not ({"sql", "gone"} & set(m._versions))


def test_a_version_served_again_keeps_its_series():
    clock = _Clock()
    m = WorkerMetrics(latency_series="all", retired_grace_s=60, clock=clock)
    _observe_one(m, "sql", "v2")
    m.retain_versions("sql", ())
    clock.now = 30.0
    m.retain_versions("sql", {"v2"})  # registered again before its grace was over
    clock.now = 1000.0
    assert _versions(m, "sql")["lorafleet_requests_total"] == {"v2"}


def test_registries_are_per_instance():
    a, b = WorkerMetrics(), WorkerMetrics()
    a.observe_request(adapter="x", version="1", endpoint="completions", status=200)
    assert ("lorafleet_requests_total", (("adapter", "x"), ("endpoint", "completions"), ("status", "200"),
                                         ("version", "1"))) not in _samples(b)


def test_adapter_pool_series_join_the_registry():
    from lorafleet.worker.adapter_metrics import AdapterMetrics

    m, pool = WorkerMetrics(), AdapterMetrics()
    m.register(pool.collectors())
    pool.hits.labels("gpu").inc(3)
    assert _samples(m)[("lorafleet_adapter_hits_total", (("tier", "gpu"),))] == 3


def _adapter_pool(num_pages: int = 64):
    from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
    from lorafleet.worker.page_pool import PagePool, PagePoolConfig
    from tests.lora_factory import TINY_DIMS

    pages = PagePool(PagePoolConfig(num_pages=num_pages, page_elems=1000))
    return AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(max_slots=4, max_rank=32, num_load_threads=1))


def test_page_gauges_follow_kv_pages_between_adapter_changes():
    # KV pages move every engine step; the gauges must not wait for the adapter pool to change.
    from tests.lora_factory import random_weights

    pool = _adapter_pool(num_pages=64)
    try:
        m = WorkerMetrics()
        m.register(pool.metrics.collectors())
        pool.add("a@1", random_weights(1))
        pool.load("a@1")
        adapter_pages = pool.page_pool.num_used("adapter")
        kv = pool.page_pool.allocate(5, ("kv", 1))  # a request's KV blocks, no adapter-pool call after
        s = _samples(m)
        assert s[("lorafleet_page_pool_kv_pages", ())] == 5
        assert s[("lorafleet_page_pool_adapter_pages", ())] == adapter_pages > 0
        assert s[("lorafleet_page_pool_pages", ())] == 64
        pool.page_pool.free(kv)
        assert _samples(m)[("lorafleet_page_pool_kv_pages", ())] == 0
    finally:
        pool.close()


def test_cold_load_then_hot_hit_moves_the_tier_counters():
    from tests.lora_factory import random_weights

    pool = _adapter_pool()
    try:
        m = WorkerMetrics()
        m.register(pool.metrics.collectors())
        pool.add("a@1", random_weights(1))
        assert pool.acquire("a@1", waiter=1) is None  # cold: not on the GPU yet
        pool.wait_idle()
        pool.release(pool.acquire("a@1", waiter=1))  # the same request, now placed: not a second lookup
        pool.release(pool.acquire("a@1"))  # a later request: hot
        s = _samples(m)
        assert s[("lorafleet_adapter_misses_total", (("tier", "gpu"),))] == 1
        assert s[("lorafleet_adapter_hits_total", (("tier", "gpu"),))] == 1  # one lookup per request
        assert s[("lorafleet_adapter_hits_total", (("tier", "cpu"),))] == 1  # registered weights were on CPU
        assert s[("lorafleet_adapter_load_seconds_count", (("tier", "gpu"),))] == 1
        assert s[("lorafleet_adapters_resident", (("tier", "gpu"),))] == 1
    finally:
        pool.close()


def test_registering_an_adapter_is_a_cold_load():
    """The disk -> CPU load of a registration (read by the caller, packed by the pool) is in the
    cold-load histogram and is what the cost policy counts to bring the adapter back."""
    from tests.lora_factory import random_weights

    pool = _adapter_pool()
    try:
        m = WorkerMetrics()
        m.register(pool.metrics.collectors())
        pool.add("a@1", random_weights(1), read_seconds=0.25)
        s = _samples(m)
        assert s[("lorafleet_adapter_load_seconds_count", (("tier", "cpu"),))] == 1
        assert s[("lorafleet_adapter_load_seconds_sum", (("tier", "cpu"),))] >= 0.25
        assert pool._entries["a@1"].load_seconds >= 0.25
    finally:
        pool.close()


def test_reading_an_adapter_from_disk_again_is_a_cold_load():
    """The checklist's cold-load distribution: an adapter whose loader reads it from disk (at its first
    request, or again once its CPU copy was evicted) is observed at tier cpu, and the cost policy counts it."""
    from tests.lora_factory import random_weights

    pool = _adapter_pool()
    try:
        m = WorkerMetrics()
        m.register(pool.metrics.collectors())
        pool.add("a@1", loader=lambda: random_weights(1))
        assert pool.acquire("a@1", waiter=1) is None
        pool.wait_idle()
        assert pool.acquire("a@1", waiter=1) is not None
        assert _samples(m)[("lorafleet_adapter_load_seconds_count", (("tier", "cpu"),))] == 1
        assert pool.entry("a@1").load_seconds > 0
    finally:
        pool.close()


def test_only_series_that_can_move_are_exposed():
    from lorafleet.worker.adapter_metrics import AdapterMetrics

    m = WorkerMetrics()
    m.register(AdapterMetrics().collectors())
    s = _samples(m)
    tiers = {name: {dict(labels)["tier"] for n, labels in s if n == name}
             for name in ("lorafleet_adapter_hits_total", "lorafleet_adapter_misses_total",
                          "lorafleet_adapter_bytes", "lorafleet_adapters_resident",
                          "lorafleet_adapter_load_failures_total")}
    assert tiers == {"lorafleet_adapter_hits_total": {"gpu", "cpu", "disk"},
                     "lorafleet_adapter_misses_total": {"gpu", "cpu"},
                     "lorafleet_adapter_bytes": {"gpu", "cpu"},
                     "lorafleet_adapters_resident": {"gpu", "cpu"},
                     "lorafleet_adapter_load_failures_total": {"gpu", "disk"}}


def test_adapters_per_batch_tells_base_only_steps_from_one_adapter():
    m = WorkerMetrics()
    m.observe_step(num_seqs=4, num_adapters=0)
    m.observe_step(num_seqs=4, num_adapters=1)
    s = _samples(m)
    assert s[("lorafleet_adapters_per_batch_bucket", (("le", "0.0"),))] == 1
    assert s[("lorafleet_adapters_per_batch_bucket", (("le", "1.0"),))] == 2


def test_a_capacity_eviction_is_counted_and_the_resident_bytes_follow():
    # Thrashing shows as evictions by capacity beside misses: both must move with what the pool does.
    from tests.lora_factory import random_weights

    pool = _adapter_pool()  # 4 GPU slots, and fewer adapters' pages
    try:
        m = WorkerMetrics()
        m.register(pool.metrics.collectors())
        for i in range(5):
            pool.add(f"a{i}@1", random_weights(i))
            pool.load(f"a{i}@1")
        s = _samples(m)
        resident = [e for e in pool._entries.values() if e.resident]
        assert 0 < len(resident) < 5 and s[("lorafleet_adapters_resident", (("tier", "gpu"),))] == len(resident)
        assert s[("lorafleet_adapter_evictions_total", (("reason", "capacity"), ("tier", "gpu")))] == 5 - len(resident)
        assert s[("lorafleet_adapter_bytes", (("tier", "gpu"),))] == sum(e.gpu_bytes for e in resident) > 0
    finally:
        pool.close()


def test_a_quota_eviction_at_a_release_moves_the_residency_gauges():
    from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig, TenantQuota
    from lorafleet.worker.page_pool import PagePool, PagePoolConfig
    from tests.lora_factory import TINY_DIMS, random_weights

    pool = AdapterPool(PagePool(PagePoolConfig(num_pages=256, page_elems=1000)), TINY_DIMS, AdapterPoolConfig(
        max_slots=4, max_rank=32, num_load_threads=1, tenant_quotas={"B": TenantQuota(max_adapters=1)}))
    try:
        m = WorkerMetrics()
        m.register(pool.metrics.collectors())
        pool.add("x@1", random_weights(1), tenant="A")
        pool.add("y@1", random_weights(2), tenant="B")
        pool.load("x@1")
        pool.load("y@1")
        slot = pool.acquire("x@1", waiter="r")
        pool.set_tenant("x@1", "B")  # a push gives x to B, over B's quota while r runs
        pool.release(slot)  # r ends: x leaves the GPU for the quota, with nothing else changing after
        s, stats = _samples(m), pool.stats()
        assert s[("lorafleet_adapters_resident", (("tier", "gpu"),))] == stats["resident"]["gpu"] == 1
        assert s[("lorafleet_adapter_bytes", (("tier", "gpu"),))] == stats["bytes"]["gpu"]
    finally:
        pool.close()


def test_the_engine_counts_distinct_adapters_per_step_not_sequences(tiny_llama_dir):
    from lorafleet.worker import Engine, EngineConfig, SamplingParams
    from tests.lora_factory import random_weights

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64))
    for name in ("a", "b"):
        engine.adapter_pool.add(f"{name}@1", random_weights(1, rank=4, projs=("q_proj", "v_proj")))
        engine.adapter_pool.load(f"{name}@1")
    params = SamplingParams(max_tokens=2, temperature=0)
    for i, adapter in enumerate(["a", "a", "b", None]):
        engine.add_request(f"r{i}", [1, 2, 3], params, adapter=adapter)
    engine.step()
    assert (engine.last_batch_size, engine.last_batch_adapters) == (4, 2)  # the base model is no adapter
    while engine.has_unfinished():
        engine.step()
    engine.add_request("base", [1, 2, 3], params)
    engine.step()
    assert (engine.last_batch_size, engine.last_batch_adapters) == (1, 0)


def test_dashboard_queries_name_exposed_series(tmp_path):
    import json
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    from lorafleet.worker.adapter_metrics import AdapterMetrics
    from lorafleet.worker.disk_cache import DiskCache
    from lorafleet.worker.stager_metrics import StagerMetrics

    m = WorkerMetrics()
    m.register(AdapterMetrics().collectors())
    stager = StagerMetrics(DiskCache(tmp_path, 1 << 20))  # the stager sidecar's own /metrics
    text = m.render().decode() + generate_latest(stager.registry).decode()
    exposed = {fam.name for fam in text_string_to_metric_families(text)}
    exposed |= {f"{n}_total" for n in exposed} | {f"{n}_{s}" for n in exposed for s in ("bucket", "count", "sum")}
    dashboard = Path(__file__).parents[2] / "charts/lorafleet/files/grafana-dashboard.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p.get("targets", [])]
    names = {n for e in exprs for n in re.findall(r"\b(?:lorafleet_|vllm:)[a-z_:]+", e)}
    assert names and names <= exposed, names - exposed


def test_a_resolved_request_makes_its_success_series_at_0():
    """Counters a request moves on success exist at 0 from its resolution (rate() misses a series' first
    increment); they go with the version."""
    clock = _Clock()
    m = WorkerMetrics(retired_grace_s=60, clock=clock)
    m.retain_served({"sql": {"v1"}})
    assert m.acquire("sql", "v1", "chat") is False and m.acquire(None, "", "completions") is False
    requests = {(dict(k[1])["adapter"], dict(k[1])["version"], dict(k[1])["endpoint"], dict(k[1])["status"]): v
                for k, v in _samples(m).items() if k[0] == "lorafleet_requests_total"}
    assert requests == {("sql", "v1", "chat", "200"): 0, ("__base__", "", "completions", "200"): 0}
    assert _samples(m)[("lorafleet_generation_tokens_total", (("adapter", "sql"), ("version", "v1")))] == 0
    assert _samples(m)[("lorafleet_prompt_tokens_total", (("adapter", "sql"), ("version", "v1")))] == 0
    m.release("sql", "v1")
    m.retain_served({"sql": {"v2"}})
    clock.now = 60.0
    m.drop_expired()
    assert "v1" not in _versions(m, "sql").get("lorafleet_requests_total", set())


def test_a_rollout_makes_its_versions_5xx_series_at_0_and_takes_those_never_counted_with_it():
    """A name that begins to roll out a version has its versions' 5xx series at 0 from then on, so that the
    canary's first failure (on its first request too) counts in its error share; once the rollout is over and
    its grace passed, those still at 0 go, those counted stay with their version."""
    clock = _Clock()
    m = WorkerMetrics(retired_grace_s=60, clock=clock)
    m.retain_served({"sql": {"v1"}})
    assert _versions(m, "sql") == {}  # nothing yet: no request, no rollout

    def statuses() -> dict[tuple[str, str, str], float]:
        return {(dict(k[1])["version"], dict(k[1])["endpoint"], dict(k[1])["status"]): v
                for k, v in _samples(m).items() if k[0] == "lorafleet_requests_total" and dict(k[1])["adapter"] == "sql"}

    m.retain_served({"sql": {"v1", "v2"}})  # a canary
    made = {(v, e, s): 0 for v in ("v1", "v2") for e in ("completions", "chat") for s in ("500", "503", "504")}
    assert statuses() == made
    m.observe_request(adapter="sql", version="v2", endpoint="chat", status=503)  # its first request fails
    m.retain_served({"sql": {"v2"}})  # promoted
    clock.now = 60.0
    m.drop_expired()
    assert statuses() == {("v2", "chat", "503"): 1}
    m.retain_served({"sql": {"v2", "v3"}})  # another rollout: its zeros again
    assert len(statuses()) == 12 and statuses()[("v2", "chat", "503")] == 1
    m.retain_served({"sql": {"v3"}})
    clock.now = 120.0
    m.drop_expired()
    assert statuses() == {}  # v2 retired with its series, v3's zeros gone with the rollout
