"""A new stable version that registers but fails to load: the version it was to replace keeps serving
(worker/served_adapters.py), against an engine-like stand-in and over HTTP with the real engine; and the
request metrics of a rollout, per version."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.worker.app_keys import CONFIG, METRICS
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig
from tests.worker.test_served_adapters import ACME, SQL, SQL_CANARY, RecordingHost, state
from tests.worker.test_served_metrics import hold_outputs

SQL_V2 = SQL | {"stable": {"version": "v2", "uri": "/c/sql/v2"}}
USERS = [f"u{i}" for i in range(40)]


class SwitchingHost(RecordingHost):
    """Versions as the engine's pool keeps them: a new version registered as current replaces the current one
    only once it has loaded (`loaded`), and the current one registered again as a canary meanwhile stays
    registered after; a promoted canary replaces it at once (with `if_resident`, only if on the GPU, else once
    loaded); the current one cannot be removed by version."""

    def __init__(self) -> None:
        super().__init__()
        self.current: dict[str, str] = {}
        self.pending: dict[str, str] = {}
        self.kept: dict[str, str] = {}  # name -> the key kept registered if current when the pending one switches

    def register_adapter(self, name, source, *, version=None, tenant=None, pinned=False, make_current=True,
                         sha256=None, keep_previous=None):
        key = super().register_adapter(name, source, version=version, tenant=tenant, pinned=pinned,
                                       make_current=make_current, sha256=sha256, keep_previous=keep_previous)
        if name not in self.current:
            self.current[name] = key
        elif make_current and self.current[name] != key:
            self.pending[name] = key
            self.kept.pop(name, None)
            if keep_previous is not None:
                self.kept[name] = keep_previous
        elif not make_current and self.current[name] == key and name in self.pending:
            self.kept[name] = key
        return key

    def make_adapter_current(self, key, *, if_resident=False, keep_previous=None):
        super().make_adapter_current(key, if_resident=if_resident, keep_previous=keep_previous)
        name = key.partition("@")[0]
        if if_resident and self.keys[key]["tier"] != "gpu" and self.current.get(name) != key:
            self.pending[name] = key  # evicted meanwhile: current once it has loaded (`loaded`)
            self.kept.pop(name, None)
            if keep_previous is not None:
                self.kept[name] = keep_previous
            return False
        self.kept.pop(name, None)
        if keep_previous is not None:
            self.kept[name] = keep_previous
        self._switch(key)
        return True

    def loaded(self, key):
        if self.pending.get(key.partition("@")[0]) == key:
            self._switch(key)

    def _switch(self, key):
        name = key.partition("@")[0]
        old, self.current[name] = self.current.get(name), key
        self.pending.pop(name, None)
        if old not in (None, key, self.kept.pop(name, None)):
            self.keys.pop(old)  # retired, no request holds it

    def remove_adapter_version(self, key):
        if self.current.get(key.partition("@")[0]) == key:
            raise ValueError(f"{key} is the current version")
        if key not in self.keys:
            raise KeyError(key)
        super().remove_adapter_version(key)

    def describe_adapters(self):
        return [d | {"current": self.current.get(d["name"]) == d["key"]} for d in super().describe_adapters()]


def picks(served: ServedAdapters) -> set[str]:
    return {served.resolve("sql", ACME, u) for u in USERS}


def test_a_new_stable_that_fails_to_load_sends_its_requests_back_to_the_previous_version():
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    served.apply(state(2, SQL_V2), host)
    assert picks(served) == {"sql@v2"}  # it serves (it loads on first use) ...
    assert host.current["sql"] == "sql@v1" and {a.version for a in served.report(host).adapters} == {"v1", "v2"}
    assert served.extras()["sql@v1"]["traffic_percent"] == 0
    served.mark_failed("sql@v2", "adapter_model.safetensors: truncated")  # ... until its load fails
    assert picks(served) == {"sql@v1"}
    with pytest.raises(APIError, match="truncated") as exc:  # naming the failed version says why
        served.resolve("sql@v2", ACME, None)
    assert exc.value.status == 503
    assert served.extras()["sql@v1"]["traffic_percent"] == 100
    assert {a.version: a.error for a in served.report(host).adapters} == {
        "v1": None, "v2": "adapter_model.safetensors: truncated"}

    served.apply(state(3, SQL_V2), host)  # the same push again: v2 is retried, v1 stays the fallback
    assert picks(served) == {"sql@v2"} and ("remove", "sql@v1") not in host.calls
    served.mark_failed("sql@v2", "adapter_model.safetensors: truncated")
    assert picks(served) == {"sql@v1"}

    served.apply(state(4, SQL_V2), host)
    host.loaded("sql@v2")  # it loads this time: the engine retires v1 ...
    assert [a.version for a in served.report(host).adapters] == ["v2"]
    served.apply(state(5, SQL_V2), host)  # ... and the next push does too
    assert served.get("sql").sources == {"v2": "/c/sql/v2"} and served.get("sql").fallback is None
    served.mark_failed("sql@v2", "disk read failed")  # nothing left to fall back to
    with pytest.raises(APIError, match="disk read failed"):
        served.resolve("sql", ACME, None)


def test_a_push_while_the_new_stable_loads_keeps_the_version_serving_as_the_fallback():
    """v2 never loaded and v3 replaces it: the engine still serves v1, which stays the fallback."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    served.apply(state(2, SQL_V2), host)
    served.apply(state(3, SQL | {"stable": {"version": "v3", "uri": "/c/sql/v3"}}), host)
    assert set(served.get("sql").sources) == {"v1", "v3"} and ("remove", "sql@v2") in host.calls
    served.mark_failed("sql@v3", "truncated")
    assert picks(served) == {"sql@v1"}


