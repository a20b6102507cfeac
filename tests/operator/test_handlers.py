"""Kopf running in-process against the kmock Kubernetes emulator, with two sidecars on 127.0.0.1.

The sidecars are doubles speaking the real stager HTTP contract (tests/operator/fake_stager.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import aiohttp
import kmock
import kopf
import pytest

from lorafleet.operator.__main__ import main, run
from lorafleet.operator.handlers import FINALIZER, configure_settings
from lorafleet.operator.operator_config import OperatorConfig

from .fake_stager import FakeStager

NS = "fleet"
TOKEN = "sidecar-secret-0123"
POOLS = "lorafleet.dev/v1alpha1/lorapools"
ADAPTERS = "lorafleet.dev/v1alpha1/loraadapters"


def pod_body(name: str, port: int) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app.kubernetes.io/component": "worker"}},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]},
                                {"name": "stager", "ports": [{"name": "stager", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


POOL = {
    "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoRAPool",
    "metadata": {"name": "main", "namespace": NS, "generation": 1},
    "spec": {"baseModel": "smollm2-135m", "modelURI": "s3://models/smollm2/",
             "workerSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}},
             "tenantQuota": {"maxAdapters": 3}},
}


def adapter_body(name: str, version: str = "v1", **spec) -> dict:
    base = {"pool": "main", "tenant": "acme", "baseModel": "smollm2-135m", "version": version,
            "source": {"uri": f"s3://adapters/{name}/{version}/"}, "warm": 2}
    base.update(spec)
    return {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": NS, "generation": 1}, "spec": base}


async def eventually(check, what: str, *, attempts: int = 400, pause: float = 0.05):
    """Poll ``check`` until it returns a truthy value (a readiness poll, not a timing assertion)."""
    last = None
    for _ in range(attempts):
        with contextlib.suppress(KeyError, IndexError, TypeError, AttributeError):
            last = check()
            if last:
                return last
        await asyncio.sleep(pause)
    raise AssertionError(f"never happened: {what} (last: {last!r})")


@pytest.fixture()
async def cluster():
    emulator = kmock.KubernetesEmulator()
    emulator.resources.load_bundled()
    emulator.resources[POOLS] = kmock.ResourceInfo(kind="LoRAPool", singular="lorapool", namespaced=True,
                                                   shortnames={"lpool"}, subresources=["status"],
                                                   verbs={"list", "watch", "get", "patch", "create", "delete"})
    emulator.resources[ADAPTERS] = kmock.ResourceInfo(kind="LoRAAdapter", singular="loraadapter", namespaced=True,
                                                      shortnames={"lora"}, subresources=["status"],
                                                      verbs={"list", "watch", "get", "patch", "create", "delete"})
    async with emulator, kmock.Server(emulator) as server:
        yield emulator, str(server.url).rstrip("/")


@pytest.fixture()
async def sidecars():
    async with FakeStager(TOKEN) as first, FakeStager(TOKEN) as second:
        yield [first, second]


@contextlib.asynccontextmanager
async def running_operator(url: str, *, stager_token: str = TOKEN, deployments=None, same_loop: bool = False,
                           **overrides):
    """One operator process's worth of state (fresh registry and memory), started and always stopped;
    ``deployments``: the autoscaler's Kubernetes client (it is closed when the operator stops).

    It runs in a thread with an event loop of its own, as kopf's own KopfRunner runs one: kopf takes every task
    of its loop that began after it started for one of its own, and when it stops waits up to 5 s for them to
    end, then cancels them; in the test's loop that includes a fixture's teardown awaiting the operator."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_):
        return kopf.ConnectionInfo(server=url, scheme="Bearer", token="test")

    @kopf.on.startup(registry=registry)
    def tune(settings: kopf.OperatorSettings, **_):
        settings.scanning.disabled = True
        settings.watching.reconnect_backoff = 0.1
        settings.posting.enabled = False
        settings.peering.lifetime = 2  # a stopped leader's claim expires soon

    config = OperatorConfig(**{"interval": 0.3, "retry_delay": 0.2, "stager_token": stager_token,
                               "request_timeout": 2.0, "liveness_port": 0, **overrides})
    if same_loop:  # kopf in the test's loop: its stop waits for the test's own tasks too (up to 5 s)
        stop_event, ready_event = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run(config, registry=registry, stop_flag=stop_event, ready_flag=ready_event,
                                       deployments=deployments))
        try:
            await asyncio.wait_for(ready_event.wait(), 30)
            yield
        finally:
            stop_event.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 10)
            if not task.done():
                task.cancel()
        return
    stop, ready = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def operate() -> None:
        try:
            asyncio.run(run(config, registry=registry, stop_flag=stop, ready_flag=ready, deployments=deployments))
        except BaseException as exc:  # re-raised in the test
            failures.append(exc)

    thread = threading.Thread(target=operate, name="operator", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 30) or failures, "the operator did not start in 30 s"
        if failures:
            raise failures[0]
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive(), "the operator did not stop in 10 s"
    if failures:
        raise failures[0]


