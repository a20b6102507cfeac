"""AdapterMetrics: the adapter pool's counters and gauges as prometheus-client objects.

They are created unregistered; the server registers them (`for c in metrics.collectors():
registry.register(c)`), so several pools (tests) never collide in the default registry. Tiers are
`gpu` (hot), `cpu` (warm), `disk` (staged locally, parsed into the CPU tier). Only the label sets a
series can move on are created: the worker counts disk reads (`hits{tier="disk"}`) and disk load
failures, but what lies on disk is the stager's to report (its `GET /v1/state`), so bytes and
residency are per `gpu`/`cpu` only.
"""

from __future__ import annotations

import torch
from prometheus_client import Counter, Gauge, Histogram

TIERS = ("gpu", "cpu", "disk")
MEMORY_TIERS = ("gpu", "cpu")  # tiers whose bytes and residents the pool holds itself
EVICTION_REASONS = ("capacity", "quota", "kv", "version", "unregister", "budget")
_LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class AdapterMetrics:
    def __init__(self) -> None:
        self.hits = Counter("lorafleet_adapter_hits", "Adapter lookups served by a tier", ["tier"], registry=None)
        self.misses = Counter("lorafleet_adapter_misses", "Adapter lookups a tier could not serve", ["tier"],
                              registry=None)
        self.load_seconds = Histogram("lorafleet_adapter_load_seconds",
                                      "Adapter load time into a tier (cpu: disk->CPU parse, gpu: H2D copy)",
                                      ["tier"], buckets=_LOAD_BUCKETS, registry=None)
        self.wait_seconds = Histogram("lorafleet_adapter_wait_seconds",
                                      "Time a request that missed its adapter on the GPU waited for it once the "
                                      "scheduler asked for it (the load's queue, read and copy, and GPU room)", buckets=_LOAD_BUCKETS, registry=None)
        self.load_failures = Counter("lorafleet_adapter_load_failures", "Adapter loads that failed", ["tier"],
                                     registry=None)
        self.refusals = Counter("lorafleet_adapter_refusals", "Adapter placements refused by policy (a tenant's GPU "
                                "quota, pinned adapters holding the room, a size over the ceiling), not failed loads",
                                registry=None)
        self.evictions = Counter("lorafleet_adapter_evictions", "Adapters evicted from a tier", ["tier", "reason"],
                                 registry=None)
        self.bytes = Gauge("lorafleet_adapter_bytes", "Bytes of adapters held in a tier", ["tier"], registry=None)
        self.resident = Gauge("lorafleet_adapters_resident", "Adapters held in a tier", ["tier"], registry=None)
        self.fragmentation = Gauge("lorafleet_adapter_pool_fragmentation",
                                   "Share of adapter page elements that hold no weights", registry=None)
        # The page counts are read from the page pool at scrape time (watch_page_pool): KV pages move
        # every engine step, not only when the adapter pool changes.
        self.kv_pages = Gauge("lorafleet_page_pool_kv_pages", "Pages of the unified pool holding KV blocks",
                              registry=None)
        self.adapter_pages = Gauge("lorafleet_page_pool_adapter_pages",
                                   "Pages of the unified pool holding adapter weights", registry=None)
        self.pages = Gauge("lorafleet_page_pool_pages", "Pages of the unified pool (KV blocks + adapter weights)",
                           registry=None)
        self.host_bytes = Gauge("lorafleet_adapter_host_memory_bytes", "Host memory behind the CPU tier's images "
                                "(page-locked on GPU hosts): reserved = the arena's slabs, used = their pages images hold; "
                                "pinned (GPU hosts) = all page-locked memory torch's allocator holds, slabs given back included",
                                ["state"], registry=None)
        self.reads_waiting = Gauge("lorafleet_adapter_reads_waiting", "Adapters wanted on the GPU whose read waits for "
                                   "room in the CPU tier's budget, which images waiting for GPU room fill", registry=None)
        self._page_pool = self._arena = None
        # Pre-create label sets so every series that can move exists from the first scrape.
        for tier in TIERS:
            self.hits.labels(tier)  # disk: a disk->CPU read
        for tier in ("gpu", "disk"):  # a failed H2D copy / a failed read or parse
            self.load_failures.labels(tier)
        for tier in MEMORY_TIERS:
            self.misses.labels(tier)
            self.bytes.labels(tier)
            self.resident.labels(tier)
            self.load_seconds.labels(tier)
            for reason in EVICTION_REASONS:
                self.evictions.labels(tier, reason)

    def watch_page_pool(self, page_pool) -> None:
        """Read the page gauges from `page_pool` (a PagePool) at every scrape from now on."""
        if self._page_pool is page_pool:
            return
        self._page_pool = page_pool
        self.kv_pages.set_function(lambda: page_pool.num_used("kv"))
        self.adapter_pages.set_function(lambda: page_pool.num_used("adapter"))
        self.pages.set_function(lambda: page_pool.num_pages)

    def watch_arena(self, arena) -> None:
        """Read the host memory gauges from `arena` (a HostArena) at every scrape from now on."""
        if self._arena is arena:
            return
        self._arena = arena
        self.host_bytes.labels("reserved").set_function(lambda: arena.reserved_bytes)
        self.host_bytes.labels("used").set_function(lambda: arena.used_bytes)
        if arena.pin:
            self.host_bytes.labels("pinned").set_function(lambda: pinned_bytes())

    def collectors(self) -> list:
        return [self.hits, self.misses, self.load_seconds, self.wait_seconds, self.load_failures, self.refusals,
                self.evictions, self.bytes, self.resident, self.fragmentation, self.kv_pages, self.adapter_pages,
                self.pages, self.host_bytes, self.reads_waiting]


def pinned_bytes(which: str = "current") -> float:
    """Page-locked bytes torch's pinned allocator holds, handed out or cached (`which`: "current" or "peak"; its
    stats' names differ between torch versions); NaN where torch does not report them."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    found = [stats[k] for k in (f"allocated_bytes.{which}", f"reserved_bytes.{which}") if k in stats]
    return float(max(found)) if found else float("nan")