def test_a_promoted_canary_replaces_the_stable_version_at_once():
    """Promoting a canary switches the engine now: the old stable version is gone, not a fallback."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL_CANARY), host)
    served.apply(state(2, SQL_V2), host)
    assert set(served.get("sql").sources) == {"v2"} and "sql@v1" not in host.keys
    served.mark_failed("sql@v2", "truncated")
    with pytest.raises(APIError) as exc:
        served.resolve("sql", ACME, None)
    assert exc.value.status == 503


# ---- over HTTP, the real engine: a version that registers but cannot be placed on the device ----------------
ADMIN = "admin-token-for-tests"


def metric_samples(text: str, name: str, adapter: str) -> dict[tuple, float]:
    """(version, status) -> value of `name`'s samples of `adapter` (status "" where the series has none), summed
    over endpoints"""
    out: dict[tuple, float] = {}
    for s in (s for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == name and s.labels.get("adapter") == adapter):
        key = (s.labels["version"], s.labels.get("status", ""))
        out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, qv_adapters_dir, tmp_path):
    from tests.lora_factory import make_peft_adapter

    # 32 pages of the pool: above the 8 that adapters may use, so it registers but never loads.
    make_peft_adapter(tiny_llama_dir, tmp_path / "big", rank=32, seed=3)
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128, max_adapter_pages=8)
    config = WorkerConfig(engine=engine, served_model_name="tiny", admin_token=ADMIN,  # latencies per version
                          adapter_roots=f"{qv_adapters_dir},{tmp_path}", adapter_latency_series="all")
    return await aiohttp_client(create_app(config))


async def push(client, generation: int, stable: dict, **extra) -> dict:
    body = {"generation": generation, "adapters": [{"name": "alpha", "tenant": "acme", "stable": stable, **extra}]}
    resp = await client.put("/admin/v1/state", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def complete(client, model: str, user: str = "u") -> tuple[int, dict]:
    resp = await client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, "user": user})
    return resp.status, await resp.json()


async def test_a_new_stable_version_that_fails_to_load_leaves_the_old_one_serving_over_http(
        client, qv_adapters_dir, tmp_path):
    await push(client, 1, {"version": "v1", "uri": str(qv_adapters_dir / "alpha")})
    status, body = await complete(client, "alpha")
    assert status == 200 and body["model"] == "alpha@v1"
    await push(client, 2, {"version": "v2", "uri": str(tmp_path / "big")})
    status, body = await complete(client, "alpha")  # the request that finds out v2 cannot load runs on v1
    assert status == 200 and body["model"] == "alpha@v1", body
    for user in ("u1", "u2", "u3"):
        status, body = await complete(client, "alpha", user)
        assert status == 200 and body["model"] == "alpha@v1", body
    status, body = await complete(client, "alpha@v2")
    assert status == 503 and "pages" in body["error"]["message"]
    report = await (await client.get("/admin/v1/state", headers={"Authorization": f"Bearer {ADMIN}"})).json()
    traffic = {a["version"]: (a["traffic_percent"], bool(a["error"])) for a in report["adapters"]}
    assert traffic == {"v1": (100, False), "v2": (0, True)}

    text = await (await client.get("/metrics")).text()
    requests = metric_samples(text, "lorafleet_requests_total", "alpha")
    # v2's failures show on v2: the request that found out (answered by v1, so counted there as well) and the
    # one naming alpha@v2 (refused as it resolved, not as an unresolved request).
    # (with the series made at 0 for the rollout)
    assert {k: v for k, v in requests.items() if v} == {("v1", "200"): 5, ("v2", "503"): 2}, requests
    assert metric_samples(text, "lorafleet_requests_total", "__unresolved__") == {}


async def test_a_request_naming_the_version_that_cannot_load_is_refused_a_streamed_one_moves(
        client, qv_adapters_dir, tmp_path):
    """Only a request that named no version moves to the fallback; one streamed moves before its first byte."""
    await push(client, 1, {"version": "v1", "uri": str(qv_adapters_dir / "alpha")})
    assert (await complete(client, "alpha"))[0] == 200
    big = {"version": "v2", "uri": str(tmp_path / "big")}
    await push(client, 2, big)
    status, body = await complete(client, "alpha@v2")  # the request that finds out, naming v2
    assert status == 503 and body["error"]["code"] == "adapter_load_failed" and "pages" in body["error"]["message"]
    assert (await complete(client, "alpha"))[1]["model"] == "alpha@v1"

    await push(client, 3, big)  # v2 tried again: bare requests resolve to it until its load fails again
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 2,
                                                      "stream": True})
    text = await resp.text()
    assert resp.status == 200 and resp.headers["X-Lorafleet-Adapter"] == "alpha@v1", text
    chunks = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and all('"model":"alpha@v1"' in c for c in chunks[:-1]), chunks


@pytest.mark.parametrize("rollout", ["swap", "promote"])
async def test_a_canary_in_memory_that_cannot_be_placed_is_not_switched_to_over_http(
        client, qv_adapters_dir, tmp_path, rollout):
    """The canary v2 registered (its copy in CPU memory) but needs more pages than an adapter may have. Made
    stable (swapped with v1, or promoted), it became current at once: v1 retired, and the requests of every
    user but the canary's were answered 503 until the next push. v1 serves until v2 is on the GPU."""
    v1 = {"version": "v1", "uri": str(qv_adapters_dir / "alpha")}
    big = {"version": "v2", "uri": str(tmp_path / "big")}
    await push(client, 1, v1, canary=big, canary_weight=10)
    assert (await complete(client, "alpha@v1"))[0] == 200
    report = await (await client.get("/admin/v1/state", headers={"Authorization": f"Bearer {ADMIN}"})).json()
    assert {a["version"]: a["tier"] for a in report["adapters"]} == {"v1": "gpu", "v2": "cpu"}
    await push(client, 2, big, **({"canary": v1, "canary_weight": 10} if rollout == "swap" else {}))
    answers = set()
    for i in range(20):
        status, body = await complete(client, "alpha", f"user-{i}")
        answers.add((status, body.get("model") or body["error"]["code"]))
    assert answers == {(200, "alpha@v1")}