@pytest.fixture()
async def operator(cluster):
    emulator, url = cluster
    async with running_operator(url):
        yield emulator


async def api(emulator, method: str, path: str, body: dict) -> None:
    """One request to the emulator, on a connection of its own (none is left open between a test's steps)."""
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
            session.request(method, f"{emulator.url}{path}", json=body, headers=headers) as resp:
        assert resp.status in (200, 201), await resp.text()


async def create(emulator, plural: str, body: dict) -> None:
    # The emulator keeps objects as given; a real API server assigns these.
    body = {**body, "metadata": {"resourceVersion": "1", "uid": f"uid-{body['metadata']['name']}",
                                 "creationTimestamp": "2026-01-01T00:00:00Z", **body["metadata"]}}
    group = "api/v1" if plural == "pods" else "apis/lorafleet.dev/v1alpha1"
    await api(emulator, "POST", f"/{group}/namespaces/{NS}/{plural}", body)


async def patch(emulator, plural: str, name: str, body: dict) -> None:
    await api(emulator, "PATCH", f"/apis/lorafleet.dev/v1alpha1/namespaces/{NS}/{plural}/{name}", body)


async def delete(emulator, plural: str, name: str) -> None:
    await api(emulator, "DELETE", f"/apis/lorafleet.dev/v1alpha1/namespaces/{NS}/{plural}/{name}", {})


def status(emulator, name: str) -> dict:
    return emulator.objects[ADAPTERS, NS, name].get("status") or {}


def gone(emulator, name: str) -> bool:
    try:
        return emulator.objects[ADAPTERS, NS, name].deleted
    except KeyError:
        return True


def holds(stager: FakeStager, name: str) -> set[str]:
    return {s.version for s in stager.state().adapters if s.name == name}


