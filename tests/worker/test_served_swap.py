"""Stable and canary swapped in one push, or a new stable version rolled out with the old one kept as its
canary (worker/served_adapters.py): the new stable version becomes current once it has loaded, the old one
serving meanwhile and taking every user back if the new one fails; against an engine-like stand-in, and
over HTTP with the real engine."""

from __future__ import annotations

import shutil

import pytest

from lorafleet.worker.canary import NUM_BUCKETS, VersionSplit, user_bucket
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.worker.test_served_adapters import ACME, SQL, state
from tests.worker.test_served_fallback import ADMIN, SQL_V2, USERS, SwitchingHost, complete

V1, V2, V3 = ({"version": v, "uri": f"/c/sql/{v}"} for v in ("v1", "v2", "v3"))
CANARY_V2 = SQL | {"canary": V2, "canary_weight": 10}
SWAPPED = SQL | {"stable": V2, "canary": V1, "canary_weight": 10}  # after CANARY_V2: v2 stable, v1 its canary
NEW_BESIDE_OLD = SQL | {"stable": V3, "canary": V1, "canary_weight": 10}  # after SQL: a new v3, v1 its canary
CANARY_USERS = {u for u in USERS if user_bucket("sql", u) < NUM_BUCKETS // 10}  # the 10 % a canary serves
STABLE_USERS = set(USERS) - CANARY_USERS


def resolved(served: ServedAdapters, users: set[str]) -> set[str]:
    return {served.resolve("sql", ACME, u) for u in users}


def swap_to_unloaded(rollout: str) -> tuple[SwitchingHost, ServedAdapters, str]:
    """Push the rollout's first state, then the rollout, the new stable version not loaded; its key."""
    host, served = SwitchingHost(), ServedAdapters("base")
    if rollout == "swap":
        served.apply(state(1, CANARY_V2), host)
        host.keys["sql@v2"]["tier"] = "none"  # registered, no user reached it: only its files on disk
        served.apply(state(2, SWAPPED), host)
        return host, served, "sql@v2"
    served.apply(state(1, SQL), host)
    served.apply(state(2, NEW_BESIDE_OLD), host)
    return host, served, "sql@v3"


def test_the_sample_users_fall_on_both_sides_of_a_10_percent_split():
    assert CANARY_USERS and STABLE_USERS


@pytest.mark.parametrize("rollout", ["swap", "new_beside_old"])
def test_a_new_stable_version_not_loaded_becomes_current_once_loaded_and_a_failure_sends_users_back(rollout):
    host, served, new = swap_to_unloaded(rollout)
    assert host.current["sql"] == "sql@v1" and host.pending["sql"] == new  # v1 serves until it has loaded
    # Meanwhile the canary share goes to v1 (loaded), the rest to the new version (it waits for its load).
    assert resolved(served, CANARY_USERS) == {"sql@v1"} and resolved(served, STABLE_USERS) == {new}
    assert served.get("sql").fallback == "v1"
    served.mark_failed(new, "adapter_model.safetensors: truncated")
    assert resolved(served, set(USERS)) == {"sql@v1"}  # not a 503 for 90 % of the users
    assert served.get("sql").split == VersionSplit("v1")
    with pytest.raises(APIError, match="truncated") as exc:  # naming the failed version says why
        served.resolve(new, ACME, None)
    assert exc.value.status == 503
    assert {a.version: a.traffic_percent for a in served.report(host).adapters} == {"v1": 100, new.partition("@")[2]: 0}


@pytest.mark.parametrize("rollout", ["swap", "new_beside_old"])
def test_once_the_new_stable_version_has_loaded_the_old_one_stays_registered_as_its_canary(rollout):
    host, served, new = swap_to_unloaded(rollout)
    host.loaded(new)
    assert host.current["sql"] == new and "sql@v1" in host.keys  # switched, v1 kept for the canary share
    assert resolved(served, CANARY_USERS) == {"sql@v1"} and resolved(served, STABLE_USERS) == {new}
    served.apply(state(3, SWAPPED if rollout == "swap" else NEW_BESIDE_OLD), host)  # the next push keeps both
    assert served.get("sql").fallback is None and ("remove", "sql@v1") not in host.calls
    assert "sql@v1" in host.keys and resolved(served, CANARY_USERS) == {"sql@v1"}


def without_old_canary(rollout: str, kind: str) -> dict:
    """The push after `rollout` that keeps its new stable version but names v1 no longer as the canary."""
    stable = V2 if rollout == "swap" else V3
    return SQL | {"stable": stable} | ({"canary": V3 if rollout == "swap" else V2, "canary_weight": 10}
                                      if kind == "new_canary" else {})


@pytest.mark.parametrize("kind", ["kill_switch", "new_canary"])
@pytest.mark.parametrize("rollout", ["swap", "new_beside_old"])
def test_a_push_no_longer_naming_the_old_stable_version_as_the_canary_lets_the_switch_retire_it(rollout, kind):
    """While the new stable version loads, v1 (the engine's current version) is kept as its canary. A push
    without v1 as the canary makes the new version current again (its files not read again), so that the
    engine retires v1 at the switch instead of keeping it registered for good (on the GPU, and pinned or warm if it was)."""
    host, served, new = swap_to_unloaded(rollout)
    host.keys[new]["tier"] = "none"  # still loading
    served.apply(state(3, without_old_canary(rollout, kind)), host)
    assert ("make_current", new) in host.calls and "sql" not in host.kept
    assert host.calls.count(("register", new, True)) == 1  # its files are not read again
    assert served.get("sql").fallback == "v1" and host.current["sql"] == "sql@v1"  # v1 serves until then
    host.loaded(new)
    assert host.current["sql"] == new and "sql@v1" not in host.keys


@pytest.mark.parametrize("rollout", ["swap", "new_beside_old"])
def test_once_switched_a_push_dropping_the_old_canary_registers_nothing_again(rollout):
    host, served, new = swap_to_unloaded(rollout)
    host.loaded(new)  # v1 kept as the canary
    served.apply(state(3, without_old_canary(rollout, "kill_switch")), host)
    assert host.calls.count(("register", new, True)) == 1 and ("remove", "sql@v1") in host.calls


def test_a_failure_to_make_it_current_again_changes_nothing_that_serves():
    """Making the loading version current again only lets the switch retire v1: if that fails (the engine
    dropped it meanwhile, say), the version stays served and loading, and v1 the fallback (kept registered
    after the switch)."""
    host, served, _ = swap_to_unloaded("swap")
    host.keys["sql@v2"]["tier"] = "none"  # still loading
    make_current = host.make_adapter_current

    def refusing(key, **kw):
        if key == "sql@v2" and not kw.get("keep_previous"):
            raise KeyError(key)
        return make_current(key, **kw)

    host.make_adapter_current = refusing
    served.apply(state(3, without_old_canary("swap", "kill_switch")), host)
    assert not served.get("sql").errors and served.get("sql").fallback == "v1" and host.pending["sql"] == "sql@v2"
    assert resolved(served, set(USERS)) == {"sql@v2"}


def test_a_push_again_while_the_new_stable_version_loads_keeps_the_old_one_as_the_fallback():
    host, served, _ = swap_to_unloaded("swap")
    served.apply(state(3, SWAPPED), host)
    assert host.pending["sql"] == "sql@v2" and served.get("sql").fallback == "v1"
    served.mark_failed("sql@v2", "truncated")
    assert resolved(served, set(USERS)) == {"sql@v1"}


def test_a_swap_to_a_loaded_canary_switches_at_once():
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, CANARY_V2), host)  # v2 loaded (in memory): its users reached it
    served.apply(state(2, SWAPPED), host)
    assert host.current["sql"] == "sql@v2" and "sql" not in host.pending and ("make_current", "sql@v2") in host.calls
    assert ("register", "sql@v1", False) in host.calls and "sql@v1" in host.keys  # the old one back as the canary
    assert resolved(served, CANARY_USERS) == {"sql@v1"} and resolved(served, STABLE_USERS) == {"sql@v2"}
    assert served.get("sql").fallback is None


