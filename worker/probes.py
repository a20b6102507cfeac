"""The probes: liveness (`/healthz`, and vLLM's `/health` and `/ping`, which routers and SageMaker-style hosts set
up for vLLM ask), readiness (`/readyz`) and vLLM's `/version`. None needs an API key."""

from __future__ import annotations

import time

from aiohttp import web

import lorafleet
from lorafleet.worker.app_keys import ADAPTERS, CONFIG, ENGINE, STATUS
from lorafleet.worker.push_gate import awaiting_push
from lorafleet.worker.startup_adapters import STARTUP_ADAPTERS


def probe_routes() -> list[web.RouteDef]:
    return [web.get("/healthz", healthz), web.get("/health", healthz), web.get("/ping", healthz),
            web.post("/ping", healthz), web.get("/readyz", readyz), web.get("/version", version)]


def _engine_failure(app: web.Application) -> web.Response | None:
    """503 once the engine thread died: no request can be served any more, so the liveness probe
    fails and the kubelet restarts the container, instead of a pod that is never ready nor restarted."""
    engine = app.get(ENGINE)
    if engine is None or engine.failure is None:
        return None
    return web.json_response({"status": "failed", "error": f"the engine thread died: {engine.failure!r}"},
                             status=503)


async def healthz(request: web.Request) -> web.Response:
    return _engine_failure(request.app) or web.json_response({"status": "alive"})


async def readyz(request: web.Request) -> web.Response:
    status = request.app[STATUS]
    engine = request.app.get(ENGINE)
    if failed := _engine_failure(request.app):
        return failed
    if status.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not status.ready or engine is None or not engine.is_running:
        return web.json_response({"status": "starting"}, status=503)
    startup = request.app.get(STARTUP_ADAPTERS)
    if startup is not None and not startup.is_loaded:
        return web.json_response(startup.answer(), status=503)
    config = request.app[CONFIG]  # its sidecar has not handed it its adapters (a restarted engine too)
    if awaiting_push(config.ready_after_push, bool(request.app[ADAPTERS].generation), time.time() - status.started_at,
                     config.ready_without_push_s):
        return web.json_response({"status": "awaiting_push"}, status=503)
    return web.json_response({"status": "ready"})


async def version(_: web.Request) -> web.Response:
    return web.json_response({"version": lorafleet.__version__})
