"""Worker ``/metrics`` doubles for a real Prometheus to scrape: one aiohttp server on 127.0.0.1 serving,
for each fake pod, the series the autoscaler reads, in the text exposition format.

Each pod is its own scrape target (``/pods/<namespace>/<pod>/metrics``) with static ``namespace`` and
``pod`` labels, as Kubernetes service discovery would attach them. Counters move per scrape, not per
second: every scrape of a pod adds its ``hits`` and ``misses`` steps, so the ratio of their rates is the
ratio of the steps whatever the scrape timing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.prometheus_server import PrometheusServer, prometheus_binary

from .local_http import start_app


@dataclass(slots=True)
class FakePod:
    hits: int = 0  # added to lorafleet_adapter_hits_total{tier="gpu"} per scrape
    misses: int = 0  # added to lorafleet_adapter_misses_total{tier="gpu"} per scrape
    kv_usage: float = 0.0
    waiting: int | None = None  # lorafleet_queue_depth; None: not exported
    seats: float | None = None  # lorafleet_seat_usage_ratio; None: not exported
    num_scrapes: int = 0

    def exposition(self) -> str:
        self.num_scrapes += 1
        n = self.num_scrapes
        return (
            "# TYPE lorafleet_adapter_hits_total counter\n"
            f'lorafleet_adapter_hits_total{{tier="gpu"}} {self.hits * n}\n'
            f'lorafleet_adapter_hits_total{{tier="cpu"}} {1000 * n}\n'  # another tier: never counted
            "# TYPE lorafleet_adapter_misses_total counter\n"
            f'lorafleet_adapter_misses_total{{tier="gpu"}} {self.misses * n}\n'
            "# TYPE lorafleet_kv_cache_usage_ratio gauge\n"
            f"lorafleet_kv_cache_usage_ratio {self.kv_usage}\n"
            + ("" if self.waiting is None else f"# TYPE lorafleet_queue_depth gauge\nlorafleet_queue_depth {self.waiting}\n")
            + ("" if self.seats is None else f"# TYPE lorafleet_seat_usage_ratio gauge\nlorafleet_seat_usage_ratio {self.seats}\n")
        )


class FakeMetrics:
    def __init__(self, pods: dict[tuple[str, str], FakePod]) -> None:
        self.pods = pods  # (namespace, pod) -> its series
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _metrics(self, request: web.Request) -> web.Response:
        pod = self.pods.get((request.match_info["namespace"], request.match_info["pod"]))
        if pod is None:
            raise web.HTTPNotFound()
        return web.Response(text=pod.exposition(), content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/pods/{namespace}/{pod}/metrics", self._metrics)
        self.runner, self.port = await start_app(app)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def scrape_configs(self) -> list[dict[str, Any]]:
        """One job, one target per pod: the path and the pod's labels set per static config."""
        return [{"job_name": "workers", "static_configs": [
            {"targets": [f"127.0.0.1:{self.port}"],
             "labels": {"namespace": ns, "pod": pod, "__metrics_path__": f"/pods/{ns}/{pod}/metrics"}}
            for ns, pod in self.pods]}]


@contextlib.asynccontextmanager
async def scraped(root: Path, pods: dict[tuple[str, str], FakePod]):
    """The fake pods' metrics served, and a real Prometheus scraping them every second; both always
    stopped. Skips the test when the prometheus binary is absent."""
    if prometheus_binary() is None:
        pytest.skip("prometheus is not installed (make prometheus)")
    metrics = FakeMetrics(pods)
    await metrics.start()
    try:
        with PrometheusServer(root, metrics.scrape_configs()) as prom:
            yield metrics, prom
    finally:
        await metrics.stop()
