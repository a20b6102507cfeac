"""A pushed adapter's `priority` (higher survives eviction longer) orders the worker's GPU evictions."""

from __future__ import annotations

from lorafleet.worker import Engine, EngineConfig
from lorafleet.worker.directives import DesiredState
from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.served_adapters import ServedAdapters


def test_a_higher_priority_adapter_outlives_a_more_recently_used_lower_one(tiny_llama_dir, qv_adapters_dir):
    """Two slots: `hi` (priority 5) was used before `lo` (priority 0). A third adapter needs a slot: `lo`
    goes, though least-recently-used order alone would evict `hi`."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_loras=2))
    try:
        served = ServedAdapters("base")
        ref = {"version": "v1", "uri": str(qv_adapters_dir / "alpha")}
        served.apply(DesiredState.from_dict({"generation": 1, "adapters": [
            {"name": "hi", "tenant": "t", "stable": ref, "priority": 5},
            {"name": "lo", "tenant": "t", "stable": ref},
            {"name": "new", "tenant": "t", "stable": ref | {"uri": str(qv_adapters_dir / "beta")}},
        ]}), EngineAdapters(engine))
        pool = engine.adapter_pool
        for key in ("hi@v1", "lo@v1"):
            pool.load(key)
            pool.release(pool.acquire(key))
        pool.load("new@v1")
        assert pool.entry("hi@v1").resident and not pool.entry("lo@v1").resident
        pool.check()
    finally:
        engine.close()
