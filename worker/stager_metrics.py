"""StagerMetrics: the stager's Prometheus registry (`GET /metrics`, `lorafleet_stager_*`): the disk
tier's hits and misses, downloads, bytes, failures, download latency, cache bytes and entries, whether the
object store answers and the cached copies served unchecked while it does not; and the
progress of the downloads in progress, as `GET /v1/state` reports it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lorafleet.worker.disk_cache import DiskCache


class StagerMetrics:
    def __init__(self, cache: DiskCache) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lorafleet_stager_stage_requests", "Stage requests by disk-cache outcome",
                                ["outcome"], registry=r)  # hit | miss | local
        for outcome in ("hit", "miss", "local"):  # at 0 from the start: rate() sees a first increment only from 0
            self.requests.labels(outcome)
        self.downloads = Counter("lorafleet_stager_downloads", "Completed, verified downloads", registry=r)
        self.download_bytes = Counter("lorafleet_stager_download_bytes", "Bytes downloaded", registry=r)
        self.failures = Counter("lorafleet_stager_failures", "Failed downloads (store, digest, timeout)", registry=r)
        self.seconds = Histogram("lorafleet_stager_download_seconds", "Download + verify time", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        # worker/stager_store.py: an outage lasts from a failure to reach the store to its next answer.
        self.store_up = Gauge("lorafleet_stager_store_up", "0 while the object store is unreachable", registry=r)
        self.store_fallbacks = Counter("lorafleet_stager_store_fallbacks",
                                       "Versions served from a cached copy the unreachable store could not check",
                                       registry=r)
        Gauge("lorafleet_stager_cache_bytes", "Bytes in the node-local disk cache", registry=r).set_function(
            lambda: cache.used_bytes)
        Gauge("lorafleet_stager_cache_reserved_bytes", "Bytes the downloads in flight will write (counted against "
              "the cache's budget)", registry=r).set_function(lambda: cache.reserved_bytes)
        Gauge("lorafleet_stager_cache_entries", "Adapters in the node-local disk cache", registry=r).set_function(
            lambda: len(cache.entries()))


def progress_by_uri(downloading: dict[str, tuple[str, int, int]]) -> dict[str, dict[str, int]]:
    """The downloads in progress (cache key -> (uri, bytes done, bytes total)) by URI: bytes done and total.
    A URI downloaded under two cache keys at once (with and without its sha256): the two added."""
    by_uri: dict[str, dict[str, int]] = {}
    for uri, done, total in list(downloading.values()):  # a copy: download threads change it
        p = by_uri.setdefault(uri, {"done": 0, "total": 0})
        p["done"], p["total"] = p["done"] + done, p["total"] + total
    return by_uri
