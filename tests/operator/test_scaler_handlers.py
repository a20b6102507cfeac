"""The autoscaler in the running operator: kopf in-process against the kmock emulator (with apps/v1
Deployments), a real Prometheus scraping fake worker metrics, the stager doubles as sidecars."""

from __future__ import annotations

import asyncio
import copy
import logging
import time

import kmock
import kopf
from aiohttp import web

from lorafleet.operator.deployments import DeploymentClient
from tests.s3_server import free_port

from .fake_metrics import FakePod, scraped
from .fake_stager import FakeStager
from .local_http import serving
from .test_deployments import DEPLOYMENTS, controlled_by, create_deployment, create_replicaset
from .test_handlers import (  # noqa: F401  (fixtures)
    NS,
    POOL,
    POOLS,
    TOKEN,
    adapter_body,
    cluster,
    create,
    eventually,
    patch,
    pod_body,
    running_operator,
    sidecars,
    status,
)
from .test_prometheus_allowlist import Recorder


def scaling_pool(name: str, prometheus_url: str, selector: dict | None = None, **scaling) -> dict:
    body = copy.deepcopy(POOL)
    body["metadata"]["name"] = name
    if selector is not None:
        body["spec"]["workerSelector"] = {"matchLabels": selector}
    body["spec"]["scaling"] = {"target": "workers", "prometheusURL": prometheus_url, "maxReplicas": 6, **scaling}
    return body


def pool_status(emulator, name: str = "main") -> dict:
    return emulator.objects[POOLS, NS, name].get("status") or {}


def condition(emulator, name: str, ctype: str = "Scaling") -> dict:
    """The pool's condition of that type; {} while there is none."""
    return next((c for c in pool_status(emulator, name).get("conditions") or [] if c["type"] == ctype), {})


def replicas_history(emulator, name: str = "workers") -> list[int]:
    return [v["spec"]["replicas"] for v in emulator.objects[DEPLOYMENTS, NS, name].history]


def operator_for(url: str, prometheus_url: str):
    """The operator with its autoscaler talking to the emulator, every 0.3 s, allowed to ask that Prometheus."""
    return running_operator(url, scale_interval=0.3, prometheus_urls=(prometheus_url,),
                            deployments=DeploymentClient(kopf.ConnectionInfo(server=url, token="test"), timeout=2.0))


async def with_deployments(emulator) -> None:
    emulator.resources[DEPLOYMENTS] = kmock.ResourceInfo(kind="Deployment", singular="deployment", namespaced=True,
                                                        subresources=["status", "scale"],
                                                        verbs={"list", "watch", "get", "patch", "create"})
    await create_deployment(emulator, "workers", 2)


async def start_workers(emulator, stagers) -> None:
    """Pods the pools' target Deployment made: the only ones they reach (worker_trust.py)."""
    owner = await create_replicaset(emulator, "workers", "workers-5d8f7c")
    for i, s in enumerate(stagers):
        await create(emulator, "pods", controlled_by(pod_body(f"worker-{i}", s.port), owner))


