"""A pool's settings in the desired state (eviction policy, CPU tier budget): on the wire, through the
stager, into the registry and the adapter pool; a push without them leaves the worker's own."""

from __future__ import annotations

import dataclasses

import pytest
from aiohttp import web

from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig
from lorafleet.worker.directives import DesiredState, DirectiveError, ReportedState
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.stager import Stager
from tests.lora_factory import TINY_DIMS, random_weights
from tests.worker.test_eviction import use_frequent_then_recent
from tests.worker.test_served_adapters import SQL, RecordingHost
from tests.worker.test_stager_bounds import FakeStore, config

GIB = 1 << 30
SQL_S3 = {"name": "sql", "tenant": "t", "stable": {"version": "v1", "uri": "s3://adapters/team/sql-v1/"}}


# ---- on the wire ---------------------------------------------------------------------------------

def test_pool_settings_round_trip():
    state = DesiredState.from_dict({"generation": 3, "adapters": [SQL], "eviction": "lfu", "cpu_bytes": 2 * GIB})
    assert (state.eviction, state.cpu_bytes) == ("lfu", 2 * GIB)
    assert DesiredState.from_json(state.to_json()) == state
    assert state.to_dict()["eviction"] == "lfu" and state.to_dict()["cpu_bytes"] == 2 * GIB


def test_a_push_without_pool_settings_parses_and_leaves_them_out():
    state = DesiredState.from_dict({"generation": 3, "adapters": [SQL]})  # an older operator's push
    assert (state.eviction, state.cpu_bytes) == (None, None)
    assert DesiredState.from_json(state.to_json()) == state
    assert "eviction" not in state.to_dict() and "cpu_bytes" not in state.to_dict()


@pytest.mark.parametrize(("settings", "field"), [({"eviction": "fifo"}, "eviction"),
                                                  ({"cpu_bytes": -1}, "cpu_bytes"),
                                                  ({"cpu_bytes": "4Gi"}, "cpu_bytes")])
def test_bad_pool_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(DirectiveError, match=f"^{field}: "):
        DesiredState.from_dict({"generation": 1, "adapters": [], **settings})


# ---- the adapter pool ----------------------------------------------------------------------------

def make_pool(**kw) -> AdapterPool:
    pages = PagePool(PagePoolConfig(num_pages=256, page_elems=1000))
    return AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(**{"max_slots": 2, "num_load_threads": 1, **kw}))


def test_switching_to_lfu_at_runtime_evicts_the_least_used():
    """Under LRU the newcomer would evict `frequent` (used longest ago); the entries keep their counts,
    so LFU at once evicts `recent` (used once) instead."""
    pool = make_pool()
    use_frequent_then_recent(pool)
    pool.configure(eviction_policy="lfu")
    assert pool.policy.name == "lfu" and pool.stats()["eviction"] == "lfu"
    pool.add("newcomer@1", random_weights(3))
    pool.load("newcomer@1")
    assert pool.entry("frequent@1").resident and not pool.entry("recent@1").resident
    pool.check()
    pool.close()


def test_a_smaller_cpu_budget_evicts_idle_cpu_copies_and_none_goes_back_to_the_own():
    pool = make_pool()
    for i in range(4):
        pool.add(f"c{i}@1", loader=lambda i=i: random_weights(i))
        pool.prefetch(f"c{i}@1", tier="cpu")
        pool.wait_idle()
    size = pool.entry("c0@1").image.nbytes
    assert pool.stats()["resident"]["cpu"] == 4
    pool.configure(cpu_budget_bytes=2 * size)
    stats = pool.stats()
    assert stats["resident"]["cpu"] == 2 and stats["bytes"]["cpu"] <= 2 * size
    assert stats["evictions"]["cpu"] == {"budget": 2} and stats["cpu_budget_bytes"] == 2 * size
    pool.configure()  # the worker's own settings again
    assert pool.config.cpu_budget_bytes == 4 * GIB and pool.policy.name == "lru"
    pool.close()


def test_a_smaller_cpu_budget_keeps_the_copy_a_pinned_adapter_waits_on():
    """A CPU copy that is about to go to the GPU (wanted, not placed yet) is never trimmed."""
    pool = make_pool(max_slots=1)
    pool.add("busy@1", random_weights(1))
    pool.load("busy@1")
    slot = pool.acquire("busy@1")  # holds the only slot
    pool.add("pinned@1", random_weights(2))
    pool.pin("pinned@1")  # wanted on the GPU; waits for the slot with its CPU copy
    pool.configure(cpu_budget_bytes=0)
    assert pool.entry("pinned@1").image is not None
    pool.release(slot)
    pool.wait_idle()
    assert pool.entry("pinned@1").resident
    pool.close()


# ---- the registry: applied with a push -----------------------------------------------------------

