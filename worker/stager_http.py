"""The stager's HTTP API over one `Stager` (stager.py): `POST /v1/stage`, `PUT /v1/directives`,
`GET /v1/state`, `/healthz`, `/readyz` and `/metrics`; every route but the last three needs the stager token.

`/readyz` is the pod's readiness (the sidecar's probe): with `--ready-after-push`, 503 `awaiting_push` until a
push has reached the engine (or `--ready-without-push-s` has passed), so that a new pod enters its Service's
endpoints with its pool's adapters registered, never answering their requests 404 while they stage; then 200
for good (a later push in progress leaves the pod ready: it serves what it holds)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lorafleet.worker.directives import MAX_STATE_BYTES, DesiredState, DirectiveError, folders_from
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.push_gate import awaiting_push
from lorafleet.worker.stager import Stager
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_push import StalePush, adopt_at_start
from lorafleet.worker.stager_seed import seed_until_done
from lorafleet.worker.stager_watch import watch_engine
from lorafleet.worker.staging_errors import staging_error
from lorafleet.worker.state_json import NotJSON, decode, reply
from lorafleet.worker.tenants import bearer_token, token_bytes

log = logging.getLogger("lorafleet.stager")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")  # anything else could never match, nor name a cache entry

STAGER = web.AppKey("stager", Stager)
READY_ANYWAY = web.AppKey("ready_anyway", set)  # {True} once --ready-without-push-s passed (said once in the log)


@web.middleware
async def _errors_and_auth(request: web.Request, handler):
    try:
        if request.path not in ("/healthz", "/readyz", "/metrics"):
            token = bearer_token(request.headers.get("Authorization"))
            expected = request.app[STAGER].config.stager_token
            # token_bytes: a header that is not UTF-8 reaches here as lone surrogates, which encode() refuses.
            if token is None or not hmac.compare_digest(token_bytes(token), token_bytes(expected)):
                raise APIError(401, "missing or wrong bearer token for the stager", type="authentication_error",
                               code="invalid_token")
        return await handler(request)
    except StalePush as exc:  # the current report travels with a refused stale push
        report, message = exc.report, exc.message
        return await reply(lambda: {**report.to_dict(), "error": message}, status=409)
    except APIError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except DirectiveError as exc:
        return web.json_response(APIError(400, str(exc)).body(), status=400)


async def _read(request: web.Request, then: Callable[[Any], Any] = lambda body: body) -> Any:
    """`then(the body's JSON)`: off the event loop for a large body (a pool's whole set may be megabytes)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"request body over {MAX_STATE_BYTES} bytes, the most a desired state may take; split "
                            f"the pool's adapters over more pools", code="body_too_large") from None

    try:
        return await decode(raw, then)
    except NotJSON:
        raise APIError(400, "request body must be JSON") from None


async def post_stage(request: web.Request) -> web.Response:
    body = await _read(request)
    uri, sha256 = (body.get("uri"), body.get("sha256")) if isinstance(body, dict) else (None, None)
    if not isinstance(uri, str) or not uri:
        raise APIError(400, "body needs 'uri' (s3://bucket/prefix/, file:// or an absolute path)", param="uri")
    if sha256 is not None and not (isinstance(sha256, str) and _SHA256_HEX.fullmatch(sha256)):
        raise APIError(400, "sha256 must be 64 hex digits", param="sha256")
    try:  # a local folder's tenant folders, as a directive's version lists them
        folders = folders_from(body)
    except DirectiveError as exc:
        raise APIError(400, str(exc), param=str(exc).partition(":")[0]) from None
    try:
        staged = await request.app[STAGER].stage(uri, sha256, folders=folders)
    except APIError:
        raise
    except Exception as exc:
        raise staging_error(exc, uri) from None
    return web.json_response(await asyncio.to_thread(staged.to_dict))  # sizes a local source's folder


async def put_directives(request: web.Request) -> web.Response:
    """The push's report once its versions are staged; with `Prefer: respond-async` (RFC 7240), 202 and the
    report so far once it has reached the engine with what needs no download, its downloads still going on
    (the operator's pushes: one adapter's download must not hold up its pool's next edit); the report once
    staged when that first step is left out (nothing forwarded since the stager started: worker/stager_push.py)."""
    desired = await _read(request, DesiredState.from_dict)
    stager = request.app[STAGER]
    task, begun = stager.start(desired)  # runs to its end if the client goes away
    if "respond-async" in request.headers.get("Prefer", "").lower():
        waiter = asyncio.ensure_future(begun.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not task.done():
            task.add_done_callback(_log_failure)  # nobody else waits for it
            report = await stager.state()
            return await reply(report.to_dict, status=202)
    report = await asyncio.shield(task)
    return await reply(report.to_dict)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("push answered before its downloads were in, then failed: %s", exc)


async def get_state(request: web.Request) -> web.Response:
    stager = request.app[STAGER]
    report = await stager.state()
    report_seed = stager.seed_report
    seed = {"seed": {**report_seed.to_dict(), "generation": stager.generation}} if report_seed is not None else {}
    disk = stager.disk_stats()
    return await reply(lambda: {**report.to_dict(), "disk": disk, **seed})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    stager = request.app[STAGER]
    limit = stager.config.ready_without_push_s
    waited = time.monotonic() - stager.started_at
    if not stager.config.ready_after_push or stager.delivered:
        return web.json_response({"status": "ready"})
    if not awaiting_push(True, False, waited, limit):
        if not request.app[READY_ANYWAY]:
            request.app[READY_ANYWAY].add(True)
            log.warning("no push reached the engine within --ready-without-push-s (%.0f s): ready with the base model "
                        "only; requests naming an adapter are 404 until the operator pushes", limit)
        return web.json_response({"status": "ready", "adapters": "none pushed yet"})
    return web.json_response({"status": "awaiting_push", "waited_s": round(waited, 1), "error": {
        "message": "no push has reached the engine yet: the pod joins its Service once its adapters are registered",
        "type": "service_unavailable", "code": "awaiting_push"}}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STAGER].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: StagerConfig) -> web.Application:
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=MAX_STATE_BYTES)
    app[STAGER] = Stager(config)
    app[READY_ANYWAY] = set()
    app.add_routes([
        web.post("/v1/stage", post_stage),
        web.put("/v1/directives", put_directives),
        web.get("/v1/state", get_state),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
    ])

    async def background_ctx(app: web.Application):
        await adopt_at_start(app[STAGER])  # what a running engine holds stays cached from the start
        task = None
        if config.stager_adapters:
            task = asyncio.create_task(seed_until_done(app[STAGER], config.stager_adapters))
        watch = asyncio.create_task(watch_engine(app[STAGER])) if app[STAGER].engine is not None else None
        yield
        for running in (task, watch):
            if running is not None:
                running.cancel()
        app[STAGER].cancel_pushes()  # those answered before their downloads were in
        app[STAGER].store_threads.shutdown()

    app.cleanup_ctx.append(background_ctx)
    return app
