"""A counter series that appears with its first increment loses that increment to rate() and increase(): a
real Prometheus sees no sample at 0 before it. The worker-wide series (vLLM's, by the served model's name;
refusals by reason) and the stager's outcomes exist at 0 from the start, as vLLM's own do, so that the first
request after a quiet start counts. Scraped by a real Prometheus."""

from __future__ import annotations

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from lorafleet.worker.admission import QUEUE_FULL
from lorafleet.worker.disk_cache import DiskCache
from lorafleet.worker.metrics import REJECTED_REASONS, WorkerMetrics
from lorafleet.worker.stager_metrics import StagerMetrics
from tests.prometheus_server import PrometheusServer, prometheus_binary

pytestmark = pytest.mark.skipif(prometheus_binary() is None, reason="prometheus is not installed (make prometheus)")


def test_the_worker_wide_series_exist_at_zero_before_their_first_increment(tmp_path):
    worker = WorkerMetrics()
    worker.model_name = "tiny"
    text = worker.render().decode()
    for series in ('vllm:prompt_tokens_total{model_name="tiny"} 0.0',
                   'vllm:generation_tokens_total{model_name="tiny"} 0.0',
                   'vllm:e2e_request_latency_seconds_count{model_name="tiny"} 0.0'):
        assert series in text
    assert all(f'lorafleet_requests_rejected_total{{reason="{reason}"}} 0.0' in text for reason in REJECTED_REASONS)
    stager = generate_latest(StagerMetrics(DiskCache(tmp_path / "cache", 1 << 20)).registry).decode()
    assert all(f'lorafleet_stager_stage_requests_total{{outcome="{o}"}} 0.0' in stager for o in ("hit", "miss", "local"))


async def test_prometheus_counts_the_first_request_after_a_quiet_start(aiohttp_server, tmp_path):
    worker = WorkerMetrics()
    worker.model_name = "tiny"
    stager = StagerMetrics(DiskCache(tmp_path / "cache", 1 << 20))

    async def worker_metrics(request: web.Request) -> web.Response:
        return web.Response(body=worker.render(), content_type="text/plain")

    async def stager_metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(stager.registry), content_type="text/plain")

    app = web.Application()
    app.add_routes([web.get("/metrics", worker_metrics), web.get("/stager/metrics", stager_metrics)])
    target = f"127.0.0.1:{(await aiohttp_server(app)).port}"
    scrape = [{"job_name": "worker", "static_configs": [{"targets": [target]}]},
              {"job_name": "stager", "metrics_path": "/stager/metrics", "static_configs": [{"targets": [target]}]}]
    with PrometheusServer(tmp_path / "prometheus", scrape, scrape_interval="250ms") as prom:
        def samples(promql: str) -> list[float]:
            return [float(v) for r in prom.query(promql) for _, v in r.get("values", [])]

        await prom.wait_for(lambda: len(samples('vllm:prompt_tokens_total{model_name="tiny"}[10s]')) >= 2
                            and len(samples('lorafleet_stager_stage_requests_total{outcome="miss"}[10s]')) >= 2,
                            "two scrapes of the quiet worker and stager")
        worker.observe_prompt_tokens("sql", 7)
        worker.rejected.labels(QUEUE_FULL).inc()
        stager.requests.labels("miss").inc()
        await prom.wait_for(lambda: samples('vllm:prompt_tokens_total{model_name="tiny"}[10s]')[-1:] == [7.0]
                            and samples('lorafleet_stager_stage_requests_total{outcome="miss"}[10s]')[-1:] == [1.0],
                            "a scrape after the first request")
        for promql in ('increase(vllm:prompt_tokens_total{model_name="tiny"}[1m])',
                       f'increase(lorafleet_requests_rejected_total{{reason="{QUEUE_FULL}"}}[1m])',
                       'increase(lorafleet_stager_stage_requests_total{outcome="miss"}[1m])'):
            result = prom.query(promql)
            assert result and float(result[0]["value"][1]) > 0, (promql, result)


async def test_an_adapters_request_series_exist_from_its_resolution(aiohttp_server, tmp_path):
    """A request's per-adapter counters (its requests on success, prompt and generated tokens) exist at 0 once it
    resolved its adapter version, so a scrape during the request lets increase() count the request that ends it;
    a series made at the end of the request (what they were) counts none."""
    worker = WorkerMetrics()
    worker.acquire("sql", "v1", "completions")
    text = worker.render().decode()
    for series in ('lorafleet_requests_total{adapter="sql",endpoint="completions",status="200",version="v1"} 0.0',
                   'lorafleet_prompt_tokens_total{adapter="sql",version="v1"} 0.0',
                   'lorafleet_generation_tokens_total{adapter="sql",version="v1"} 0.0'):
        assert series in text

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=worker.render(), content_type="text/plain")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics)])
    scrape = [{"job_name": "worker", "static_configs": [{"targets": [f"127.0.0.1:{(await aiohttp_server(app)).port}"]}]}]
    with PrometheusServer(tmp_path / "prometheus", scrape, scrape_interval="250ms") as prom:
        def samples(promql: str) -> list[float]:
            return [float(v) for r in prom.query(promql) for _, v in r.get("values", [])]

        await prom.wait_for(lambda: len(samples('lorafleet_requests_total{adapter="sql"}[10s]')) >= 2,
                            "two scrapes during the request")
        for adapter in ("sql", "late"):  # late: resolved without acquire, its series made by its end
            worker.observe_prompt_tokens(adapter, 7, version="v1")
            worker.observe_tokens(adapter, 3, version="v1")
            worker.observe_request(adapter=adapter, version="v1", endpoint="completions", status=200)
        await prom.wait_for(lambda: len(samples('lorafleet_requests_total{adapter="late"}[10s]')) >= 2
                            and samples('lorafleet_requests_total{adapter="sql"}[10s]')[-1:] == [1.0],
                            "two scrapes after the requests")

        def increase(name: str, adapter: str) -> float:
            result = prom.query(f'sum(increase({name}{{adapter="{adapter}"}}[1m]))')
            return float(result[0]["value"][1]) if result else 0.0

        for name in ("lorafleet_requests_total", "lorafleet_prompt_tokens_total", "lorafleet_generation_tokens_total"):
            assert increase(name, "sql") > 0 and increase(name, "late") == 0, name
