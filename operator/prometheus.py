"""The autoscaler's signals of a pool, read from Prometheus' HTTP API (``POST /api/v1/query``, the
query form-encoded in the body: it names every worker pod, and a pool of a hundred pods makes a URL
longer than proxies in front of Prometheus accept, 8 KiB for nginx).

All are restricted to the pool's ready worker pods by the ``namespace`` and ``pod`` labels a
Kubernetes scrape config attaches (the chart's ServiceMonitor does):

* GPU hit rate: rate of ``lorafleet_adapter_hits_total{tier="gpu"}`` over hits + misses at that tier
  (the Grafana dashboard's expression, over the pool's ``rateWindowSeconds``, default 120);
* KV usage: the mean of ``lorafleet_kv_cache_usage_ratio``;
* waiting: the mean of ``lorafleet_queue_depth`` (requests waiting to be scheduled, per worker; the worker
  exports the same value as ``vllm:num_requests_waiting``);
* seats: the mean of ``lorafleet_seat_usage_ratio`` (running sequences over each worker's ``--max-num-seqs``).

An empty result or NaN (no series, no traffic) is ``None``: unknown. Anything else that goes wrong
(no answer, an HTTP error, a body that is not Prometheus' JSON) raises ``MetricsError``.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import NamedTuple

import aiohttp

DEFAULT_RATE_WINDOW_SECONDS = 120  # spec.scaling.rateWindowSeconds
HITS = "lorafleet_adapter_hits_total"
MISSES = "lorafleet_adapter_misses_total"
KV_USAGE = "lorafleet_kv_cache_usage_ratio"
QUEUE_DEPTH = "lorafleet_queue_depth"
SEAT_USAGE = "lorafleet_seat_usage_ratio"
_RE2_SPECIAL = set(r"\.+*?()|[]{}^$")


class MetricsError(Exception):
    """Prometheus could not be asked, or its answer could not be read."""


def _string(value: str) -> str:
    """A PromQL double-quoted string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def pod_selector(namespace: str, pods: list[str]) -> str:
    """Label matchers of exactly these pods (a regex matcher is anchored; metacharacters are escaped, so
    ``worker.a`` does not match ``workerxa``)."""
    regex = "|".join("".join("\\" + c if c in _RE2_SPECIAL else c for c in pod) for pod in pods)
    return f"namespace={_string(namespace)}, pod=~{_string(regex)}"


def hit_rate_query(namespace: str, pods: list[str], window_seconds: int = DEFAULT_RATE_WINDOW_SECONDS) -> str:
    """PromQL: these pods' GPU hit rate over the last window_seconds (NaN without lookups)."""
    # A counter a worker has not incremented yet may not be exported at all: absent counts as 0, and
    # both absent is 0/0 = NaN (unknown).
    sel = f'tier="gpu", {pod_selector(namespace, pods)}'
    hits = f"(sum(rate({HITS}{{{sel}}}[{window_seconds}s])) or vector(0))"
    misses = f"(sum(rate({MISSES}{{{sel}}}[{window_seconds}s])) or vector(0))"
    return f"{hits} / ({hits} + {misses})"


def kv_usage_query(namespace: str, pods: list[str]) -> str:
    """PromQL: these pods' mean KV-cache usage (no sample without series)."""
    return f"avg({KV_USAGE}{{{pod_selector(namespace, pods)}}})"


def waiting_query(namespace: str, pods: list[str]) -> str:
    """PromQL: these pods' mean number of requests waiting to be scheduled (no sample without series: a
    gauge the worker always exports, so absent means unknown, not 0)."""
    return f"avg({QUEUE_DEPTH}{{{pod_selector(namespace, pods)}}})"


def seats_query(namespace: str, pods: list[str]) -> str:
    """PromQL: these pods' mean share of their sequence seats in use (none from a worker that does not export it)."""
    return f"avg({SEAT_USAGE}{{{pod_selector(namespace, pods)}}})"


def scraped_query(namespace: str, pods: list[str]) -> str:
    """PromQL: one sample per pod of these that has a KV usage or queue gauge (a worker exports both from its
    first scrape), labelled with the pod."""
    sel = pod_selector(namespace, pods)
    return f"count by (pod) ({KV_USAGE}{{{sel}}}) or count by (pod) ({QUEUE_DEPTH}{{{sel}}})"


