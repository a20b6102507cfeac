"""Worker pods of a pool: discovery by label selector (ready pods; running ones not ready apart) and the
sidecar HTTP client.

The operator never talks to an engine: each pod's stager sidecar takes ``PUT /v1/directives`` (a
``DesiredState``) and answers ``GET /v1/state`` (a ``ReportedState``), both with a bearer token.
The sidecar's port is the pod's container port named ``stager``, else the pool's ``stagerPort``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from lorafleet.worker.directives import MAX_STATE_BYTES, DesiredState, DirectiveError, ReportedState

log = logging.getLogger(__name__)
STAGER_PORT_NAME = "stager"
QUICK_READ_S = 1.0  # a state read of a pod that is not ready (StagerClient.fetch_state)
# The largest state report read from a sidecar: one entry per version a pod holds (a canary's too), each with its
# error message, for the largest set a push may carry. Past it the pod counts as not answering: a body of any size
# (from whatever answers at a pod's address) would otherwise be read whole into the operator's memory.
MAX_REPORT_BYTES = 2 * MAX_STATE_BYTES
MAX_REASON_BYTES = 64 << 10  # the largest refusal of a push read (its message is cut to 300 characters)


@dataclass(slots=True, frozen=True)
class Worker:
    pod: str
    url: str  # base URL of the pod's stager sidecar
    uid: str = ""  # metadata.uid: a pod re-created under the same name is another worker


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics: matchLabels AND every matchExpression."""
    labels = labels or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def pod_is_running(pod: dict[str, Any]) -> bool:
    """Running, has an IP, not terminating: its sidecar can be reached, and its engine may serve what it holds
    (a pod that is not ready may be one whose readiness probe fails under load, or for a moment)."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return status.get("phase") == "Running"


def ready_condition(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's Ready condition when it is True (its lastTransitionTime: ready since), else None."""
    return next((c for c in (pod.get("status") or {}).get("conditions") or []
                 if c.get("type") == "Ready" and c.get("status") == "True"), None)


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """Running, Ready condition True, has an IP, not terminating."""
    return pod_is_running(pod) and ready_condition(pod) is not None


def stager_port(pod: dict[str, Any], default: int) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == STAGER_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def base_url(pod_ip: str, port: int) -> str:
    """``http://10.0.0.7:8001`` or, for an IPv6 pod IP, ``http://[fd00::7]:8001``."""
    try:
        host = f"[{pod_ip}]" if ipaddress.ip_address(pod_ip).version == 6 else pod_ip
    except ValueError:  # not an IP literal: used as given
        host = pod_ip
    return f"http://{host}:{port}"


