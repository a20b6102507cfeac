"""The autoscaler's Prometheus client: against a real Prometheus scraping fake worker pods (hit rate, KV
usage, requests waiting, only the pool's pods), and against stub servers for every way a query can fail."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from lorafleet.operator.prometheus import (
    MetricsError,
    PrometheusClient,
    hit_rate_query,
    kv_usage_query,
    pod_selector,
    seats_query,
    waiting_query,
)
from tests.s3_server import free_port

from .fake_metrics import FakePod, scraped
from .local_http import serving

POOL_PODS = ["worker.a", "worker-b"]


def test_pod_selector_escapes_names_and_strings():
    assert pod_selector("fleet", POOL_PODS) == r'namespace="fleet", pod=~"worker\\.a|worker-b"'
    assert pod_selector('a"b', ["x+y(1)"]) == r'namespace="a\"b", pod=~"x\\+y\\(1\\)"'
    assert kv_usage_query("ns", ["p"]) == 'avg(lorafleet_kv_cache_usage_ratio{namespace="ns", pod=~"p"})'
    assert waiting_query("ns", ["p"]) == 'avg(lorafleet_queue_depth{namespace="ns", pod=~"p"})'
    # The hit rate's window: 120 s unless the pool sets spec.scaling.rateWindowSeconds.
    assert hit_rate_query("ns", ["p"]).count("[120s]") == 3 and hit_rate_query("ns", ["p"], 600).count("[600s]") == 3


async def test_hit_rate_and_kv_usage_of_the_pool_pods_only(tmp_path):
    pods = {
        # The pool: 3 of 4 GPU lookups hit on both (their rates differ), KV 0.9 and 0.5, 6 and 1 requests
        # waiting.
        ("fleet", "worker.a"): FakePod(hits=3, misses=1, kv_usage=0.9, waiting=6, seats=1.0),
        ("fleet", "worker-b"): FakePod(hits=6, misses=2, kv_usage=0.5, waiting=1, seats=0.5),
        # Not the pool: a name an unescaped "worker.a" would match, the same name in another namespace.
        ("fleet", "workerxa"): FakePod(hits=0, misses=5, kv_usage=0.0, waiting=100),
        ("other", "worker-b"): FakePod(hits=0, misses=5, kv_usage=1.0, waiting=0),
        # No adapter lookups at all: the hit rate is 0/0; no queue series: unknown.
        ("fleet", "idle"): FakePod(kv_usage=0.2),
    }
    async with scraped(tmp_path, pods) as (_, prom):
        def has_rates() -> bool:
            rates = prom.query('count(rate(lorafleet_adapter_hits_total{tier="gpu"}[2m]))')
            kv = prom.query("count(lorafleet_kv_cache_usage_ratio)")
            return bool(rates and kv) and rates[0]["value"][1] == kv[0]["value"][1] == str(len(pods))

        await prom.wait_for(has_rates, "two samples of every fake pod")
        # The escaping matters: as a bare regex, "worker.a" selects two pods.
        assert prom.query('count(lorafleet_kv_cache_usage_ratio{pod=~"worker.a"})')[0]["value"][1] == "2"
        client = PrometheusClient(timeout=5.0)
        try:
            hit_rate, kv_usage, waiting, seats = await client.pool_signals(prom.url, "fleet", POOL_PODS)
            assert seats == 0.75  # running sequences over --max-num-seqs, the mean of 1.0 and 0.5
            assert hit_rate == pytest.approx(0.75, rel=1e-9)
            assert kv_usage == pytest.approx(0.7, rel=1e-9)
            assert waiting == 3.5  # (6 + 1) / 2 per worker
            signals = await client.pool_signals(prom.url + "/", "fleet", ["worker-b"])
            assert signals == pytest.approx((0.75, 0.5, 1.0, 0.5)) and signals.waiting == 1.0
            # A longer window over the same steady counters: the same ratio.
            assert await client.pool_signals(prom.url, "fleet", POOL_PODS, rate_window_seconds=600) == pytest.approx((0.75, 0.7, 3.5, 0.75))
            assert await client.pool_signals(prom.url, "other", ["worker-b"]) == (0.0, 1.0, 0.0, None)
            # Unknown: no traffic (NaN), no series, no pods; a pod without the queue series counts in no mean.
            assert await client.pool_signals(prom.url, "fleet", ["idle"]) == (None, 0.2, None, None)
            assert await client.pool_signals(prom.url, "fleet", ["worker-b", "idle"]) == pytest.approx((0.75, 0.35, 1.0, 0.5))
            assert await client.pool_signals(prom.url, "fleet", ["gone"]) == (None, None, None, None)
            assert await client.pool_signals(prom.url, "fleet", []) == (None, None, None, None)
            # Which pods were scraped: a KV or queue series of their own (the escaped name matches only itself).
            assert await client.scraped_pods(prom.url, "fleet", ["worker.a", "idle", "gone"]) == {"worker.a", "idle"}
            assert await client.scraped_pods(prom.url, "fleet", []) == set()
            # A query Prometheus refuses: its own error, named.
            with pytest.raises(MetricsError, match="HTTP 400: bad_data"):
                await client.query(prom.url, "sum(")
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def stub(handler):
    """An HTTP server on 127.0.0.1 answering every /api/v1/query with ``handler``."""
    app = web.Application()
    app.router.add_route("*", "/api/v1/query", handler)
    async with serving(app) as url:
        yield url


def answer(text: str | bytes, status: int = 200):
    """`text` as JSON, or bytes as they are with their own content type (a proxy's page: its charset, if any)."""
    async def handler(_: web.Request) -> web.Response:
        if isinstance(text, bytes):
            ctype, _, body = text.partition(b"\n")
            return web.Response(body=body, status=status, headers={"Content-Type": ctype.decode()})
        return web.Response(text=text, status=status, content_type="application/json")
    return handler


VECTOR = '{"status": "success", "data": {"resultType": "vector", "result": %s}}'


@pytest.mark.parametrize(("text", "status", "error"), [
    ("<html>bad gateway</html>", 502, "HTTP 502, not Prometheus' JSON"),
    # A proxy's page that is not UTF-8 (Latin-1 with no charset, a charset Python does not know): a MetricsError,
    # not a UnicodeDecodeError out of the autoscaler's pass.
    (b"text/html\n<html>502 Bad Gateway \xe9</html>", 502, "HTTP 502, not Prometheus' JSON: '<html>502 Bad Gateway \ufffd"),
    (b"text/html; charset=x-no-such\n<html>\xff\xfe</html>", 503, "HTTP 503, not Prometheus' JSON"),
    ("[1, 2]", 200, "not Prometheus' JSON"),
    ('{"status": "error", "errorType": "execution", "error": "query timed out"}', 503,
     "HTTP 503: execution: query timed out"),
    ('{"status": "success", "data": {"resultType": "matrix", "result": []}}', 200, "expected a vector"),
    (VECTOR % '[{"metric": {}, "value": [1, "0.5"]}, {"metric": {}, "value": [1, "0.7"]}]', 200,
     "expected one series, got 2"),
    (VECTOR % '[{"metric": {}}]', 200, "malformed query result"),
    (VECTOR % '[{"metric": {}, "value": [1, "lots"]}]', 200, "malformed query result"),
])
async def test_bad_answers_raise_metrics_errors(text, status, error):
    client = PrometheusClient(timeout=5.0)
    try:
        async with stub(answer(text, status)) as url:
            with pytest.raises(MetricsError, match=error):
                await client.query(url, "up")
    finally:
        await client.close()


async def test_values_nan_and_scalars():
    client = PrometheusClient(timeout=5.0)
    try:
        for result, expected in [('[{"metric": {}, "value": [1, "0.25"]}]', 0.25), ("[]", None),
                                 ('[{"metric": {}, "value": [1, "NaN"]}]', None),
                                 ('[{"metric": {}, "value": [1, "+Inf"]}]', None)]:
            async with stub(answer(VECTOR % result)) as url:
                assert await client.query(url, "up") == expected
        scalar = '{"status": "success", "data": {"resultType": "scalar", "result": [1, "3"]}}'
        async with stub(answer(scalar)) as url:
            assert await client.query(url, "vector(3)") == 3.0
    finally:
        await client.close()


async def test_a_large_pools_query_fits_behind_a_proxy():
    """A pool of 300 pods names each in the query: as a URL that is far past the 8 KiB request line proxies
    (and this stub's aiohttp) accept, so the query goes in the body."""
    pods = [f"lorafleet-worker-7c9d8f6b5-{i:05d}" for i in range(300)]
    asked = []

    async def handler(request: web.Request) -> web.Response:
        asked.append((request.method, (await request.post()).get("query")))
        return web.Response(text=VECTOR % '[{"metric": {}, "value": [1, "0.5"]}]', content_type="application/json")

    client = PrometheusClient(timeout=5.0)
    try:
        async with stub(handler) as url:
            assert await client.pool_signals(url, "fleet", pods) == (0.5, 0.5, 0.5, 0.5)
    finally:
        await client.close()
    assert sorted(asked) == sorted([("POST", hit_rate_query("fleet", pods)), ("POST", kv_usage_query("fleet", pods)),
                                    ("POST", waiting_query("fleet", pods)), ("POST", seats_query("fleet", pods))])
    assert len(asked[0][1]) > 8192


async def test_no_server_and_no_answer_raise_metrics_errors():
    client = PrometheusClient(timeout=0.5)
    never = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await never.wait()
        return web.Response(text="{}")

    try:
        with pytest.raises(MetricsError, match=f"127.0.0.1:{(port := free_port())}"):
            await client.query(f"http://127.0.0.1:{port}", "up")  # nothing listens there
        async with stub(hang) as url:
            with pytest.raises(MetricsError, match="no answer within 0.5 s"):
                await client.query(url, "up")
            never.set()
    finally:
        await client.close()
    with pytest.raises(MetricsError, match="closed"):
        await client.query("http://127.0.0.1:1", "up")