async def test_a_request_that_moved_holds_the_series_of_the_version_it_runs_on(
        client, qv_adapters_dir, tmp_path, monkeypatch):
    """A bare request whose version (v2) cannot load moves to the fallback v1 and runs there. Pushes retire v1
    meanwhile and its grace passes: the series the request counts on must stay until it has counted (it
    held only v2's, the version it resolved to on arrival), and go after the grace that follows."""
    now = [0.0]
    client.app[METRICS].retired.clock = lambda: now[0]
    grace = client.app[CONFIG].retired_series_grace_s
    await push(client, 1, {"version": "v1", "uri": str(qv_adapters_dir / "alpha")})
    assert (await complete(client, "alpha"))[1]["model"] == "alpha@v1"
    await push(client, 2, {"version": "v2", "uri": str(tmp_path / "big")})
    started, go_on = hold_outputs(client, monkeypatch, lambda adapter: adapter == "alpha@v1")
    request = asyncio.ensure_future(client.post("/v1/completions", json={
        "model": "alpha", "prompt": "x", "max_tokens": 4, "ignore_eos": True, "user": "mover"}))
    await asyncio.wait_for(started.wait(), 60)  # moved to v1, running there
    v3 = {"version": "v3", "uri": str(qv_adapters_dir / "beta")}
    await push(client, 3, v3)
    assert (await complete(client, "alpha@v3"))[0] == 200  # v3 has loaded: the engine retires v1
    await push(client, 4, v3)  # the table drops v1: its series retire
    now[0] += grace + 1
    assert ("v1", "200") in metric_samples(await (await client.get("/metrics")).text(), "lorafleet_requests_total",
                                           "alpha")
    go_on.set()
    resp = await asyncio.wait_for(request, 60)
    assert resp.status == 200 and (await resp.json())["model"] == "alpha@v1"
    text = await (await client.get("/metrics")).text()
    assert metric_samples(text, "lorafleet_requests_total", "alpha")[("v1", "200")] == 2
    assert metric_samples(text, "lorafleet_time_to_first_token_seconds_count", "alpha")[("v1", "")] == 2
    now[0] += grace + 1  # counted, its grace over: v1's series go (the request holds nothing any more)
    text = await (await client.get("/metrics")).text()
    assert {v for v, _ in metric_samples(text, "lorafleet_requests_total", "alpha")} == {"v3"}


