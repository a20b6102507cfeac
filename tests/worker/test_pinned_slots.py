"""A worker whose GPU adapter slots (--max-loras) are all held by pinned adapters says so in its state report:
every other version carries `num_pinned_slots`, as it cannot become GPU-resident there until one is unpinned
or --max-loras raised. A warm version that a pinned one evicted showed no error and stayed at tier cpu, so
the operator's status waited (Loading) for ever."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.worker.directives import AdapterState, ReportedState
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.lora_factory import random_weights
from tests.worker.test_adapter_pool import make_pool

ADMIN = {"Authorization": "Bearer admin-token-for-tests"}


def test_the_pool_names_the_slot_holders_only_while_every_slot_is_pinned():
    pool = make_pool(max_slots=2)
    try:
        pool.add("p0@1", random_weights(0), pinned=True)
        pool.add("other@1", random_weights(1))
        pool.wait_idle()
        pool.load("other@1")
        assert pool.pinned_slot_keys() is None  # one slot is held by an adapter that may be evicted
        pool.add("p1@1", random_weights(2), pinned=True)  # evicts other@1
        pool.wait_idle()
        assert pool.pinned_slot_keys() == ["p0@1", "p1@1"] and not pool.entry("other@1").resident
        pool.unpin("p1@1")
        assert pool.pinned_slot_keys() is None
    finally:
        pool.close()


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, qv_adapters_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128, max_loras=1)
    config = WorkerConfig(engine=engine, served_model_name="tiny", admin_token=ADMIN["Authorization"].split()[1],
                          adapter_roots=str(qv_adapters_dir))
    return await aiohttp_client(create_app(config))


def directive(root, name: str, **flags: bool) -> dict:
    return {"name": name, "tenant": "acme", "stable": {"version": "v1", "uri": str(root / name)}, **flags}


async def push(client, generation: int, *adapters: dict) -> None:
    resp = await client.put("/admin/v1/state", json={"generation": generation, "adapters": list(adapters)},
                            headers=ADMIN)
    assert resp.status == 200, await resp.text()


async def report_when(client, done, timeout: float = 30.0) -> dict[str, dict]:
    """name -> its entry of /admin/v1/state, polled until `done` accepts them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        body = await (await client.get("/admin/v1/state", headers=ADMIN)).json()
        states = {a["name"]: a for a in body["adapters"]}
        if done(states):
            return states
        assert loop.time() < deadline, states
        await asyncio.sleep(0.02)


async def test_a_warm_adapter_evicted_by_a_pinned_one_reports_the_pinned_slots(client, qv_adapters_dir):
    """--max-loras 1: beta is warm and resident, then a push pins alpha, which takes the only slot. beta
    cannot come back (no error: nothing failed, no request asked for it); the report says why, and stops
    saying it once alpha is unpinned."""
    await push(client, 1, directive(qv_adapters_dir, "beta", warm=True))
    await report_when(client, lambda s: s["beta"]["tier"] == "gpu")
    await push(client, 2, directive(qv_adapters_dir, "beta", warm=True), directive(qv_adapters_dir, "alpha",
                                                                                   pinned=True))
    states = await report_when(client, lambda s: s["alpha"]["tier"] == "gpu")
    assert (states["beta"]["tier"], states["beta"]["error"], states["beta"]["num_pinned_slots"]) == ("cpu", None, 1)
    assert states["alpha"]["num_pinned_slots"] is None  # it holds the slot
    # What the stager forwards to the operator keeps it.
    forwarded = ReportedState.from_dict(await (await client.get("/admin/v1/state", headers=ADMIN)).json())
    assert forwarded.find("beta", "v1").num_pinned_slots == 1

    await push(client, 3, directive(qv_adapters_dir, "beta", warm=True), directive(qv_adapters_dir, "alpha"))
    states = await report_when(client, lambda s: s["beta"]["num_pinned_slots"] is None)
    assert states["alpha"]["num_pinned_slots"] is None


def test_a_report_without_the_field_parses_as_before():
    """An older worker does not send `num_pinned_slots`: it reads as None (no claim either way)."""
    old = {"generation_applied": 1, "adapters": [{"name": "a", "version": "v1", "tier": "cpu"}]}
    assert ReportedState.from_dict(old).adapters[0].num_pinned_slots is None
    new = ReportedState(1, [AdapterState("a", "v1", "cpu", num_pinned_slots=4)])
    assert ReportedState.from_json(new.to_json()) == new


def test_a_version_placed_after_its_placement_failed_reports_no_error():
    """other@1 cannot be placed while the one slot is pinned (a retryable error); once p0 is unpinned it loads
    and serves, yet its old error stayed: the state report showed a failure and the operator re-pushed it."""
    pool = make_pool(max_slots=1)
    try:
        pool.add("p0@1", random_weights(0), pinned=True)
        pool.add("other@1", random_weights(1))
        pool.wait_idle()
        with pytest.raises(Exception, match="held by pinned adapters"):
            pool.load("other@1", timeout=5)
        pool.unpin("p0@1")
        assert pool.acquire("other@1", waiter="r1") is None  # a request's load, as the engine makes it
        pool.wait_idle()
        slot = pool.acquire("other@1", waiter="r1")
        pool.release(slot)
        entry = {d["key"]: d for d in pool.describe()}["other@1"]
        assert (entry["tier"], entry.get("error")) == ("gpu", None) and pool.entry("other@1").error is None
    finally:
        pool.close()
