"""The engine's own readiness gate (`--ready-after-push`, set by the chart beside its sidecar's): /readyz is 503
`awaiting_push` until an admin push has been applied, so that an engine restarted beside a running sidecar
re-enters its Service only once the sidecar has handed it its adapters again (stager_watch.py); with
`--ready-without-push-s` it turns ready anyway after that long."""

from __future__ import annotations

import pytest

from lorafleet.worker import EngineConfig
from lorafleet.worker.server import create_app
from lorafleet.worker.worker_config import WorkerConfig

ADMIN = "admin-token-0123456789"


async def _client(aiohttp_client, tiny_llama_dir, **settings):
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=64),
                          served_model_name="tiny", admin_token=ADMIN, **settings)
    return await aiohttp_client(create_app(config))


async def test_an_engine_is_ready_once_a_push_was_applied(aiohttp_client, tiny_llama_dir):
    client = await _client(aiohttp_client, tiny_llama_dir, ready_after_push=True)
    resp = await client.get("/readyz")
    assert (resp.status, await resp.json()) == (503, {"status": "awaiting_push"})
    resp = await client.put("/admin/v1/state", json={"generation": 1, "adapters": []},
                            headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status == 200, await resp.text()
    assert (await client.get("/readyz")).status == 200


@pytest.mark.parametrize("settings", [{}, {"ready_after_push": True, "ready_without_push_s": 0.0}])
async def test_an_engine_is_ready_without_a_push_when_not_gated_or_past_the_limit(aiohttp_client, tiny_llama_dir,
                                                                                  settings):
    client = await _client(aiohttp_client, tiny_llama_dir, **settings)
    resp = await client.get("/readyz")
    assert (resp.status, await resp.json()) == (200, {"status": "ready"})
