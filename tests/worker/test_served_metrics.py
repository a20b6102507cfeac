"""Request metrics follow the served table: a name that a push no longer lists, or that is unloaded, takes
every series of it along (with tenants' adapters coming and going, /metrics would otherwise only grow), and
a version a push retires takes its own. They go once no request holds the version and its grace
(--retired-series-grace-s) is over, so that a scrape reads the counts of requests that finished on a
rolled-back canary after the push. The base model's and the unresolved requests' series stay."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorafleet.worker.app_keys import CONFIG, ENGINE, METRICS
from lorafleet.worker.engine import ShutdownError
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

ADMIN = "admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir, qv_adapters_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)
    config = WorkerConfig(engine=engine, served_model_name="tiny", admin_token=ADMIN,  # latencies per version
                          adapter_roots=str(qv_adapters_dir), adapter_latency_series="all")
    return await aiohttp_client(create_app(config))


class Clock:
    """The clock of the retired series' grace, moved by hand."""

    def __init__(self, grace_s: float) -> None:
        self.now, self.grace_s = 0.0, grace_s

    def __call__(self) -> float:
        return self.now

    def pass_grace(self) -> None:
        self.now += self.grace_s


@pytest.fixture
def clock(client) -> Clock:
    c = Clock(client.app[CONFIG].retired_series_grace_s)
    client.app[METRICS].retired.clock = client.app[METRICS].rolled_out.clock = c
    return c


async def push(client, generation: int, root, *names: str) -> None:
    body = {"generation": generation, "adapters": [
        {"name": n, "tenant": "acme", "stable": {"version": "v1", "uri": str(root / n)}} for n in names]}
    resp = await client.put("/admin/v1/state", json=body, headers=AUTH)
    assert resp.status == 200, await resp.text()


async def complete(client, model: str, **extra) -> int:
    resp = await client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, **extra})
    await resp.read()
    return resp.status


async def adapter_labels(client) -> set[str]:
    """The `adapter` label of every request series in /metrics."""
    text = await (await client.get("/metrics")).text()
    return {s.labels["adapter"] for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("lorafleet_") and "adapter" in s.labels}


async def test_series_of_names_a_push_or_an_unload_removes_are_dropped(client, clock, qv_adapters_dir):
    await push(client, 1, qv_adapters_dir, "alpha", "beta")
    for model in ("alpha", "beta", "tiny"):
        assert await complete(client, model) == 200
    assert await complete(client, "nope") == 404
    assert await adapter_labels(client) == {"alpha", "beta", "__base__", "__unresolved__"}

    await push(client, 2, qv_adapters_dir, "alpha")  # beta unregistered
    assert "beta" in await adapter_labels(client)  # its final counts, until the grace is over
    clock.pass_grace()
    assert await adapter_labels(client) == {"alpha", "__base__", "__unresolved__"}

    resp = await client.post("/v1/load_lora_adapter", headers=AUTH,
                             json={"lora_name": "gamma", "lora_path": str(qv_adapters_dir / "beta")})
    assert resp.status == 200, await resp.text()
    assert await complete(client, "gamma") == 200
    assert "gamma" in await adapter_labels(client)
    resp = await client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "gamma"})
    assert resp.status == 200, await resp.text()
    clock.pass_grace()
    assert await adapter_labels(client) == {"alpha", "__base__", "__unresolved__"}


def hold_outputs(client, monkeypatch, holds) -> tuple[asyncio.Event, asyncio.Event]:
    """Requests on an adapter key `holds` accepts stop after their first output (`started` set) until
    `go_on` is set: a push can land while they run."""
    engine = client.app[ENGINE]
    started, go_on = asyncio.Event(), asyncio.Event()
    real_generate = engine.generate

    async def held(request_id, prompt, params, adapter, tenant=None):
        async for out in real_generate(request_id, prompt, params, adapter, tenant=tenant):
            yield out
            if adapter is not None and holds(adapter):
                started.set()
                await go_on.wait()

    monkeypatch.setattr(engine, "generate", held)
    return started, go_on