async def test_operator_lifecycle(operator, sidecars, caplog):
    caplog.set_level(logging.INFO, logger="lorafleet")
    emulator = operator
    for i, s in enumerate(sidecars):
        await create(emulator, "pods", pod_body(f"worker-{i}", s.port))
    await create(emulator, "lorapools", POOL)
    await create(emulator, "loraadapters", adapter_body("sql"))

    # Applied -> the sidecars hold it GPU-resident -> status shows both instances, from their reports.
    st = await eventually(lambda: status(emulator, "sql")["phase"] == "Ready" and status(emulator, "sql"),
                          "sql Ready")
    assert st["stableVersion"] == "v1" and st["ready"] == "2/2"
    assert st["instances"] == [{"pod": "worker-0", "version": "v1", "tier": "gpu"},
                               {"pod": "worker-1", "version": "v1", "tier": "gpu"}]
    assert FINALIZER in emulator.objects[ADAPTERS, NS, "sql"]["metadata"]["finalizers"]
    pool_status = await eventually(lambda: emulator.objects[POOLS, NS, "main"]["status"]["readyWorkers"] == 2
                                   and emulator.objects[POOLS, NS, "main"]["status"], "pool status")
    assert pool_status["adapters"] == 1

    # Version change -> both workers switch.
    await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 2},
                                                  "spec": {"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}}})
    await eventually(lambda: all(holds(s, "sql") == {"v2"} for s in sidecars), "workers switched to v2")
    await eventually(lambda: status(emulator, "sql")["stableVersion"] == "v2"
                     and status(emulator, "sql")["phase"] == "Ready", "status v2")

    # Canary at 20 %.
    canary = {"version": "v3", "source": {"uri": "s3://adapters/sql/v3/"}, "weight": 20}
    await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 3}, "spec": {"canary": canary}})
    await eventually(lambda: all(s.applied.by_name()["sql"].canary_weight == 20 for s in sidecars), "canary pushed")
    st = await eventually(lambda: status(emulator, "sql")["canaryVersion"] == "v3" and status(emulator, "sql"),
                          "canary in status")
    assert st["canaryWeight"] == 20
    assert {c["type"]: c["status"] for c in st["conditions"]}["CanaryActive"] == "True"

    # A worker comes back empty -> re-pushed and re-warmed by the drift timer.
    sidecars[0].restart()
    await eventually(lambda: holds(sidecars[0], "sql") == {"v2", "v3"}, "worker-0 re-warmed")
    await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "Ready again")

    # Validation the API server cannot do.
    await create(emulator, "loraadapters", adapter_body("wrongbase", baseModel="llama-3-8b"))
    st = await eventually(lambda: status(emulator, "wrongbase")["phase"] == "Failed" and status(emulator, "wrongbase"),
                          "wrongbase Failed")
    assert st["message"].startswith("spec.baseModel:")
    assert all("wrongbase" not in s.applied.by_name() for s in sidecars)
    # A spec that slipped past the schema (here: no API server validation at all) is a permanent error.
    await create(emulator, "loraadapters", adapter_body("badsource", source={"uri": "http://example.com/a"}))
    st = await eventually(lambda: status(emulator, "badsource")["phase"] == "Failed" and status(emulator, "badsource"),
                          "badsource Failed")
    assert st["message"].startswith("spec.source.uri:")

    # Deletion: the finalizer holds the object until no worker reports the adapter.
    await delete(emulator, "loraadapters", "sql")
    await eventually(lambda: gone(emulator, "sql"), "sql deleted")
    assert all(holds(s, "sql") == set() for s in sidecars)

    # Pool deletion: remaining adapters turn Degraded with a message naming spec.pool.
    await create(emulator, "loraadapters", adapter_body("chat", warm=1))
    await eventually(lambda: status(emulator, "chat")["phase"] == "Ready", "chat Ready")
    await delete(emulator, "lorapools", "main")
    st = await eventually(lambda: status(emulator, "chat")["phase"] == "Degraded" and status(emulator, "chat"),
                          "chat Degraded")
    assert st["message"].startswith("spec.pool: LoRAPool 'main' does not exist")


async def test_the_operator_stops_at_once(cluster, sidecars):
    """Stopping with nothing in flight ends in well under a second (the bound is a hang detector, not a
    performance figure): a timer that a watch event still being handled spawns anew after kopf stopped the
    timers it knew is stopped too, where kopf alone waits 5 s for it before it cancels it."""
    emulator, url = cluster
    operator = running_operator(url)
    await operator.__aenter__()
    try:
        await create(emulator, "pods", pod_body("worker-0", sidecars[0].port))
        await create(emulator, "lorapools", POOL)
        await create(emulator, "loraadapters", adapter_body("sql"))
        await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "sql Ready")
    finally:
        began = time.monotonic()
        await operator.__aexit__(None, None, None)
    # Under kopf's 5 s wait for hung tasks (what this guards against); the events still queued at the stop are
    # handled first, up to 2.4 s on a loaded 2-core machine.
    assert time.monotonic() - began < 4.5


async def test_sidecar_refuses_a_wrong_token(cluster, sidecars):
    from lorafleet.operator.workers import StagerClient, Worker
    from lorafleet.worker.directives import DesiredState

    client = StagerClient(token="wrong", timeout=2.0)
    worker = Worker("w", f"http://127.0.0.1:{sidecars[0].port}")
    try:
        assert await client.fetch_state(worker) is None
        assert not await client.push(worker, DesiredState(1, []))
        assert sidecars[0].pushes == []
    finally:
        await client.close()