async def test_high_kv_usage_scales_the_deployment_up(cluster, sidecars, tmp_path):  # noqa: F811
    emulator, url = cluster
    await with_deployments(emulator)
    pods = {(NS, "worker-0"): FakePod(hits=19, misses=1, kv_usage=0.95),
            (NS, "worker-1"): FakePod(hits=19, misses=1, kv_usage=0.95),
            (NS, "worker-9"): FakePod(hits=0, misses=1, kv_usage=0.0)}  # not a pod of the pool
    async with scraped(tmp_path, pods) as (_, prom):
        def has_rates() -> bool:
            result = prom.query('count(rate(lorafleet_adapter_hits_total{tier="gpu"}[2m]))')
            return bool(result) and result[0]["value"][1] == "3"

        await prom.wait_for(has_rates, "two samples of every fake pod")
        async with operator_for(url, prom.url):
            await start_workers(emulator, sidecars)
            await create(emulator, "lorapools", scaling_pool("main", prom.url, kvHigh=0.6))
            # ceil(2 * 0.95 / 0.6) = 4 replicas at once.
            await eventually(lambda: replicas_history(emulator) == [2, 4], "the Deployment patched to 4")
            # Only two of four replicas are ready workers: no further step until the others are. The status is
            # written after the Deployment: a Steady condition of a pass before the scale-up may still be there.
            cond = await eventually(lambda: condition(emulator, "main")["reason"] == "Steady"
                                    and "of 4 replicas" in condition(emulator, "main")["message"]
                                    and condition(emulator, "main"), "a steady pass after the scale-up")
            assert cond["status"] == "True" and "only 2 of 4 replicas are ready workers" in cond["message"]
            st = pool_status(emulator)
            assert (st["desiredReplicas"], st["kvUsage"], st["hitRate"]) == (4, 0.95, 0.95)
            assert st["lastScaleTime"].endswith("Z")
            # The reconcile's, written by another handler (its first pass may not see the pods yet), kept.
            await eventually(lambda: condition(emulator, "main", "Ready")["status"] == "True", "the pool Ready")
            assert replicas_history(emulator) == [2, 4]
    history = [v.get("status") or {} for v in emulator.objects[POOLS, NS, "main"].history]
    scaled = [c for s in history for c in s.get("conditions", []) if c.get("reason") == "ScaledUp"]
    assert scaled and scaled[0]["message"].startswith("2 -> 4 replicas: KV usage 0.95 > kvHigh 0.6; KV usage 0.95")
    # The reconcile never wrote its own kvUsage (the sidecars report 0.1) over the autoscaler's.
    assert {s["kvUsage"] for s in history if "kvUsage" in s} == {0.95}


class OneSlotStager(FakeStager):
    """A sidecar whose engine has one GPU adapter slot (--max-loras 1)."""

    def state(self):
        state = super().state()
        state.pool_slots = 1
        return state


def idle_prometheus() -> web.Application:
    """A Prometheus whose workers are idle: KV usage 0.05, no lookups, no request waiting."""
    async def query(request: web.Request) -> web.Response:
        promql = (await request.post())["query"]
        value = "0.05" if promql.startswith("avg(lorafleet_kv_cache") else "0" if promql.startswith("avg(lorafleet_queue") else None
        result = [{"metric": {}, "value": [0, value]}] if value else []
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    return app


async def test_an_idle_pool_keeps_the_workers_its_pinned_adapters_need(cluster):  # noqa: F811
    """Two pinned adapters on workers of one GPU adapter slot each: idle, the pool would go down to minReplicas
    1, where one of them could not stay GPU-resident. It holds at 2, and says why, until one is unpinned."""
    emulator, url = cluster
    await with_deployments(emulator)
    async with OneSlotStager(TOKEN) as first, OneSlotStager(TOKEN) as second, serving(idle_prometheus()) as prom, \
            operator_for(url, prom):
        await start_workers(emulator, [first, second])
        for name in ("a", "b"):
            await create(emulator, "loraadapters", adapter_body(name, warm=0, pinned=True))
        # Indexed (their status says there is no pool yet) before the pool's first pass reads them.
        await eventually(lambda: status(emulator, "a")["phase"] and status(emulator, "b")["phase"], "adapters seen")
        await create(emulator, "lorapools", scaling_pool("main", prom, minReplicas=1, scaleDownStabilizationSeconds=0))
        cond = await eventually(lambda: "pinned adapters need 2 workers" in condition(emulator, "main")["message"]
                                and condition(emulator, "main"), "the scale-down held for the pinned adapters")
        assert cond["reason"] == "Steady" and cond["message"].startswith(
            "2 replicas: KV usage 0.05 < kvLow 0.3; held at 2: 2 pinned adapters need 2 workers"), cond["message"]
        await eventually(lambda: status(emulator, "a")["phase"] == status(emulator, "b")["phase"] == "Ready",
                         "both pinned adapters GPU-resident")
        assert replicas_history(emulator) == [2]
        await patch(emulator, "loraadapters", "b", {"metadata": {"generation": 2}, "spec": {"pinned": False}})
        await eventually(lambda: replicas_history(emulator) == [2, 1], "the Deployment scaled down to 1")
    assert replicas_history(emulator) == [2, 1]