class PoolSignals(NamedTuple):
    """A pool's signals; None: unknown (no series, or no traffic)."""

    hit_rate: float | None
    kv_usage: float | None
    waiting: float | None = None
    seats: float | None = None


class PrometheusClient:
    """Instant queries to a Prometheus (the URL is per call: each pool names its own, which the scaler first
    checks against the operator's allowlist), over one aiohttp session with a ``timeout`` per query (closed by
    ``close``). A redirect is not followed: it would lead the request to a URL no allowlist vetted."""

    def __init__(self, *, timeout: float) -> None:
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise MetricsError("the Prometheus client is closed (operator shutting down)")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def close(self) -> None:
        """Close the session; later queries raise ``MetricsError`` instead of reconnecting."""
        self._closed = True  # a pass still finishing after shutdown must not open a new session
        if self._session is not None:
            await self._session.close()

    async def query(self, base_url: str, promql: str) -> float | None:
        """The value of an instant query that yields at most one sample; None when it yields none, NaN or
        an infinity."""
        url, data = await self._ask(base_url, promql)
        return _single_value(url, data)

    async def scraped_pods(self, base_url: str, namespace: str, pods: list[str]) -> set[str]:
        """Those of ``pods`` Prometheus has a KV usage or queue series of (scraped at least once)."""
        if not pods:
            return set()
        url, data = await self._ask(base_url, scraped_query(namespace, pods))
        try:
            if data["resultType"] != "vector" or not isinstance(data["result"], list):  # type: ignore[index]
                raise MetricsError(f"{url}: expected a vector, got a {data['resultType']}")  # type: ignore[index]
            return {str(s["metric"]["pod"]) for s in data["result"]} & set(pods)  # type: ignore[index]
        except (KeyError, TypeError):
            raise MetricsError(f"{url}: malformed query result: {json.dumps(data)[:200]}") from None

    async def _ask(self, base_url: str, promql: str) -> tuple[str, object]:
        """(the query URL, the ``data`` of Prometheus' answer to an instant query)."""
        url = base_url.rstrip("/") + "/api/v1/query"
        try:
            async with self._client().post(url, data={"query": promql}, allow_redirects=False) as resp:
                text = await resp.text(errors="replace")  # a proxy's error page need not be UTF-8
                status = resp.status
        except TimeoutError:
            raise MetricsError(f"{url}: no answer within {self.timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise MetricsError(f"{url}: {exc}") from None
        try:
            body = json.loads(text)
        except ValueError:
            raise MetricsError(f"{url}: HTTP {status}, not Prometheus' JSON: {text[:200]!r}") from None
        if not isinstance(body, dict):
            raise MetricsError(f"{url}: HTTP {status}, not Prometheus' JSON: {text[:200]!r}")
        if status != 200 or body.get("status") != "success":
            raise MetricsError(f"{url}: HTTP {status}: {body.get('errorType', 'error')}: "
                               f"{str(body.get('error', text))[:300]}")
        return url, body.get("data")

    async def pool_signals(self, base_url: str, namespace: str, pods: list[str], *,
                           rate_window_seconds: int = DEFAULT_RATE_WINDOW_SECONDS) -> PoolSignals:
        """(GPU hit rate over the last rate_window_seconds, KV usage, requests waiting per pod, seat usage) of
        these pods; all None without pods."""
        if not pods:
            return PoolSignals(None, None, None, None)
        values = await asyncio.gather(self.query(base_url, hit_rate_query(namespace, pods, rate_window_seconds)),
                                      self.query(base_url, kv_usage_query(namespace, pods)),
                                      self.query(base_url, waiting_query(namespace, pods)),
                                      self.query(base_url, seats_query(namespace, pods)))
        return PoolSignals(*values)


def _single_value(url: str, data: object) -> float | None:
    try:
        kind, result = data["resultType"], data["result"]  # type: ignore[index]
        if kind == "scalar":
            samples = [result]
        elif kind == "vector" and isinstance(result, list):
            samples = [s["value"] for s in result]
        else:
            raise MetricsError(f"{url}: expected a vector, got a {kind}")
        if len(samples) > 1:
            raise MetricsError(f"{url}: expected one series, got {len(samples)}")
        value = float(samples[0][1]) if samples else math.nan
    except (KeyError, TypeError, IndexError, ValueError):
        raise MetricsError(f"{url}: malformed query result: {json.dumps(data)[:200]}") from None
    return value if math.isfinite(value) else None