@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_a_swap_to_a_canary_not_on_the_gpu_switches_only_once_it_is(tier):
    """A copy in CPU memory is no loaded version: it may never fit on the GPU (more pages than an adapter may
    have). Switching to it at once retired v1, the one version that served, and stable users got 503."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, CANARY_V2), host)
    host.keys["sql@v2"]["tier"] = tier
    served.apply(state(2, SWAPPED), host)
    assert ("make_current", "sql@v2") not in host.calls and ("register", "sql@v2", True) in host.calls
    assert host.current["sql"] == "sql@v1" and host.pending["sql"] == "sql@v2" and served.get("sql").fallback == "v1"
    served.mark_failed("sql@v2", "needs 32 pages; adapters may use at most 8 pages of the pool")
    assert resolved(served, set(USERS)) == {"sql@v1"}


def test_a_swap_whose_new_stable_version_cannot_be_registered_leaves_the_old_one_serving_everyone():
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, CANARY_V2), host)
    host.keys["sql@v2"]["tier"] = "none"
    host.failing = {"/c/sql/v2"}  # e.g. its files changed under it: the digest no longer matches
    served.apply(state(2, SWAPPED), host)
    assert host.current["sql"] == "sql@v1" and "sql" not in host.pending
    assert resolved(served, set(USERS)) == {"sql@v1"} and "corrupt" in served.get("sql").errors["v2"]


@pytest.mark.parametrize("switched", [False, True])
def test_the_old_stable_version_named_as_the_canary_while_its_successor_loads_stays_registered(switched):
    """{v1}, then {v2} (v1 the fallback while v2 loads), then {v2, canary v1}: v1 is registered again as the
    canary, so the engine keeps it when v2 has loaded (or brings it back if v2 had loaded already)."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    served.apply(state(2, SQL_V2), host)
    if switched:
        host.loaded("sql@v2")
    served.apply(state(3, SQL_V2 | {"canary": V1, "canary_weight": 10}), host)
    assert ("register", "sql@v1", False) in host.calls
    host.loaded("sql@v2")
    assert host.current["sql"] == "sql@v2" and "sql@v1" in host.keys
    assert resolved(served, CANARY_USERS) == {"sql@v1"} and resolved(served, STABLE_USERS) == {"sql@v2"}