async def test_a_request_that_finishes_after_its_name_went_is_counted_then_dropped(client, clock, qv_adapters_dir,
                                                                                     monkeypatch):
    """The request holds its version to the end, then counts; its name is gone by then, so its series go
    after the grace that lets a scrape read that count."""
    await push(client, 1, qv_adapters_dir, "alpha", "beta")
    started, go_on = hold_outputs(client, monkeypatch, lambda adapter: adapter.startswith("beta@"))
    request = asyncio.ensure_future(complete(client, "beta", max_tokens=4, ignore_eos=True))
    await asyncio.wait_for(started.wait(), 30)
    await push(client, 2, qv_adapters_dir, "alpha")
    clock.pass_grace()  # the request still runs: its series stay
    assert "beta" in await adapter_labels(client)
    go_on.set()
    assert await asyncio.wait_for(request, 30) == 200
    assert await request_counts(client, "beta") == {"200": 1}
    clock.pass_grace()
    assert "beta" not in await adapter_labels(client)


async def push_versions(client, generation: int, root, stable: str, canary: str | None = None) -> None:
    """Adapter `alpha` at version `stable`, with `canary` at 50 % (all versions from alpha's folder)."""
    d = {"name": "alpha", "tenant": "acme", "stable": {"version": stable, "uri": str(root / "alpha")}}
    if canary is not None:
        d |= {"canary": {"version": canary, "uri": str(root / "alpha")}, "canary_weight": 50}
    resp = await client.put("/admin/v1/state", json={"generation": generation, "adapters": [d]}, headers=AUTH)
    assert resp.status == 200, await resp.text()


async def version_labels(client, adapter: str) -> set[str]:
    """The `version` label of every request series of `adapter` in /metrics."""
    text = await (await client.get("/metrics")).text()
    return {s.labels["version"] for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("lorafleet_") and s.labels.get("adapter") == adapter}


async def test_series_of_versions_a_push_retires_are_dropped_after_their_grace(client, clock, qv_adapters_dir):
    """A rolled-back canary's series, and the old stable's once a canary is promoted, go once the grace
    after the push that retired the version is over (a scrape reads their last counts first), not when
    the next request for the adapter happens to arrive."""
    await push_versions(client, 1, qv_adapters_dir, "v1", canary="v2")
    for model in ("alpha@v1", "alpha@v2"):
        assert await complete(client, model) == 200
    assert await version_labels(client, "alpha") == {"v1", "v2"}
    await push_versions(client, 2, qv_adapters_dir, "v1")  # the canary rolled back
    assert await version_labels(client, "alpha") == {"v1", "v2"}
    clock.pass_grace()
    assert await version_labels(client, "alpha") == {"v1"}
    await push_versions(client, 3, qv_adapters_dir, "v1", canary="v3")
    assert await complete(client, "alpha@v3") == 200
    await push_versions(client, 4, qv_adapters_dir, "v3")  # the canary promoted: v1 retires
    clock.pass_grace()
    assert await version_labels(client, "alpha") == {"v3"}


async def version_counts(client, adapter: str) -> dict[tuple[str, str], float]:
    """(version, status) -> lorafleet_requests_total of `adapter`, summed over endpoints."""
    text = await (await client.get("/metrics")).text()
    counts: dict[tuple[str, str], float] = {}
    for s in samples(text, "lorafleet_requests_total"):
        if s.labels["adapter"] == adapter:
            key = (s.labels["version"], s.labels["status"])
            counts[key] = counts.get(key, 0.0) + s.value
    return counts