class ConfigurableHost(RecordingHost):
    def configure_pool(self, *, eviction, cpu_bytes):
        self.calls.append(("configure", eviction, cpu_bytes))


def configures(host: RecordingHost) -> list[tuple]:
    return [c for c in host.calls if c[0] == "configure"]


def test_a_push_configures_the_pool_when_its_settings_change():
    served, host = ServedAdapters("base"), ConfigurableHost()
    served.apply(DesiredState.from_dict({"generation": 1, "adapters": [SQL], "eviction": "lfu",
                                         "cpu_bytes": GIB}), host)
    served.apply(DesiredState.from_dict({"generation": 2, "adapters": [SQL], "eviction": "lfu",
                                         "cpu_bytes": GIB}), host)
    assert configures(host) == [("configure", "lfu", GIB)]
    served.apply(DesiredState.from_dict({"generation": 3, "adapters": [SQL]}), host)  # back to the worker's own
    assert configures(host)[1:] == [("configure", None, None)]


def test_an_old_style_push_leaves_the_worker_configuration_alone():
    served, host = ServedAdapters("base"), RecordingHost()  # an engine without pool settings would fail
    assert served.apply(DesiredState.from_dict({"generation": 1, "adapters": [SQL]}), host)
    assert served.settings == (None, None)


# ---- the stager forwards them --------------------------------------------------------------------

async def test_the_stager_forwards_the_pool_settings(aiohttp_server, tmp_path, monkeypatch):
    bodies: list[dict] = []

    async def put_state(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return await get_state(request)

    async def get_state(request: web.Request) -> web.Response:
        return web.json_response({"generation_applied": bodies[-1]["generation"] if bodies else 0, "adapters": []})

    app = web.Application()
    app.add_routes([web.put("/admin/v1/state", put_state), web.get("/admin/v1/state", get_state)])
    engine = await aiohttp_server(app)
    stager = Stager(dataclasses.replace(config(tmp_path), engine_url=str(engine.make_url(""))))
    FakeStore(stager, monkeypatch)
    await stager.apply(DesiredState.from_dict({"generation": 1, "adapters": [SQL_S3], "eviction": "cost",
                                               "cpu_bytes": 3 * GIB}))
    await stager.apply(DesiredState.from_dict({"generation": 2, "adapters": [SQL_S3]}))
    assert [(b.get("eviction"), b.get("cpu_bytes")) for b in bodies] == [("cost", 3 * GIB), (None, None)]
    assert bodies[0]["adapters"][0]["stable"]["uri"].startswith("/")  # the adapters are still rewritten


# ---- the worker, end to end ----------------------------------------------------------------------

async def test_the_admin_push_applies_the_settings_and_the_report_shows_them(aiohttp_client, tiny_llama_dir,
                                                                            qv_adapters_dir):
    from tests.worker.test_admin_pushes import ADMIN, admin_client, directive

    client = await admin_client(aiohttp_client, tiny_llama_dir, qv_adapters_dir)
    alpha = directive("alpha", qv_adapters_dir / "alpha")

    async def push(body: dict) -> dict:
        resp = await client.put("/admin/v1/state", json=body, headers=ADMIN)
        assert resp.status == 200, await resp.text()
        resp = await client.get("/admin/v1/state", headers=ADMIN)
        pool = (await resp.json())["pool"]
        return {"eviction": pool["eviction"], "cpu_budget_bytes": pool["cpu_budget_bytes"]}

    own = {"eviction": "lru", "cpu_budget_bytes": 4 * GIB}
    assert await push({"generation": 1, "adapters": [alpha]}) == own  # an older operator's push
    assert await push({"generation": 2, "adapters": [alpha], "eviction": "lfu", "cpu_bytes": GIB}) == {
        "eviction": "lfu", "cpu_budget_bytes": GIB}
    assert await push({"generation": 3, "adapters": [alpha]}) == own


async def test_the_state_report_says_how_many_adapter_bytes_and_slots_the_gpu_pool_holds(aiohttp_client,
                                                                                        tiny_llama_dir, qv_adapters_dir):
    # The operator places warm copies by them: a worker that reported neither was taken to be unbounded.
    from tests.worker.test_admin_pushes import ADMIN, admin_client

    client = await admin_client(aiohttp_client, tiny_llama_dir, qv_adapters_dir)
    resp = await client.get("/admin/v1/state", headers=ADMIN)
    body = await resp.json()
    page_pool = body["pool"]["page_pool"]
    assert body["pool_bytes"] == page_pool["num_pages"] * page_pool["page_bytes"] > 0
    assert body["pool_slots"] == EngineConfig().max_loras == body["pool"]["slots"]
    assert ReportedState.from_dict(body).pool_slots == body["pool_slots"]