async def test_operator_restart_is_harmless(cluster, sidecars):
    emulator, url = cluster
    async with running_operator(url):
        for i, s in enumerate(sidecars):
            await create(emulator, "pods", pod_body(f"worker-{i}", s.port))
        await create(emulator, "lorapools", POOL)
        await create(emulator, "loraadapters", adapter_body("sql"))
        await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "sql Ready")
    before = [s.applied.generation for s in sidecars]
    num_pushes = [len(s.pushes) for s in sidecars]

    # A new operator with no memory: it resumes, finds the workers converged, and changes nothing.
    async with running_operator(url):
        await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "still Ready")
        await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 2}, "spec": {"warm": 1}})
        await eventually(lambda: sum(s.applied.by_name()["sql"].warm for s in sidecars) == 1, "warm on one worker")
    assert [s.refused for s in sidecars] == [0, 0]
    for s, gen, n in zip(sidecars, before, num_pushes, strict=True):
        assert s.applied.generation > gen  # no rollback, and every push after the restart was accepted
        assert all(p.generation > gen for p in s.pushes[n:])


def test_cli_flags_and_refusals(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--namespace", "--interval", "--scale-interval", "--stager-token", "--peering",
                 "env LORAFLEET_STAGER_TOKEN", "env LORAFLEET_SCALE_INTERVAL"):
        assert flag in out
    with pytest.raises(SystemExit) as exc:
        main(["--interval", "0"])
    assert exc.value.code == 2
    assert "interval must be > 0" in capsys.readouterr().err


async def test_replicas_elect_one_leader(cluster, caplog):
    """Two replicas with kopf peering: the lower priority one pauses, only the leader pushes directives."""
    caplog.set_level(logging.INFO, logger="kopf")
    emulator, url = cluster
    emulator.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
        kind="ClusterKopfPeering", namespaced=False, verbs={"list", "watch", "get", "patch", "create"})
    await api(emulator, "POST", "/apis/kopf.dev/v1/clusterkopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "lorafleet"}})
    sidecar = FakeStager(TOKEN, also_accept=("standby-token-123456",))
    await sidecar.start()
    try:
        # In the test's loop, as the emulator: with each replica in a thread of its own, the standby's watch
        # of the peering object missed the leader's claims in about one run in three, and never paused.
        async with running_operator(url, stager_token="standby-token-123456", peering="lorafleet",
                                    peering_priority=10, same_loop=True), \
                running_operator(url, peering="lorafleet", peering_priority=20, same_loop=True):
            await eventually(lambda: any("Pausing operations in favour of" in r.message for r in caplog.records),
                             "the standby pauses")
            await create(emulator, "pods", pod_body("worker-0", sidecar.port))
            await create(emulator, "lorapools", POOL)
            await create(emulator, "loraadapters", adapter_body("sql"))
            await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "Ready under the leader")
            await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 2}, "spec": {"warm": 0}})
            await eventually(lambda: not sidecar.applied.by_name()["sql"].warm, "the change pushed")
            assert sidecar.tokens and set(sidecar.tokens) == {TOKEN} and sidecar.refused == 0
    finally:
        await sidecar.stop()


@pytest.mark.parametrize(("namespace", "peering"), [(None, None), ("ns", None), ("ns", "fleet"), (None, "fleet")])
def test_kopf_settings_follow_the_watched_namespaces(namespace, peering):
    """No scan of namespaces and CRDs, one namespace or all (the chart's Role and ClusterRole grant no watch of
    CRDs: kopf would log permission warnings at every start); peering namespaced for one namespace."""
    settings = kopf.OperatorSettings()
    configure_settings(settings, OperatorConfig(namespace=namespace, peering=peering, stager_token=TOKEN))
    assert settings.scanning.disabled  # the chart grants no watch of CRDs or namespaces
    assert settings.peering.standalone == (peering is None) and settings.persistence.finalizer == FINALIZER
    if peering:
        assert settings.peering.name == peering and settings.peering.clusterwide == (namespace is None)