async def test_ranked_pods_keep_costs_set_by_others_and_lose_stale_ones(cluster):  # noqa: F811
    """--rank-pods through the running operator: the pods it ranks are those of its pod index, which must carry
    their deletion-cost annotations (it held none: a cost a person set was overwritten, and the operator's own
    cost on a pod that no longer holds the pinned copy was never removed, so both pods ranked alike)."""
    from lorafleet.operator.deletion_cost import DELETION_COST, MARK

    emulator, url = cluster
    await with_deployments(emulator)
    async with OneSlotStager(TOKEN) as first, OneSlotStager(TOKEN) as second, serving(idle_prometheus()) as prom, \
            running_operator(url, scale_interval=0.3, prometheus_urls=(prom,), rank_pods=True,
                             deployments=DeploymentClient(kopf.ConnectionInfo(server=url, token="test"), timeout=2.0)):
        owner = await create_replicaset(emulator, "workers", "workers-5d8f7c")
        pods = [controlled_by(pod_body(f"worker-{i}", s.port), owner) for i, s in enumerate((first, second))]
        pods[0]["metadata"]["annotations"] = {DELETION_COST: "-100"}  # a person's
        pods[1]["metadata"]["annotations"] = {DELETION_COST: "1000", MARK: "1000"}  # the operator's, from before
        for body in pods:
            await create(emulator, "pods", body)
        await create(emulator, "loraadapters", adapter_body("a", warm=0, pinned=True))
        await eventually(lambda: status(emulator, "a")["phase"], "adapter seen")
        await create(emulator, "lorapools", scaling_pool("main", prom, minReplicas=1, scaleDownStabilizationSeconds=0))
        await eventually(lambda: status(emulator, "a")["phase"] == "Ready", "the pinned adapter GPU-resident")
        await eventually(lambda: replicas_history(emulator) == [2, 1], "the Deployment scaled down to 1")
        holder = status(emulator, "a")["warmWorkers"]
    notes = {n: emulator.objects["v1/pods", NS, n]["metadata"].get("annotations") or {}
             for n in ("worker-0", "worker-1")}
    assert notes["worker-0"].get(DELETION_COST) == "-100", notes  # left as the person set it
    assert notes["worker-1"].get(DELETION_COST) == ("1000" if holder == ["worker-1"] else None), (holder, notes)


async def test_failures_are_conditions_and_touch_no_replicas(cluster, sidecars):  # noqa: F811
    emulator, url = cluster
    await with_deployments(emulator)
    down = f"http://127.0.0.1:{free_port()}"  # no Prometheus there
    async with operator_for(url, down):
        await start_workers(emulator, sidecars)
        await create(emulator, "lorapools", scaling_pool("main", down))
        await create(emulator, "lorapools", scaling_pool("other", down, {"app": "none"}, target="no-such-workers"))
        invalid = scaling_pool("zeta", down, {"app": "none"})
        del invalid["spec"]["scaling"]["prometheusURL"]
        await create(emulator, "lorapools", invalid)

        cond = await eventually(lambda: condition(emulator, "main"), "a Scaling condition on main")
        assert (cond["status"], cond["reason"]) == ("False", "MetricsUnavailable")
        assert cond["message"].startswith(f"spec.scaling.prometheusURL: {down}/api/v1/query:")
        assert cond["message"].endswith("replicas stay at 2")
        cond = await eventually(lambda: condition(emulator, "other"), "a Scaling condition on other")
        assert (cond["status"], cond["reason"], cond["message"]) == (
            "False", "TargetNotFound", "spec.scaling.target: Deployment 'no-such-workers' not found in namespace 'fleet'")
        cond = await eventually(lambda: condition(emulator, "zeta"), "a Scaling condition on zeta")
        assert (cond["status"], cond["reason"]) == ("False", "InvalidSpec")
        assert cond["message"].startswith("spec.scaling.prometheusURL: required")
        ready = await eventually(lambda: condition(emulator, "zeta", "Ready"), "zeta's Ready condition")
        assert ready["reason"] == "InvalidSpec" and ready["message"] == cond["message"]
        assert replicas_history(emulator) == [2]
        assert "desiredReplicas" not in pool_status(emulator, "main")

        # spec.scaling removed: its condition goes, kvUsage is the reconcile's again (the sidecars' 0.1).
        await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": {"scaling": None}})
        await eventually(lambda: pool_status(emulator).get("kvUsage") == 0.1
                         and [c["type"] for c in pool_status(emulator)["conditions"]] == ["Ready"],
                         "the Scaling condition dropped")
    assert replicas_history(emulator) == [2]