# ---- over HTTP, the real engine: the swapped-in canary's copy in memory was dropped (CPU budget 0) ----------
ALPHA_CANARY_USERS = [u for u in USERS if user_bucket("alpha", u) < NUM_BUCKETS // 10]
ALPHA_STABLE_USERS = [u for u in USERS if user_bucket("alpha", u) >= NUM_BUCKETS // 10]


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)
    config = WorkerConfig(engine=engine, served_model_name="tiny", admin_token=ADMIN,
                          adapter_roots=f"{qv_adapters_dir},{tmp_path}")
    return await aiohttp_client(create_app(config))


async def push_alpha(client, generation: int, stable: dict, canary: dict) -> None:
    body = {"generation": generation, "cpu_bytes": 0,  # no copy in memory but the ones in use
            "adapters": [{"name": "alpha", "tenant": "acme", "stable": stable, "canary": canary, "canary_weight": 10}]}
    resp = await client.put("/admin/v1/state", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status == 200, await resp.text()


async def tiers(client) -> dict[str, str]:
    report = await (await client.get("/admin/v1/state", headers={"Authorization": f"Bearer {ADMIN}"})).json()
    return {a["version"]: a["tier"] for a in report["adapters"] if a["name"] == "alpha"}


@pytest.mark.parametrize("v2_file", ["bad", "good"])
async def test_a_swap_to_a_canary_no_user_reached_over_http(client, qv_adapters_dir, tmp_path, v2_file):
    """A bad file of the swapped-in canary (changed after it registered) answered every stable request 503."""
    shutil.copytree(qv_adapters_dir / "beta", tmp_path / "v2")
    v1 = {"version": "v1", "uri": str(qv_adapters_dir / "alpha")}
    v2 = {"version": "v2", "uri": str(tmp_path / "v2")}
    await push_alpha(client, 1, v1, v2)
    assert (await complete(client, "alpha", ALPHA_STABLE_USERS[0]))[1]["model"] == "alpha@v1"  # v2 dropped from memory
    assert ALPHA_CANARY_USERS and await tiers(client) == {"v1": "gpu", "v2": "none"}
    if v2_file == "bad":
        (tmp_path / "v2" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    await push_alpha(client, 2, v2, v1)
    want = "alpha@v1" if v2_file == "bad" else "alpha@v2"
    for user in ALPHA_STABLE_USERS[:3]:
        status, body = await complete(client, "alpha", user)
        assert status == 200 and body["model"] == want, body
    for user in ALPHA_CANARY_USERS:  # v2 current now (if good): v1 still serves the canary share
        status, body = await complete(client, "alpha", user)
        assert status == 200 and body["model"] == "alpha@v1", body
    assert (await tiers(client))["v2"] == ("gpu" if v2_file == "good" else "none")
