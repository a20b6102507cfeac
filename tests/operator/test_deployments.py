"""The autoscaler's Kubernetes client: against the kmock emulator (read, merge-patch, 404), and a stub API
server for refusals and a rotated token."""

from __future__ import annotations

import contextlib

import kopf
import pytest
from aiohttp import web

from lorafleet.operator.deployments import DeploymentClient, KubeError, TargetNotFound
from tests.s3_server import free_port

from .local_http import serving
from .test_handlers import NS, api, cluster  # noqa: F401  (fixtures)

DEPLOYMENTS = "apps/v1/deployments"


def deployment_body(name: str, replicas: int | None) -> dict:
    spec = {"selector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}}
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": "1", "uid": f"uid-{name}"}, "spec": spec}


async def create_deployment(emulator, name: str, replicas: int | None) -> None:
    await api(emulator, "POST", f"/apis/apps/v1/namespaces/{NS}/deployments", deployment_body(name, replicas))


async def create_replicaset(emulator, deployment: str | None, name: str) -> dict:
    """A ReplicaSet that ``deployment`` controls (None: none does), as the Deployment controller makes one;
    returns the controller reference its pods carry."""
    meta = {"name": name, "namespace": NS, "resourceVersion": "1", "uid": f"uid-{name}"}
    if deployment is not None:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment,
                                    "uid": f"uid-{deployment}", "controller": True, "blockOwnerDeletion": True}]
    body = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": meta,
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}}}
    await api(emulator, "POST", f"/apis/apps/v1/namespaces/{NS}/replicasets", body)
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": meta["uid"], "controller": True,
            "blockOwnerDeletion": True}


def controlled_by(pod: dict, owner: dict) -> dict:
    """``pod`` with ``owner`` as its controller reference."""
    return {**pod, "metadata": {**pod["metadata"], "ownerReferences": [owner]}}


async def test_get_and_patch_replicas(cluster):  # noqa: F811
    emulator, url = cluster
    await create_deployment(emulator, "workers", 2)
    client = DeploymentClient(kopf.ConnectionInfo(server=url, token="test"), timeout=2.0)
    try:
        assert await client.get_replicas(NS, "workers") == 2
        await client.set_replicas(NS, "workers", 5)
        assert await client.get_replicas(NS, "workers") == 5
        deployment = emulator.objects[DEPLOYMENTS, NS, "workers"]
        assert deployment["spec"] == {**deployment_body("workers", 5)["spec"]}  # only replicas changed
        with pytest.raises(TargetNotFound, match="Deployment 'missing' not found in namespace 'fleet'"):
            await client.get_replicas(NS, "missing")
        with pytest.raises(TargetNotFound):
            await client.get_replicas("elsewhere", "workers")
    finally:
        await client.close()
    with pytest.raises(KubeError, match="closed"):
        await client.get_replicas(NS, "workers")


async def test_autoscalers_of_a_deployment(cluster):  # noqa: F811
    """The HorizontalPodAutoscalers that scale a Deployment (the pool's autoscaler leaves it to them)."""
    emulator, url = cluster

    async def create_hpa(name: str, kind: str, target: str, api_version: str = "apps/v1") -> None:
        await api(emulator, "POST", f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers", {
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": "1", "uid": f"uid-{name}"},
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target},
                     "minReplicas": 1, "maxReplicas": 4}})

    client = DeploymentClient(kopf.ConnectionInfo(server=url, token="test"), timeout=2.0)
    try:
        assert await client.autoscalers_of(NS, "workers") == []
        await create_hpa("keda-hpa-workers", "Deployment", "workers")
        await create_hpa("other", "Deployment", "frontend")
        await create_hpa("same-name-other-kind", "StatefulSet", "workers")
        await create_hpa("custom", "Deployment", "workers", api_version="example.com/v1")
        assert await client.autoscalers_of(NS, "workers") == ["keda-hpa-workers"]
    finally:
        await client.close()


