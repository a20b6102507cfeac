"""The autoscaler's only Kubernetes calls: read and merge-patch ``spec.replicas`` of an apps/v1 Deployment
through its ``scale`` subresource (an autoscaling/v1 Scale), all that RBAC has to grant: ``patch`` on the
Deployment itself could change its pod template (any image, service account or secret); and list the
namespace's HorizontalPodAutoscalers, to find one that scales the same Deployment (a KEDA ScaledObject
makes one too): two autoscalers would undo each other's replicas. Before a scale-down it also merge-patches
the pool's worker pods' ``pod-deletion-cost`` annotation (``patch`` on pods, metadata only as used here), so
that the ReplicaSet removes the pods holding no pinned copy first (deletion_cost.py).

Kopf's own API client is private, so this is a minimal one. Its connection is either given (tests pass
the emulator's URL) or comes from kopf's public login functions: the pod's service account, else a
kubeconfig. A 401 logs in again once (service account tokens are rotated on disk).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf

from lorafleet.operator.deletion_cost import DELETION_COST, MARK

log = logging.getLogger(__name__)


class KubeError(Exception):
    """The API server could not be asked, or refused."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class TargetNotFound(KubeError):
    """No such Deployment (HTTP 404)."""


def default_login() -> kopf.ConnectionInfo:
    """Credentials as kopf finds them when it runs without a client library: in-cluster, else kubeconfig."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise KubeError("no Kubernetes credentials: neither a service account token nor a kubeconfig was found")
    return info


class DeploymentClient:
    """``get_replicas`` / ``set_replicas`` of Deployments, over one aiohttp session (closed by ``close``)."""

    def __init__(self, connection: kopf.ConnectionInfo | None = None, *, timeout: float = 5.0,
                 login: Callable[[], kopf.ConnectionInfo] = default_login) -> None:
        self._connection = connection
        self._login = None if connection is not None else login
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _client(self) -> tuple[aiohttp.ClientSession, str]:
        if self._closed:
            raise KubeError("the Kubernetes client is closed (operator shutting down)")
        if self._connection is None:
            try:
                self._connection = self._login()
            except KubeError:
                raise
            except Exception as exc:  # a broken kubeconfig fails in many ways; each is reported, none crashes
                raise KubeError(f"Kubernetes login failed: {exc}") from None
        info = self._connection
        if self._session is None or self._session.closed:
            ssl = info.as_ssl_context() if info.server.startswith("https:") else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl) if ssl else None, headers=info.as_http_headers(),
                timeout=self._timeout, proxy=info.proxy_url, trust_env=info.trust_env)
        return self._session, info.server.rstrip("/")

    async def close(self) -> None:
        """Close the session; later calls raise ``KubeError`` instead of reconnecting."""
        self._closed = True  # a pass still finishing after shutdown must not open a new session
        await self._drop_session()

    async def _drop_session(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _scale(self, method: str, namespace: str, name: str, body: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
        try:
            return await self._request(method, f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale",
                                       f"{method} deployments/{name}/scale in namespace {namespace}", body)
        except KubeError as exc:
            if exc.status == 404:
                raise TargetNotFound(f"Deployment {name!r} not found in namespace {namespace!r}", 404) from None
            raise

    async def _request(self, method: str, path: str, what: str, body: dict[str, Any] | None = None,
                       *, retry: bool = True) -> dict[str, Any]:
        session, server = self._client()
        url = server + path
        headers = {"Content-Type": "application/merge-patch+json"} if body is not None else None
        try:
            async with session.request(method, url, data=None if body is None else json.dumps(body),
                                       headers=headers) as resp:
                status, text = resp.status, await resp.text(errors="replace")  # a proxy's page need not be UTF-8
        except TimeoutError:
            raise KubeError(f"{what}: no answer from the API server within {self._timeout.total:g} s") from None
        except aiohttp.ClientError as exc:
            raise KubeError(f"{what}: {exc}") from None
        if status == 401 and retry and self._login is not None:  # a rotated token: log in again, once
            await self._drop_session()
            self._connection = None
            return await self._request(method, path, what, body, retry=False)
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if status != 200 or not isinstance(data, dict):
            message = data.get("message") if isinstance(data, dict) else text[:200]
            raise KubeError(f"{what}: HTTP {status}: {message}", status)
        return data

    async def get_replicas(self, namespace: str, name: str) -> int:
        """The Deployment's ``spec.replicas``, as its Scale says (which omits 0)."""
        spec = (await self._scale("GET", namespace, name)).get("spec") or {}
        replicas = spec.get("replicas", 0)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise KubeError(f"Deployment {name!r} in namespace {namespace!r} has spec.replicas {replicas!r}")
        return replicas

    async def set_replicas(self, namespace: str, name: str, replicas: int) -> None:
        """Merge-patch the Deployment's Scale to ``replicas`` (no precondition: the last writer wins, as
        with ``kubectl scale``)."""
        await self._scale("PATCH", namespace, name, {"spec": {"replicas": replicas}})

    async def set_deletion_cost(self, namespace: str, pod: str, cost: int | None) -> None:
        """Merge-patch the pod's ``pod-deletion-cost`` and the operator's mark of it (None: both removed):
        deletion_cost.py."""
        value = None if cost is None else str(cost)
        await self._request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod}",
                            f"PATCH pods/{pod} in namespace {namespace}",
                            {"metadata": {"annotations": {DELETION_COST: value, MARK: value}}})

    async def autoscalers_of(self, namespace: str, name: str) -> list[str] | None:
        """Names of the namespace's HorizontalPodAutoscalers whose target is Deployment ``name``; None when
        that cannot be told (the role may not list them, or the API server has no autoscaling/v2)."""
        try:
            data = await self._request("GET", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers",
                                       f"list horizontalpodautoscalers in namespace {namespace}")
        except KubeError as exc:
            if exc.status in (403, 404):
                return None
            raise
        found = []
        for hpa in data.get("items") or []:
            ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
            if ref.get("kind") == "Deployment" and ref.get("name") == name and (
                    ref.get("apiVersion") or "apps/v1").split("/")[0] in ("apps", "extensions"):
                found.append((hpa.get("metadata") or {}).get("name", ""))
        return sorted(found)
