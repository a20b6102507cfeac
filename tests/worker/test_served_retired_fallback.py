"""A fallback the table keeps after the engine retired it (the new stable version loaded and the engine
switched to it, no push since). A load failure of the new version that cannot pass by itself then has
nothing to fall back to: it is the answer (503 `adapter_load_failed`), as for a name without a fallback,
not a 404 `model_not_found` from sending bare requests to the retired version."""

from __future__ import annotations

import shutil

import pytest

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.app_keys import ENGINE
from lorafleet.worker.engine import UnknownAdapterError
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.served_adapters import ServedAdapters
from tests.worker.test_job_outputs import job_for, outputs
from tests.worker.test_served_adapters import ACME, SQL, state
from tests.worker.test_served_fallback import SQL_V2, SwitchingHost, client, complete, push  # noqa: F401


def switched_rollout() -> tuple[SwitchingHost, ServedAdapters]:
    """sql v1 -> v2 pushed; v2 loaded since, so the engine switched and retired v1; no push since."""
    host, served = SwitchingHost(), ServedAdapters("base")
    served.apply(state(1, SQL), host)
    served.apply(state(2, SQL_V2), host)
    host.loaded("sql@v2")
    assert "sql@v1" not in host.keys and served.get("sql").fallback == "v1"  # the stale fallback
    return host, served


def test_a_failure_after_the_switch_does_not_send_requests_to_the_retired_fallback():
    host, served = switched_rollout()
    served.mark_failed("sql@v2", "its content changed since it was first loaded")
    with pytest.raises(APIError) as exc:  # nothing left to fall back to: as without a fallback
        key = served.resolve("sql", ACME, None)
        pytest.fail(f"resolved to {key}, which the engine holds: {key in host.keys}")
    assert exc.value.status == 503 and exc.value.code == "adapter_load_failed"


def test_the_retired_fallback_is_neither_listed_nor_resolved_by_its_version():
    """Until the next push the table keeps v1 as the fallback, but the engine retired it: a request naming
    sql@v1 is answered as for a version that is not there (404 listing the others), never resolved only for the
    engine to refuse it with "retry"; /v1/models lists v2 alone."""
    from lorafleet.worker.served_fallback import listed_versions

    host, served = switched_rollout()
    with pytest.raises(APIError) as exc:
        served.resolve("sql@v1", ACME, None)
    assert exc.value.status == 404 and "has no version 'v1' here (versions: v2)" in exc.value.message
    assert listed_versions(served.get("sql"), host) == ["v2"] and served.resolve("sql@v2", ACME, None) == "sql@v2"


class FailingEngine:
    """The engine after the switch: sql@v2 fails to load for good (its files changed), sql@v1 is gone."""

    async def generate(self, request_id, prompt, params, adapter, tenant=None):
        if adapter == "sql@v2":
            raise AdapterLoadError(adapter, "its content changed since it was first loaded", retryable=False)
        if adapter == "sql@v1":
            raise UnknownAdapterError(f"adapter {adapter!r} is not registered")
        yield adapter


async def test_a_bare_request_gets_the_load_failure_not_an_unknown_adapter():
    _, served = switched_rollout()
    job = job_for(served, "sql")
    with pytest.raises(Exception) as exc:
        await outputs(FailingEngine(), job, served)
    assert isinstance(exc.value, AdapterLoadError), repr(exc.value)  # answered 503, not 404


async def test_over_http_a_served_name_is_not_answered_404(client, qv_adapters_dir, tmp_path):  # noqa: F811
    v2_dir = tmp_path / "v2"
    shutil.copytree(qv_adapters_dir / "beta", v2_dir)
    await push(client, 1, {"version": "v1", "uri": str(qv_adapters_dir / "alpha")})
    assert (await complete(client, "alpha"))[1]["model"] == "alpha@v1"
    await push(client, 2, {"version": "v2", "uri": str(v2_dir)})
    status, body = await complete(client, "alpha")  # v2 loads on use: the engine switches, v1 is dropped
    assert status == 200 and body["model"] == "alpha@v2", body
    pool = client.app[ENGINE].engine.adapter_pool
    assert "alpha@v1" not in {a["key"] for a in pool.describe()}
    # v2 leaves the GPU and CPU (pressure, budget); its files change on disk: its next load fails for good.
    pool.evict("alpha@v2", "gpu")
    pool.evict("alpha@v2", "cpu")
    shutil.rmtree(v2_dir)
    shutil.copytree(qv_adapters_dir / "alpha", v2_dir)
    answers = [await complete(client, "alpha", f"user-{i}") for i in range(2)]
    got = [(s, b.get("model") or b["error"]["code"]) for s, b in answers]
    assert got == [(503, "adapter_load_failed")] * 2, got


def test_the_retired_fallback_is_no_longer_reported_or_resolved_once_the_failure_stands():
    host, served = switched_rollout()
    served.mark_failed("sql@v2", "its content changed since it was first loaded")
    assert [a.version for a in served.report(host).adapters] == ["v2"]
    assert served.served_versions() == {"sql": {"v2"}}
    with pytest.raises(APIError) as exc:
        served.resolve("sql@v1", ACME, None)
    assert exc.value.status == 404