async def test_request_metrics_tell_canary_from_stable_and_forget_retired_versions_over_http(
        client, qv_adapters_dir):
    v1, v2 = ({"version": v, "uri": str(qv_adapters_dir / d)} for v, d in (("v1", "alpha"), ("v2", "beta")))
    await push(client, 1, v1, canary=v2, canary_weight=50)
    models = {(await complete(client, "alpha", f"user-{i}"))[1]["model"] for i in range(16)}
    assert models == {"alpha@v1", "alpha@v2"}
    text = await (await client.get("/metrics")).text()
    for name in ("lorafleet_requests_total", "lorafleet_time_to_first_token_seconds_count",
                 "lorafleet_e2e_request_latency_seconds_count", "lorafleet_generation_tokens_total",
                 "lorafleet_prompt_tokens_total"):
        assert {version for version, _ in metric_samples(text, name, "alpha")} == {"v1", "v2"}, name

    await push(client, 2, v2)  # v2 promoted: v1 retired
    status, body = await complete(client, "alpha")
    assert status == 200 and body["model"] == "alpha@v2"
    retired = client.app[METRICS].retired
    retired.clock = lambda: time.monotonic() + retired.grace_s  # v1's grace (for a last scrape) is over
    text = await (await client.get("/metrics")).text()
    assert {version for version, _ in metric_samples(text, "lorafleet_requests_total", "alpha")} == {"v2"}
    assert metric_samples(text, "lorafleet_requests_total", "__unresolved__") == {}
    status, _ = await complete(client, "nope")
    text = await (await client.get("/metrics")).text()
    assert metric_samples(text, "lorafleet_requests_total", "__unresolved__") == {("", "404"): 1}


