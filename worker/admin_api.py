"""Admin API (bearer admin token): the desired-state push, the state report, vLLM load/unload.

`PUT /admin/v1/state` takes a `directives.DesiredState` (from the pod's stager sidecar) and answers
the `ReportedState` after applying it; the same generation twice is a no-op, an older one is
refused with 409 (body: the current report with `error` set). `GET /admin/v1/state` adds the
worker-only keys (KV pages, running/waiting requests, pool stats with the eviction policy and CPU
tier budget in use) to the report and, while adapters of a local --adapters folder that failed to load
at start-up are reported (each is also an `adapters` entry with its error, as a pushed version that
failed: worker/served_adapters.py), `"startup": {"adapters": DIR, "errors": {folder: why}}`. Checking
the adapter paths and registering them read the file system (a hung mount may block for minutes), so
both run off the event loop, one admin change at a time: health probes and requests for adapters
already served are answered meanwhile. A change that unregisters a name (a push that no longer lists
it, an unload) or retires a version (a rolled-back canary, a replaced stable version) retires its request
metrics (dropped once no request runs on it and a scrape could read its last counts: worker/metrics.py).
While every GPU adapter slot is held by a pinned adapter, each other version reported says so
(`num_pinned_slots`): it cannot become GPU-resident here until one is unpinned or --max-loras raised.
`GET /admin/v1/directives` answers the last push as the stager sent it, while what is served is that push's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from lorafleet.worker.app_keys import (
    ADAPTERS,
    ADMIN_LOCK,
    ADMISSION,
    CONFIG,
    ENGINE,
    HOST,
    METRICS,
    SOURCES,
    TENANTS,
)
from lorafleet.worker.directives import MAX_STATE_BYTES, DesiredState, DirectiveError, VersionRef
from lorafleet.worker.intake import read_json
from lorafleet.worker.openai_protocol import (
    APIError,
    parse_load_adapter_request,
    parse_unload_adapter_request,
)
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.sources import SourceError
from lorafleet.worker.staging_errors import source_status
from lorafleet.worker.state_json import reply
from lorafleet.worker.tenant_folders import NO_FOLDERS, TenantFolders, local_uri_path, resolve
from lorafleet.worker.tenants import AuthenticationError, bearer_token, token_bytes

T = TypeVar("T")


def admin_routes() -> list[web.RouteDef]:
    return [
        web.put("/admin/v1/state", put_state),
        web.get("/admin/v1/state", get_state),
        web.get("/admin/v1/directives", get_directives),
        web.post("/v1/load_lora_adapter", load_lora_adapter),
        web.post("/v1/unload_lora_adapter", unload_lora_adapter),
    ]


def require_admin(request: web.Request) -> None:
    expected = request.app[CONFIG].admin_token
    token = bearer_token(request.headers.get("Authorization"))
    if expected is None:
        raise APIError(401, "the admin API is disabled on this worker (start it with --admin-token)",
                       type="authentication_error", code="admin_disabled")
    if token is not None and hmac.compare_digest(token_bytes(token), token_bytes(expected)):
        return
    tenants = request.app[TENANTS]
    if token is not None and not tenants.is_open:
        try:
            tenant = tenants.authenticate(request.headers.get("Authorization"))
        except AuthenticationError:
            pass
        else:
            raise APIError(403, f"tenant {tenant.name!r} may not manage adapters: this needs the admin token",
                           type="permission_error", code="admin_only")
    raise APIError(401, "missing or wrong admin token: send 'Authorization: Bearer <admin token>'",
                   type="authentication_error", code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer"})


def _local_source(app: web.Application, uri: str, what: str, hashed: bool = True,
                  folders: TenantFolders = NO_FOLDERS) -> tuple[str, str | None]:
    """The source to register for `uri`: its folder resolved inside the worker's adapter roots (the
    stager stages object-store sources into one of them), so what was checked is what is loaded; and the
    digest of its adapter files, each read from a descriptor found in the roots (Sources.verify_local): the
    loader refuses other bytes, so a file swapped for a link out of the roots after this check is never
    loaded. An object-store URI (not staged) passes unchanged, with no digest. A local source is never
    registered without one (or the push's): a folder missing at the check, or whose files are missing, too
    large or unreadable, is refused as the stager answers it (404, 413, 403 permission denied, 422), not passed
    on to be read by path later, when a link out of the roots could stand in its place. 403 for a path out of
    the roots or with '..', or a file found out of them as it is opened; 400 for a relative or malformed one
    (it would be read relative to the worker's working directory). `hashed` False: no digest (the push gives
    one, which the loader holds the bytes it reads to). `folders`: the version's tenant folders (a push's
    VersionRef.folders), which the folder and its files must lie in too, as the stager checks them."""
    sources = app[SOURCES]
    if sources.is_s3(uri):
        return uri, None
    try:
        path = sources.local_path(uri, folders)
        return str(path), sources.verify_local(path, None, what, folders) if hashed else None
    except SourceError as exc:
        if exc.kind == "not_allowed":
            raise APIError(403, f"{what}: {exc}; set --adapter-roots (LORAFLEET_ADAPTER_ROOTS) to allow a folder",
                           type="permission_error", code="source_not_allowed") from None
        status = source_status(exc.kind)
        if status != 400:  # the source's own state: that version's failure (a push's other versions go on)
            raise APIError(status, f"{what}: {exc}", type="permission_error" if status == 403 else
                           "invalid_request_error", code=exc.kind) from None
        raise APIError(400, f"{what}: {exc}", code="invalid_source") from None


def _with_local_sources(app: web.Application, state: DesiredState) -> tuple[DesiredState, dict[str, str]]:
    """`state` with every version's source checked and replaced by the path to register, held to the digest of
    the files checked where the push gives none; and the versions whose source is refused (out of the roots,
    unreadable: name@version -> why), each that version's failure: a push carries every tenant's adapters, and
    one tenant's folder (a link out of the roots added to it) must not hold up the others'. A malformed source
    (400) refuses the push: that is the pusher's fault, not a tenant's."""
    refused: dict[str, str] = {}

    def checked(name: str, ref: VersionRef | None) -> VersionRef | None:
        if ref is None:
            return None
        try:
            uri, digest = _local_source(app, ref.uri, f"adapter {name}@{ref.version}", hashed=ref.sha256 is None,
                                        folders=ref.folders)
        except APIError as err:
            if err.status == 400:
                raise
            refused[f"{name}@{ref.version}"] = f"{err.message} ({err.code})"
            # As the path was registered (resolved): a version served from it stays served (ServedAdapters.apply).
            with contextlib.suppress(SourceError):
                return replace(ref, uri=str(resolve(Path(local_uri_path(ref.uri)))))
            return ref
        return replace(ref, uri=uri, sha256=ref.sha256 or digest)

    adapters = [replace(d, stable=checked(d.name, d.stable), canary=checked(d.name, d.canary)) for d in state.adapters]
    return replace(state, adapters=adapters), refused


def _require_engine(request: web.Request) -> None:
    if ENGINE not in request.app:
        raise APIError(503, "the worker is starting", type="service_unavailable", code="not_ready",
                       headers={"Retry-After": "1"})


async def admin_change(app: web.Application, fn: Callable[..., T], *args: Any) -> T:
    """Run one registry change off the event loop, one at a time. Shielded: a caller that goes
    away does not release the lock while the change is still being applied in its thread."""

    async def locked() -> T:
        async with app[ADMIN_LOCK]:
            try:
                return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
            finally:  # names and versions it retired take their request series along: tenants and
                # rollouts come and go, and a retired version must not linger until its name's next request
                app[METRICS].retain_served(app[ADAPTERS].served_versions())

    return await asyncio.shield(asyncio.ensure_future(locked()))


def state_report(app: web.Application) -> Callable[[], dict[str, Any]]:
    """What the engine holds, read now; the returned call builds the report's JSON body from it, meant for the
    default executor (state_json.reply: a pool's report may take seconds to build and encode)."""
    adapters, host = app[ADAPTERS], app[HOST]
    engine = app[ENGINE].engine
    report = adapters.report(host)
    pool = engine.adapter_pool
    holders = pool.pinned_slot_keys()  # None unless every GPU adapter slot is pinned
    if holders is not None:  # the others are stuck off the GPU until one is unpinned or --max-loras raised,
        for st in report.adapters:  # except a new version of a pinned one: it takes that one's slot
            key = f"{st.name}@{st.version}"
            if key not in holders and not pool.replaces_pinned(key):
                st.num_pinned_slots = len(holders)
    stats = host.pool_stats()
    if stats:
        report.pool_bytes = int(stats.get("capacity_bytes", 0))
        report.pool_slots = int(stats.get("slots", 0))
        report.pool_used_bytes = int(stats.get("bytes", {}).get("gpu", 0))
    report.kv_usage = min(1.0, max(0.0, float(engine.kv_usage)))
    extras = adapters.extras()
    more: dict[str, Any] = {
        "model": adapters.base_model,
        "kv": {"num_pages": engine.page_pool.num_pages, "num_used_pages": engine.page_pool.num_used("kv")},
        "requests": {"running": engine.num_running, "waiting": engine.num_waiting,
                     "admitted": app[ADMISSION].num_admitted},
        "pool": stats,
    }
    if adapters.startup_errors:  # every folder, also one whose name no `adapters` entry can carry
        more["startup"] = {"adapters": app[CONFIG].engine.adapters, "errors": dict(adapters.startup_errors)}

    def build() -> dict[str, Any]:
        body = report.to_dict()
        for a in body["adapters"]:
            a.update(extras.get(f"{a['name']}@{a['version']}", {}))
        return {**body, **more}

    return build


async def put_state(request: web.Request) -> web.Response:
    require_admin(request)
    _require_engine(request)
    try:  # a pool's whole set, not held to the inference limit (--max-body-bytes); parsed off the loop when large
        state = await read_json(request.clone(client_max_size=MAX_STATE_BYTES), then=DesiredState.from_dict)
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"desired state over {MAX_STATE_BYTES} bytes, the most the engine reads",
                       code="body_too_large") from None
    except DirectiveError as exc:
        raise APIError(400, f"bad desired state: {exc}", code="invalid_directive") from None
    app = request.app
    try:
        await admin_change(app, _apply_state, app, state)
    except APIError as err:
        if err.status != 409:
            raise
        build, message = state_report(app), err.message
        return await reply(lambda: {**build(), "error": message}, status=409)
    return await reply(state_report(app))


