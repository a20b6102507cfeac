"""The admin API on a listener of its own (`--admin-port`), off the port a Service exposes.

With `--admin-port` the public app (worker/server.py) has no admin route: `/admin/v1/*` and the vLLM
`/v1/load_lora_adapter`, `/v1/unload_lora_adapter` answer 404 there, as any unknown path. They are served
by a second, small app on `--admin-host` (default 127.0.0.1: in a pod, only its own containers, the stager
sidecar, reach it), with the same admin token. It shares the worker's state (the same objects under the
same keys) and starts in the worker's `cleanup_ctx` once the engine is loaded, before the stager child,
which is given its URL. On shutdown the public listener closes first and in-flight requests drain; the
admin listener stays open meanwhile (the stager's pushes still land) and closes after the stager child
stopped, before the engine does.

`--metrics-port` does the same for `/metrics` (with the probes): served on a port of its own, on `--host`, and
404 on `--port`, so that a Service publishing `--port` to tenants tells none of them which adapters the others
run and how much, while Prometheus scrapes the metrics port.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from lorafleet.worker.admin_api import admin_routes
from lorafleet.worker.app_keys import ADMIN_URL, CONFIG, METRICS_URL
from lorafleet.worker.error_middleware import error_middleware
from lorafleet.worker.listen import close_all, listen_sockets
from lorafleet.worker.probes import probe_routes

log = logging.getLogger("lorafleet.worker")

_CUT_S = 1.0  # on shutdown: how long admin requests still running get before they are cancelled


def local_url(host: str, port: int) -> str:
    """The base URL a process on this machine calls `host:port` by (a wildcard address: the loopback of its
    family: `::` listens on IPv6 only, worker/listen.py)."""
    if host in ("0.0.0.0", "", "*"):  # "*": every family (listen.ANY_HOST), IPv4's loopback among them
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:  # a name
        pass
    return f"http://{host}:{port}"


def _side_app(app: web.Application, routes: list[web.RouteDef], **kwargs) -> web.Application:
    """An app serving `routes` over the state of the worker's `app` (every key of it, the engine's included)."""
    side = web.Application(**kwargs)
    for key, value in app.items():
        side[key] = value
    side.router.add_routes(routes)
    return side


def create_admin_app(app: web.Application) -> web.Application:
    """The admin routes over the state of the worker's `app`."""
    return _side_app(app, admin_routes(), client_max_size=app[CONFIG].max_body_bytes, middlewares=[error_middleware])


async def _serve(side: web.Application, host: str, port: int, *, host_flag: str,
                 port_flag: str) -> tuple[web.AppRunner, list[web.SockSite], int]:
    """`side` started on host:port: its runner, sites and the port it got. A port taken meanwhile is a
    StartupError naming `port_flag`."""
    sockets = listen_sockets(host, port, host_flag=host_flag, port_flag=port_flag)
    runner = web.AppRunner(side, handler_cancellation=True, access_log=None, shutdown_timeout=_CUT_S)
    sites: list[web.SockSite] = []
    try:
        await runner.setup()
        for sock in sockets:
            sites.append(site := web.SockSite(runner, sock))
            await site.start()
    except BaseException:
        await runner.cleanup()
        close_all(sockets)
        raise
    return runner, sites, sockets[0].getsockname()[1]


async def admin_listener_ctx(app: web.Application) -> AsyncIterator[None]:
    """Serve the admin app on `--admin-host`/`--admin-port` (after the engine's ctx: it needs the engine) and
    note its URL under ADMIN_URL."""
    config = app[CONFIG]
    host = config.admin_listen_host
    runner, sites, port = await _serve(create_admin_app(app), host, config.admin_port,
                                       host_flag="--admin-host", port_flag="--admin-port")
    app[ADMIN_URL] = local_url(host, port)
    log.info(
        "admin API (/admin/v1/*, /v1/load_lora_adapter) on %s only (--admin-port), not on --port",
        ", ".join(site.name for site in sites),
    )
    try:
        yield
    finally:
        await runner.cleanup()


def create_metrics_app(app: web.Application, metrics_handler) -> web.Application:
    """/metrics and the probes over the state of the worker's `app`."""
    return _side_app(app, [*probe_routes(), web.get("/metrics", metrics_handler)])


def metrics_listener_ctx(metrics_handler):
    """The cleanup context serving /metrics and the probes on `--host`/`--metrics-port`."""
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        config = app[CONFIG]
        runner, sites, port = await _serve(create_metrics_app(app, metrics_handler), config.host,
                                           config.metrics_port, host_flag="--host", port_flag="--metrics-port")
        app[METRICS_URL] = local_url(config.host, port)
        log.info("/metrics on %s only (--metrics-port), not on --port", ", ".join(site.name for site in sites))
        try:
            yield
        finally:
            await runner.cleanup()
    return ctx