class CountingDeployments(DeploymentClient):
    """The emulator's Deployments, counting the autoscaler's reads (one per pass that gets that far)."""

    num_gets = 0

    async def get_replicas(self, namespace: str, name: str) -> int:
        self.num_gets += 1
        return await super().get_replicas(namespace, name)


async def test_passes_that_change_nothing_log_nothing(cluster, sidecars, caplog):  # noqa: F811
    """Every timer pass of every pool (autoscale, drift) logging 'succeeded' at INFO buries what matters."""
    emulator, url = cluster
    await with_deployments(emulator)
    caplog.set_level(logging.INFO)
    deployments = CountingDeployments(kopf.ConnectionInfo(server=url, token="test"), timeout=2.0)
    down = f"http://127.0.0.1:{free_port()}"
    async with running_operator(url, scale_interval=0.3, prometheus_urls=(down,), deployments=deployments):
        await start_workers(emulator, sidecars)
        await create(emulator, "lorapools", scaling_pool("main", down))
        await eventually(lambda: deployments.num_gets >= 5, "five autoscaler passes")
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert any("pool_changed' succeeded" in m for m in messages)  # a handler's outcome is still logged
    assert not [m for m in messages if m.startswith("Timer ")]


async def test_a_prometheus_the_operator_may_not_ask_gets_no_request(cluster, sidecars):  # noqa: F811
    """Whoever may write a pool must not make the operator send requests wherever the pool points: a pool
    whose prometheusURL is not on --prometheus-urls is told so, its Prometheus (a local server standing at
    that URL) gets nothing, and the pool still serves its adapters."""
    emulator, url = cluster
    await with_deployments(emulator)
    recorder = Recorder()
    async with serving(recorder.app()) as elsewhere, operator_for(url, "http://prometheus.monitoring:9090"):
        await start_workers(emulator, sidecars)
        await create(emulator, "lorapools", scaling_pool("main", f"{elsewhere}/latest/meta-data"))
        cond = await eventually(lambda: condition(emulator, "main"), "a Scaling condition on main")
        assert (cond["status"], cond["reason"]) == ("False", "PrometheusURLNotAllowed")
        assert cond["message"].startswith(f"spec.scaling.prometheusURL: '{elsewhere}/latest/meta-data' is not on a "
                                          f"Prometheus the operator may ask (http://prometheus.monitoring:9090)")
        assert "--prometheus-urls (env LORAFLEET_PROMETHEUS_URLS" in cond["message"]
        await eventually(lambda: condition(emulator, "main", "Ready")["status"] == "True", "the pool Ready")
        # With its ready workers known, a pass (of the edited spec) asks no Prometheus either.
        await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": {"scaling": {
            "prometheusURL": f"{elsewhere}/computeMetadata/v1"}}})
        await eventually(lambda: "/computeMetadata/v1' is not on" in condition(emulator, "main")["message"],
                         "a pass of the edited spec")
    assert recorder.requests == [] and replicas_history(emulator) == [2]


async def test_stopping_during_a_pass_that_waits_on_a_slow_server_ends_the_pass(cluster, sidecars, caplog):  # noqa: F811
    """A pass waiting on a Prometheus that does not answer (its timeout 30 s) must not hold the operator's
    stop: kopf gives a timer a few loop cycles, then logs it 'did not exit in time' and leaves it running
    against clients the operator is closing."""
    emulator, url = cluster
    await with_deployments(emulator)
    asked, release = asyncio.Event(), asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        asked.set()
        await release.wait()
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": []}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    caplog.set_level(logging.INFO)
    async with serving(app) as slow:
        try:
            async with running_operator(url, scale_interval=0.3, prometheus_urls=(slow,), request_timeout=30.0,
                                        deployments=CountingDeployments(kopf.ConnectionInfo(server=url, token="test"),
                                                                        timeout=2.0)):
                await start_workers(emulator, sidecars)
                await create(emulator, "lorapools", scaling_pool("main", slow))
                await asyncio.wait_for(asked.wait(), 30)
                began = time.monotonic()
            took = time.monotonic() - began
        finally:
            release.set()
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in messages if "did not exit in time" in m]
    assert took < 4.5, f"the operator took {took:.1f} s to stop"  # an orphaned timer held it 5 s or more