async def test_a_request_in_flight_on_a_rolled_back_canary_is_counted(client, clock, qv_adapters_dir, monkeypatch):
    """The push that rolls the canary back lands while a request runs on it: that request (the kind of
    failure a rollback follows) is counted on the canary when it finishes and a scrape can read it; the
    canary's series go only after the grace that follows it."""
    await push_versions(client, 1, qv_adapters_dir, "v1", canary="v2")
    started, go_on = hold_outputs(client, monkeypatch, lambda adapter: adapter == "alpha@v2")
    request = asyncio.ensure_future(complete(client, "alpha@v2", max_tokens=4, ignore_eos=True))
    await asyncio.wait_for(started.wait(), 30)
    await push_versions(client, 2, qv_adapters_dir, "v1")
    clock.pass_grace()  # longer than the grace, but the request holds the version
    assert "v2" in await version_labels(client, "alpha")
    go_on.set()
    assert await asyncio.wait_for(request, 30) == 200
    counts = await version_counts(client, "alpha")
    assert {k: v for k, v in counts.items() if v} == {("v2", "200"): 1}  # beside the rollout's 5xx series at 0
    assert await completed_latencies(client, "alpha") == 1
    clock.pass_grace()
    assert await version_labels(client, "alpha") == set()


def samples(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


async def request_counts(client, adapter: str) -> dict[str, float]:
    """status -> lorafleet_requests_total of `adapter`'s completions."""
    text = await (await client.get("/metrics")).text()
    return {s.labels["status"]: s.value for s in samples(text, "lorafleet_requests_total")
            if s.labels["adapter"] == adapter and s.labels["endpoint"] == "completions"}


async def completed_latencies(client, adapter: str) -> float:
    """How many requests of `adapter` the end-to-end latency histogram recorded."""
    text = await (await client.get("/metrics")).text()
    return sum(s.value for s in samples(text, "lorafleet_e2e_request_latency_seconds_count")
               if s.labels["adapter"] == adapter)


def fail_after_first_output(client, monkeypatch, exc: Exception) -> None:
    """Requests on an adapter fail with `exc` right after their first output (the stream has started)."""
    engine = client.app[ENGINE]
    real_generate = engine.generate

    async def failing(request_id, prompt, params, adapter, tenant=None):
        async for out in real_generate(request_id, prompt, params, adapter, tenant=tenant):
            yield out
            if adapter is not None:
                raise exc

    monkeypatch.setattr(engine, "generate", failing)


@pytest.mark.parametrize(("exc", "status"), [(RuntimeError("the device fell over"), "500"),
                                             (ShutdownError("the worker is shutting down"), "503")])
async def test_a_stream_that_fails_after_its_headers_counts_as_its_error(client, qv_adapters_dir, monkeypatch,
                                                                         exc, status):
    """Its 200 went with the headers, but the answer is the in-band error: /metrics counts the error's status
    (5xx, which the canary's comparison with stable reads) and no completion latency."""
    await push(client, 1, qv_adapters_dir, "alpha")
    assert await complete(client, "alpha") == 200
    assert await request_counts(client, "alpha") == {"200": 1} and await completed_latencies(client, "alpha") == 1
    fail_after_first_output(client, monkeypatch, exc)
    resp = await client.post("/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 4,
                                                      "ignore_eos": True, "stream": True})
    assert resp.status == 200
    events = [line[6:] for line in (await resp.text()).split("\n") if line.startswith("data: ")]
    assert "error" in json.loads(events[-1]) and "[DONE]" not in events
    assert await request_counts(client, "alpha") == {"200": 1, status: 1}
    assert await completed_latencies(client, "alpha") == 1


async def test_a_context_too_long_on_a_resolved_adapter_is_counted_on_it(client, qv_adapters_dir):
    """The adapter was resolved before the prompt was tokenized: its 400 is counted on its version, not as
    an unresolved request."""
    await push(client, 1, qv_adapters_dir, "alpha")
    for body in ({"prompt": "x" * 200}, {"prompt": "x", "max_tokens": 500}):
        resp = await client.post("/v1/completions", json={"model": "alpha", "max_tokens": 2} | body)
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "context_length_exceeded"
    text = await (await client.get("/metrics")).text()
    counted = {(s.labels["adapter"], s.labels["version"], s.labels["status"]): s.value
               for s in samples(text, "lorafleet_requests_total")}
    assert counted == {("alpha", "v1", "400"): 2, ("alpha", "v1", "200"): 0}  # made at 0 when it resolved