def discover_workers(pods: Iterable[dict[str, Any]], selector: dict[str, Any], *, default_port: int,
                     not_ready: bool | None = False) -> list[Worker]:
    """The ready pods ``selector`` matches, by name; ``not_ready``: those running but not ready instead (None:
    every running one, ready or not)."""
    found = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        wanted = pod_is_running(pod) and (not_ready is None or pod_is_ready(pod) != not_ready)
        if selector_matches(selector, meta.get("labels") or {}) and wanted:
            url = base_url(pod["status"]["podIP"], stager_port(pod, default_port))
            found.append(Worker(meta["name"], url, meta.get("uid") or ""))
    return sorted(found, key=lambda w: w.pod)


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The response's body, or None once it runs past ``limit`` bytes (said in Content-Length, or as it comes)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _error_message(text: str) -> str:
    """The message of an OpenAI-style error body (the sidecar's), else the text as it came."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, TypeError, KeyError):
        return text


@dataclass(slots=True, frozen=True)
class Refused:
    """A push its sidecar answered with a refusal: falsy, as it is not accepted."""

    status: int
    reason: str  # the sidecar's error message (at most 300 characters)

    def __bool__(self) -> bool:
        return False

    @property
    def stale(self) -> bool:
        """A stale generation (409): pushed again, higher, at once; not a fault of the set."""
        return self.status == 409


class StagerClient:
    """Talks to sidecars. What each pod accepted is remembered per pool by the caller (push_record.py)."""

    def __init__(self, *, token: str, timeout: float, push_timeout: float | None = None,
                 max_report_bytes: int = MAX_REPORT_BYTES) -> None:
        self.max_report_bytes = max_report_bytes
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._push_timeout = aiohttp.ClientTimeout(total=push_timeout or timeout)
        self._quick = aiohttp.ClientTimeout(total=min(timeout, QUICK_READ_S))
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise aiohttp.ClientError("the sidecar client is closed (operator shutting down)")
        if self._session is None or self._session.closed:
            # No cap on connections: aiohttp's default (100 at once) made every read beyond that wait for a free
            # one, and the wait counts against its timeout: 100 pods that answer late (a partitioned node, pushes
            # answered once staged) made every other pod's read time out too.
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers,
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        self._closed = True  # a pass still finishing after shutdown must not open a new session
        if self._session is not None:
            await self._session.close()

    async def fetch_state(self, worker: Worker, *, quick: bool = False) -> ReportedState | None:
        """The pod's reported state, or None when its sidecar does not answer sensibly. ``quick``: a pod that is not
        ready (a new pod's sidecar answers at once; one on a node that is down must not hold up its pool's pass):
        QUICK_READ_S at most, and no answer is no warning (a sidecar not listening yet). A redirect is not
        followed (the token would go with it to wherever it points), and a report over ``max_report_bytes`` is
        not read past them: either is no answer."""
        say = log.debug if quick else log.warning
        try:
            async with self._client().get(f"{worker.url}/v1/state", timeout=self._quick if quick else self._timeout,
                                          allow_redirects=False) as resp:
                if resp.status != 200:
                    say("sidecar of %s: GET /v1/state -> %s", worker.pod, resp.status)
                    return None
                body = await _read_at_most(resp, self.max_report_bytes)
                if body is None:
                    log.warning("sidecar of %s: GET /v1/state answered over %d bytes, the most the operator reads "
                                "of a state report; taken as no answer", worker.pod, self.max_report_bytes)
                    return None
                return ReportedState.from_json(body)
        except (TimeoutError, aiohttp.ClientError, DirectiveError) as exc:
            say("sidecar of %s unreachable or malformed: %s", worker.pod, exc)
            return None

    async def fetch_states(self, workers: list[Worker], *, quick: bool = False) -> list[ReportedState | None]:
        return list(await asyncio.gather(*(self.fetch_state(w, quick=quick) for w in workers)))

    async def push(self, worker: Worker, desired: DesiredState) -> Literal[True] | Refused | None:
        """PUT the desired state. True: accepted (202: what needs no download is applied, the rest is being
        staged, reported as ``staging`` until it is: the pool's lock is not held through another adapter's
        download; a sidecar's first push since it started is answered once staged only when its engine cannot
        tell what it holds); a Refused (falsy; a 409 for a stale generation, a bad token, a set over the sidecar's
        limit; a redirect, not followed): what the pod holds is not what was last pushed; None: no answer (it may
        have landed or not). The caller takes neither as accepted."""
        try:
            async with self._client().put(f"{worker.url}/v1/directives", data=desired.to_json(),
                                          headers={"Content-Type": "application/json", "Prefer": "respond-async"},
                                          timeout=self._push_timeout, allow_redirects=False) as resp:
                if resp.status in (200, 202):
                    return True
                # Replaced, not refused: an undecodable body raising here would fail the whole pass, every pod's.
                raw = await _read_at_most(resp, MAX_REASON_BYTES)
                text = (f"(an answer over {MAX_REASON_BYTES} bytes)" if raw is None
                        else _error_message(raw.decode("utf-8", errors="replace"))[:300])
                log.warning("sidecar of %s refused generation %d: %s %s", worker.pod, desired.generation,
                            resp.status, text)
                return Refused(resp.status, text)
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("push to the sidecar of %s failed: %s", worker.pod, exc)
            return None