def _changing(adapters: ServedAdapters, change: Callable[..., T], *args: Any) -> T:
    """Run a change of the served table with no record of the last push meanwhile (a read then must not take
    the table for that push's; a failure midway leaves it so); put back when the change is refused (APIError:
    a stale generation, a name not served or already loaded, raised before anything changes)."""
    pushed, adapters.pushed = adapters.pushed, None
    try:
        return change(*args)
    except APIError:
        adapters.pushed = pushed
        raise


def _apply_state(app: web.Application, state: DesiredState) -> bool:
    """Check the sources of `state`, then apply it (in the admin change's thread: both touch the disk)."""
    adapters = app[ADAPTERS]
    (checked, refused), pushed = _with_local_sources(app, state), adapters.pushed  # a malformed source: nothing changes
    applied = _changing(adapters, adapters.apply, checked, app[HOST], refused)
    adapters.pushed = state if applied else pushed  # not applied: the same generation again
    return applied


async def get_directives(request: web.Request) -> web.Response:
    """The last push as it was sent (`directives`, null if none) while what is served is that push's, and the
    names served: a stager restarted beside this engine learns what its predecessor forwarded, so that its first
    push can reach the engine at once with what needs no download (worker/stager_engine.py). A change that is
    not a push (a vLLM load or unload, a push that failed midway) makes `directives` null until the next push."""
    require_admin(request)
    _require_engine(request)
    adapters = request.app[ADAPTERS]
    pushed, generation, served = adapters.pushed, adapters.generation, adapters.names()
    return await reply(lambda: {"generation_applied": generation, "served": served,
                                "directives": None if pushed is None else pushed.to_dict()})


async def get_state(request: web.Request) -> web.Response:
    require_admin(request)
    _require_engine(request)
    return await reply(state_report(request.app))


async def load_lora_adapter(request: web.Request) -> web.Response:
    require_admin(request)
    _require_engine(request)
    name, path, inplace = parse_load_adapter_request(await read_json(request))
    key = await admin_change(request.app, _load_adapter, request.app, name, path, inplace)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully ({key}).")


def _load_adapter(app: web.Application, name: str, path: str, inplace: bool = False) -> str:
    """Check `path`, then register it as `name` (in the admin change's thread: both touch the disk)."""
    source, digest = _local_source(app, path, f"lora_path of {name!r}")
    return _changing(app[ADAPTERS], app[ADAPTERS].load, name, source, app[HOST], digest, inplace)  # no push's


def _unload_adapter(app: web.Application, name: str) -> None:
    _changing(app[ADAPTERS], app[ADAPTERS].unload, name, app[HOST])


async def unload_lora_adapter(request: web.Request) -> web.Response:
    require_admin(request)
    _require_engine(request)
    name = parse_unload_adapter_request(await read_json(request))
    app = request.app
    await admin_change(app, _unload_adapter, app, name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