def test_a_promoted_canary_switches_only_once_the_push_is_published():
    """Promoting sql's canary retires v1 in the engine; if that happened while the push still registered other
    adapters, bare `sql` requests, still sent to v1 by the table in force, failed (404 after their retries)."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL_CANARY), host)
    seen: list[tuple[set[str], set[str]]] = []  # (what bare requests resolve to, what the engine holds)
    register = host.register_adapter

    def register_watching(name, source, **kw):
        if name == "zeta":  # registered after sql in the same push
            seen.append((picks(served), set(host.keys)))
        return register(name, source, **kw)

    host.register_adapter = register_watching
    promoted = SQL | {"stable": {"version": "v2", "uri": "/c/sql/v2"}}
    zeta = {"name": "zeta", "tenant": "acme", "stable": {"version": "v1", "uri": "/c/zeta/v1"}}
    served.apply(state(2, promoted, zeta), host)
    (resolved, held), = seen
    assert resolved <= held, f"requests sent to {resolved - held}, which the engine no longer holds"
    assert picks(served) == {"sql@v2"} and host.current["sql"] == "sql@v2" and "sql@v1" not in host.keys


@pytest.mark.parametrize("tier", ["disk", "cpu"])
def test_a_promoted_canary_that_never_loaded_replaces_the_stable_version_only_once_loaded(tier):
    """A canary no user reached (weight 0) is promoted: like a new stable version it becomes current once it
    has loaded, v1 kept as the fallback meanwhile; if its load fails, bare requests go back to v1. Also when
    its copy is in CPU memory: it may never fit on the GPU."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL | {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 0}), host)
    host.keys["sql@v2"]["tier"] = tier  # registered, its files never read (disk), or only read (cpu)
    served.apply(state(2, SQL_V2), host)
    assert host.current["sql"] == "sql@v1" and host.pending["sql"] == "sql@v2"
    assert picks(served) == {"sql@v2"} and served.get("sql").fallback == "v1"
    served.mark_failed("sql@v2", "adapter_model.safetensors: truncated")
    assert picks(served) == {"sql@v1"}

    host, served = SwitchingHost(), ServedAdapters("base")  # the same, and its load succeeds
    served.apply(state(1, SQL | {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 0}), host)
    host.keys["sql@v2"]["tier"] = tier
    served.apply(state(2, SQL_V2), host)
    host.loaded("sql@v2")
    assert host.current["sql"] == "sql@v2" and "sql@v1" not in host.keys and picks(served) == {"sql@v2"}


def test_a_promoted_canary_that_cannot_be_registered_as_current_sends_requests_back_to_the_old_version():
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL | {"canary": {"version": "v2", "uri": "/c/sql/v2"}, "canary_weight": 0}), host)
    host.keys["sql@v2"]["tier"] = "disk"
    host.failing = {"/c/sql/v2"}  # e.g. its files changed under it: the digest no longer matches
    served.apply(state(2, SQL_V2), host)
    assert host.current["sql"] == "sql@v1" and picks(served) == {"sql@v1"}
    assert "corrupt" in served.get("sql").errors["v2"]


async def test_the_series_of_a_rollout_s_fallback_go_once_the_new_version_served(client, qv_adapters_dir):
    """{v1}, then {v2}: once a request ran on v2 the engine has retired v1 (the fallback until then), and its
    series go after their grace. They stayed until the next push (the table still lists the fallback)."""
    v1, v2 = ({"version": v, "uri": str(qv_adapters_dir / d)} for v, d in (("v1", "alpha"), ("v2", "beta")))
    await push(client, 1, v1)
    assert (await complete(client, "alpha"))[1]["model"] == "alpha@v1"
    await push(client, 2, v2)
    status, body = await complete(client, "alpha")
    assert status == 200 and body["model"] == "alpha@v2"
    retired = client.app[METRICS].retired
    retired.clock = lambda: time.monotonic() + retired.grace_s  # v1's grace (for a last scrape) is over
    await complete(client, "alpha")
    text = await (await client.get("/metrics")).text()
    assert {version for version, _ in metric_samples(text, "lorafleet_requests_total", "alpha")} == {"v2"}


async def test_the_series_of_a_fallback_kept_as_the_canary_stay_after_the_new_version_served(client, qv_adapters_dir):
    """{v1}, then {v2, canary v1}: v1 is the fallback and also the canary, still served to its share of users. A
    request on v2 retired v1's series (restored at v1's next request: counters reset after a quiet grace)."""
    v1, v2 = ({"version": v, "uri": str(qv_adapters_dir / d)} for v, d in (("v1", "alpha"), ("v2", "beta")))
    await push(client, 1, v1)
    assert (await complete(client, "alpha"))[1]["model"] == "alpha@v1"
    await push(client, 2, v2, canary=v1, canary_weight=50)
    models = {(await complete(client, "alpha", f"user-{i}"))[1]["model"] for i in range(12)}
    assert models == {"alpha@v1", "alpha@v2"}
    on_v2 = [f"user-{i}" for i in range(12) if (await complete(client, "alpha", f"user-{i}"))[1]["model"] == "alpha@v2"]
    await complete(client, "alpha", on_v2[0])
    retired = client.app[METRICS].retired
    retired.clock = lambda: time.monotonic() + retired.grace_s  # a quiet spell on the canary, longer than the grace
    await complete(client, "alpha", on_v2[0])
    text = await (await client.get("/metrics")).text()
    assert {version for version, _ in metric_samples(text, "lorafleet_requests_total", "alpha")} == {"v1", "v2"}