async def test_autoscalers_it_may_not_list_are_unknown_not_an_error():
    async def forbidden(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Status", "message": "forbidden"}, status=403)

    app = web.Application()
    app.router.add_route("*", "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers", forbidden)
    async with serving(app) as url:
        client = DeploymentClient(kopf.ConnectionInfo(server=url), timeout=2.0)
        try:
            assert await client.autoscalers_of(NS, "workers") is None  # 403
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def api_stub(handler):
    app = web.Application()
    app.router.add_route("*", "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", handler)
    async with serving(app) as url:
        yield url


async def test_only_the_scale_subresource_is_needed():
    """The chart's Role grants get/patch on deployments/scale only (patch on a whole Deployment could change
    its pod template: any image, service account or secret): the client must need nothing else."""
    requests, scales = [], {"workers": {"replicas": 2}, "idle": {}}  # a Scale omits replicas 0

    async def forbidden(request: web.Request) -> web.Response:
        requests.append((request.method, request.path))
        return web.json_response({"kind": "Status", "message": "forbidden"}, status=403)

    async def scale(request: web.Request) -> web.Response:
        requests.append((request.method, request.path))
        name = request.match_info["name"]
        if request.method == "PATCH":
            assert request.content_type == "application/merge-patch+json"
            scales[name] = (await request.json())["spec"]
        return web.json_response({"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": scales[name],
                                  "status": {"replicas": 2, "selector": "app=w"}})

    app = web.Application()
    app.router.add_route("*", "/apis/apps/v1/namespaces/{ns}/deployments/{name}", forbidden)
    app.router.add_route("*", "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale", scale)
    async with serving(app) as url:
        client = DeploymentClient(kopf.ConnectionInfo(server=url), timeout=2.0)
        try:
            assert await client.get_replicas(NS, "workers") == 2
            assert await client.get_replicas(NS, "idle") == 0
            await client.set_replicas(NS, "workers", 4)
            assert await client.get_replicas(NS, "workers") == 4
        finally:
            await client.close()
    assert {path for _, path in requests} == {f"/apis/apps/v1/namespaces/{NS}/deployments/{n}/scale"
                                              for n in ("workers", "idle")}


async def test_a_rotated_token_logs_in_again_once():
    tokens = []

    async def handler(request: web.Request) -> web.Response:
        tokens.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer fresh":
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        return web.json_response({"spec": {"replicas": 3}})

    async with api_stub(handler) as url:
        logins = iter(["stale", "fresh", "never-used"])
        client = DeploymentClient(login=lambda: kopf.ConnectionInfo(server=url, token=next(logins)), timeout=2.0)
        try:
            assert await client.get_replicas(NS, "workers") == 3
            assert tokens == ["Bearer stale", "Bearer fresh"]
        finally:
            await client.close()
        # A fixed connection (given, not logged in) is not retried.
        client = DeploymentClient(kopf.ConnectionInfo(server=url, token="stale"), timeout=2.0)
        try:
            with pytest.raises(KubeError, match="HTTP 401: Unauthorized"):
                await client.get_replicas(NS, "workers")
        finally:
            await client.close()


@pytest.mark.parametrize(("status", "body", "error"), [
    (403, {"kind": "Status", "message": 'deployments.apps "workers" is forbidden'}, "HTTP 403: deployments.apps"),
    (200, {"spec": {"replicas": "two"}}, "has spec.replicas 'two'"),
    (500, "<html>", "HTTP 500: <html>"),
    (502, b"<html>Bad Gateway \xe9</html>", "HTTP 502: <html>Bad Gateway \ufffd"),  # a proxy's page, not UTF-8
])
async def test_refusals_are_kube_errors(status, body, error):
    async def handler(_: web.Request) -> web.Response:
        if isinstance(body, dict):
            return web.json_response(body, status=status)
        if isinstance(body, bytes):
            return web.Response(body=body, status=status, content_type="text/html")
        return web.Response(text=body, status=status)

    async with api_stub(handler) as url:
        client = DeploymentClient(kopf.ConnectionInfo(server=url), timeout=2.0)
        try:
            with pytest.raises(KubeError, match=error):
                await client.get_replicas(NS, "workers")
        finally:
            await client.close()


async def test_no_api_server_and_no_credentials_are_kube_errors():
    client = DeploymentClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{free_port()}"), timeout=2.0)
    try:
        with pytest.raises(KubeError, match="GET deployments/workers/scale in namespace fleet"):
            await client.get_replicas(NS, "workers")
    finally:
        await client.close()

    def no_login() -> kopf.ConnectionInfo:
        raise KubeError("no Kubernetes credentials")

    client = DeploymentClient(login=no_login)
    with pytest.raises(KubeError, match="no Kubernetes credentials"):
        await client.set_replicas(NS, "workers", 2)
    await client.close()


async def test_a_pods_deletion_cost_is_set_and_removed_by_merge_patch(cluster):  # noqa: F811
    """The autoscaler ranks a scale-down's pods by their pod-deletion-cost annotation (deletion_cost.py): set with
    the operator's mark beside it, removed with it, every other annotation and the pod's spec untouched."""
    from lorafleet.operator.deletion_cost import DELETION_COST, MARK

    from .test_handlers import pod_body

    emulator, url = cluster
    pod = pod_body("w-0", 8001)
    pod["metadata"]["annotations"] = {"prometheus.io/scrape": "true"}
    await api(emulator, "POST", f"/api/v1/namespaces/{NS}/pods", pod)
    client = DeploymentClient(kopf.ConnectionInfo(server=url, token="test"), timeout=2.0)
    try:
        await client.set_deletion_cost(NS, "w-0", 2001)
        stored = emulator.objects["v1/pods", NS, "w-0"]
        assert stored["metadata"]["annotations"] == {"prometheus.io/scrape": "true", DELETION_COST: "2001",
                                                     MARK: "2001"}
        assert stored["spec"] == pod["spec"]
        await client.set_deletion_cost(NS, "w-0", None)
        assert emulator.objects["v1/pods", NS, "w-0"]["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
        with pytest.raises(KubeError, match="HTTP 404"):
            await client.set_deletion_cost(NS, "gone", 1)
    finally:
        await client.close()