def test_a_load_failure_recorded_while_a_push_applies_is_not_lost():
    """v2 (replacing v1) fails to load after the push read its name and before the push published its table:
    the failure went to the table being replaced, and is recorded again on the new one, so bare requests stay
    on v1 and `sql@v2` answers the failure."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    served.apply(state(2, SQL_V2), host)
    priority = host.set_adapter_priority

    def failing_meanwhile(key, value):  # a request's load of v2 fails while the push runs
        priority(key, value)
        if key == "sql@v2":
            served.mark_failed(key, "adapter_model.safetensors: truncated")

    host.set_adapter_priority = failing_meanwhile
    served.apply(state(3, SQL_V2), host)
    assert host.calls.count(("register", "sql@v2", True)) == 1  # kept by push 3, not registered again
    assert picks(served) == {"sql@v1"} and "truncated" in served.get("sql").errors["v2"]
    with pytest.raises(APIError, match="truncated"):
        served.resolve("sql@v2", ACME, None)


def test_a_version_a_push_registers_again_after_a_failure_meanwhile_is_not_marked_failed():
    """While push 2 reads the new stable v2's files, a request's load of the canary c1 fails. The push then
    finds c1 failed and registers it again (a retry): the failure it has answered is not recorded again on the
    new table, and c1 stays registered and serves its share."""
    c1 = SQL | {"canary": {"version": "c1", "uri": "/c/sql/c1"}, "canary_weight": 50}
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, c1), host)
    host.loaded("sql@v1")
    register = host.register_adapter

    def reading_files(name, source, **kw):
        if kw.get("version") == "v2":
            served.mark_failed("sql@c1", "c1: truncated")
        return register(name, source, **kw)

    host.register_adapter = reading_files
    served.apply(state(2, c1 | {"stable": {"version": "v2", "uri": "/c/sql/v2"}}), host)
    assert host.calls.count(("register", "sql@c1", False)) == 2  # registered again by push 2: a retry
    assert "c1" not in served.get("sql").errors and ("remove", "sql@c1") not in host.calls
    assert served.get("sql").split.canary == "c1"


def test_a_failure_meanwhile_of_a_version_the_push_registered_again_for_a_swap_is_kept():
    """{stable v1, canary v2 in CPU memory} swapped to {stable v2, canary v1}: v2 is registered again as current
    (not on the GPU), and the load that starts fails while the push registers v1 as the canary. The failure,
    written to the table being replaced, is recorded on the new one: users go back to v1."""
    swapped = SQL | {"stable": {"version": "v2", "uri": "/c/sql/v2"},
                     "canary": {"version": "v1", "uri": "/c/sql/v1"}, "canary_weight": 50}
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL_CANARY), host)
    host.keys["sql@v2"]["tier"] = "cpu"
    register = host.register_adapter

    def failing_meanwhile(name, source, **kw):
        if kw.get("version") == "v1":  # after v2's registration in this push
            served.mark_failed("sql@v2", "adapter_model.safetensors: truncated")
        return register(name, source, **kw)

    host.register_adapter = failing_meanwhile
    served.apply(state(2, swapped), host)
    assert "truncated" in served.get("sql").errors["v2"] and picks(served) == {"sql@v1"}


def test_a_promoted_canary_that_failed_meanwhile_is_not_made_current():
    """A canary in CPU memory promoted to stable fails to load while the push runs: the replayed failure sends
    users to v1, and the push does not then register v2 as current (v1 would retire under them)."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL_CANARY), host)
    host.keys["sql@v2"]["tier"] = "cpu"
    warm = host.set_adapter_warm

    def failing_meanwhile(key, value):
        warm(key, value)
        if key == "sql@v2":
            served.mark_failed("sql@v2", "adapter_model.safetensors: truncated")

    host.set_adapter_warm = failing_meanwhile
    host.calls.clear()
    served.apply(state(2, SQL | {"stable": {"version": "v2", "uri": "/c/sql/v2"}}), host)
    assert "truncated" in served.get("sql").errors["v2"] and picks(served) == {"sql@v1"}
    assert ("register", "sql@v2", True) not in host.calls and host.current["sql"] == "sql@v1"
