"""The worker's HTTP service: `create_app(config) -> web.Application`.

State lives under typed `web.AppKey`s (no module globals). The engine is built and its step thread
started in a `cleanup_ctx`, and stopped there after the last request handler is done. `run(config)`
serves the app: on SIGTERM it stops accepting connections, /readyz turns 503, in-flight requests get
`shutdown_grace_s` to finish (a second SIGTERM ends it at once), those still running then end with an
error (a stream with an in-band error chunk; the engine frees their pages at once), and the process
exits 0. SIGTERM while the model loads exits at once. A model folder, keys file or --adapters folder
whose content cannot be served is raised as a StartupError naming the flag (worker/startup_errors.py:
`python -m lorafleet.worker` exits 2 with that one line). Should the engine thread die, /healthz and
/readyz turn 503. With an s3:// --adapters, /readyz stays 503 `loading_adapters` until the stager child's
start-up adapters are registered (worker/startup_adapters.py). With --admin-port the admin routes are
not on this app (404 here): a listener of their own serves them (worker/admin_listener.py). Errors are OpenAI's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from lorafleet.worker.admin_api import admin_routes
from lorafleet.worker.admin_listener import admin_listener_ctx, local_url, metrics_listener_ctx
from lorafleet.worker.app_keys import (
    ADAPTERS,
    ADMIN_LOCK,
    ADMIN_URL,
    CONFIG,
    ENGINE,
    HOST,
    IN_FLIGHT,
    METRICS,
    SOURCES,
    STATUS,
    TENANTS,
    ServerStatus,
)
from lorafleet.worker.async_engine import AsyncEngine
from lorafleet.worker.cors import allow_origins, parse_origins
from lorafleet.worker.engine import Engine, ShutdownError
from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.error_middleware import error_middleware
from lorafleet.worker.intake import setup_intake, several_tenants
from lorafleet.worker.listen import ANY_HOST, port_in_use
from lorafleet.worker.metrics import CONTENT_TYPE, EngineSnapshot, WorkerMetrics, prefix_tokens
from lorafleet.worker.openai_api import openai_routes
from lorafleet.worker.probes import probe_routes
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.sources import Sources, SourcesConfig
from lorafleet.worker.startup_adapters import STARTUP_ADAPTERS, StartupAdapters, keep_running, watch_seed
from lorafleet.worker.startup_errors import StartupError
from lorafleet.worker.startup_refusals import keys_file_refusal, load_refusal
from lorafleet.worker.tenants import Tenants, TenantsError
from lorafleet.worker.worker_config import WorkerConfig

log = logging.getLogger("lorafleet.worker")


def served_model_name(config: WorkerConfig, engine: Engine) -> str:
    return config.served_model_name or engine.model_name


def engine_snapshot(app: web.Application) -> EngineSnapshot:
    engine = app.get(ENGINE)
    if engine is None:
        return EngineSnapshot()
    e = engine.engine
    running, waiting = engine.adapters_in_use()
    return EngineSnapshot(
        num_running=e.num_running, num_waiting=e.num_waiting, num_preemptions=e.num_preemptions,
        grammar_deferrals=e.scheduler.num_grammar_deferrals,
        kv_usage=e.kv_usage, prefix_cache=prefix_tokens(e.block_manager.prefix_cache),
        max_lora=e.config.max_loras, max_num_seqs=e.config.max_num_seqs,
        running_adapters=running,
        waiting_adapters=waiting,
    )


_LOAD_THREAD = "model-load"


async def _load_engine(config: EngineConfig) -> Engine:
    """`Engine(config)` in a daemon thread. SIGTERM during a load of minutes then exits at once: an
    executor thread would be joined at exit, so the process would linger until the load is done."""
    loop = asyncio.get_running_loop()
    loaded: asyncio.Future[Engine] = loop.create_future()

    def settle(engine: Engine | None, exc: BaseException | None) -> None:
        if loaded.done():  # cancelled meanwhile
            return
        if exc is not None:
            loaded.set_exception(exc)
        else:
            loaded.set_result(engine)

    def load() -> None:
        try:
            engine, exc = Engine(config), None
        except BaseException as error:
            engine, exc = None, error
        with contextlib.suppress(RuntimeError):  # the loop closed: the worker stopped while the model loaded
            loop.call_soon_threadsafe(settle, engine, exc)

    threading.Thread(target=load, name=_LOAD_THREAD, daemon=True).start()
    try:
        return await loaded
    except asyncio.CancelledError:
        log.warning("stopping while the model loads: exiting without serving")
        raise


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    t0 = time.monotonic()
    # An object-store --adapters is the stager child's business; the engine starts without it.
    engine_config = dataclasses.replace(config.engine, adapters=None) if config.adapters_uri else config.engine
    if config.served_model_name:  # adapters may name the base as it is served
        engine_config = dataclasses.replace(
            engine_config, base_model_aliases=(*engine_config.base_model_aliases, config.served_model_name))
    try:
        engine = await _load_engine(engine_config)
    except Exception as exc:
        if (refusal := load_refusal(config.engine, exc)) is None:
            raise
        raise refusal from exc
    async_engine = AsyncEngine(engine, on_step=lambda e: app[METRICS].observe_step(
        num_seqs=e.last_batch_size, num_adapters=e.last_batch_adapters))
    base_model = served_model_name(config, engine)
    app[METRICS].model_name = base_model  # the `model_name` label of the vllm:* series
    if any(key.partition("@")[0] == base_model for key in engine.adapters()):
        raise StartupError(f"the base model is served as {base_model!r}, the name of an adapter under --adapters "
                         f"{config.engine.adapters} too: rename that folder or set --served-model-name")
    host = EngineAdapters(engine, base_model=base_model)
    adapters = ServedAdapters(base_model)
    adapters.adopt(host, engine.adapter_dir_report.failed)  # those that failed: GET /admin/v1/state reports them
    app[ENGINE] = async_engine
    engine.scheduler.shared = lambda: several_tenants(app)  # a quarter of the seats stays for the other tenants
    cache = engine.block_manager.prefix_cache

    def tenant_gone(tenant: str) -> None:  # a name given again finds none of its blocks nor prompt logprobs
        engine.runner.tenant_gone(tenant)
        if cache is not None:
            cache.drop_tenant(tenant)

    app[TENANTS].on_gone = tenant_gone
    app[HOST] = host
    app[ADAPTERS] = adapters
    if engine.adapter_pool is not None:
        app[METRICS].register(engine.adapter_pool.metrics.collectors())
    await async_engine.start()
    app[STATUS].ready = True
    log.info("model %s loaded in %.1f s on %s; serving it as %r with adapters: %s", engine.model_dir,
             time.monotonic() - t0, config.engine.device, adapters.base_model,
             ", ".join(adapters.names()) or "none yet")
    if failed := engine.adapter_dir_report.failed:
        log.warning("%d adapter(s) under --adapters %s not served (fix them and push or restart; GET "
                    "/admin/v1/state lists them): %s", len(failed),
                    config.engine.adapters, "; ".join(f"{name}: {why}" for name, why in failed.items()))
    try:
        yield
    finally:
        app[STATUS].ready = False
        await async_engine.stop()


def engine_url(config: WorkerConfig) -> str:
    return local_url(config.host, config.port)


async def _keys_watch_ctx(app: web.Application) -> AsyncIterator[None]:
    """The keys file looked at for a change on a thread (tenants.py): requests check keys in memory."""
    watch = asyncio.create_task(app[TENANTS].watch(), name="keys-file-watch")
    yield
    watch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watch


async def _stager_ctx(app: web.Application) -> AsyncIterator[None]:
    """`--adapters s3://...` without a sidecar: a stager child downloads, verifies and pushes them."""
    config = app[CONFIG]
    uri = config.adapters_uri
    if uri is None:
        yield
        return
    from lorafleet.worker.stager_client import StagerProcess

    cache_dir = config.stager_cache
    env = dict(os.environ, LORAFLEET_ADMIN_TOKEN=config.admin_token or "")  # env, not argv: ps shows argv
    stager = StagerProcess(cache_dir=cache_dir, port=config.stager_port, env=env,
                           log_path=cache_dir.parent / "stager.log",
                           args=["--stager-adapters", uri, "--s3-allow", uri.removeprefix("s3://"),
                                 "--engine-url", app.get(ADMIN_URL) or engine_url(config),  # the admin API
                                 # it stages what this worker loads: the same limit, however it was given
                                 "--max-adapter-file-bytes", str(config.engine.max_adapter_file_bytes)])
    await asyncio.to_thread(stager.start, 60.0)
    log.info("stager child (pid %d) is staging the adapters under %s into %s; log: %s", stager.proc.pid, uri,
             cache_dir, stager.log_path)
    app[STARTUP_ADAPTERS] = startup = StartupAdapters(uri)  # /readyz: 503 until they are registered
    tasks = [asyncio.create_task(watch_seed(startup, url=stager.url, token=stager.token,
                                            generation_applied=lambda: app[ADAPTERS].generation)),
             asyncio.create_task(keep_running(stager))]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(stager.stop)


_CUT_S = 1.0  # after the grace: how long ended requests get to send their error, then cancelled


@web.middleware
async def in_flight_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Track running handlers so that shutdown can wait for them, then end them, within the grace."""
    handlers, task = request.app[IN_FLIGHT], asyncio.current_task()
    handlers.add(task)
    try:
        return await handler(request)
    finally:
        handlers.discard(task)


async def _drain(app: web.Application) -> None:
    """On SIGTERM (after the listeners closed, before aiohttp awaits the handlers): refuse new work,
    give in-flight requests `shutdown_grace_s` to finish (a second signal ends it), then end the rest.
    The engine fails them with ShutdownError, so a stream ends with an in-band error chunk and a plain
    request with an error body; a handler that is still running `_CUT_S` later is cancelled. aiohttp's
    own shutdown timeout would wait the grace once for the handlers and once more after cancelling
    their payloads."""
    status = app[STATUS]
    status.draining = True  # new requests on kept-alive connections get 503
    grace, handlers = app[CONFIG].shutdown_grace_s, app[IN_FLIGHT]
    log.info("shutting down: %d requests in flight get up to %g s to finish", len(handlers), grace)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    end_now = asyncio.ensure_future(status.end_now.wait())
    try:
        while handlers and not end_now.done() and (left := deadline - loop.time()) > 0:
            await asyncio.wait({*handlers, end_now}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        end_now.cancel()
    if not handlers:
        return
    if status.end_now.is_set():
        why = "the worker was told to stop at once"
        log.warning("second signal: ending %d requests still in flight now", len(handlers))
    else:
        why = f"this request outlived its shutdown grace of {grace:g} s"
        log.warning("shutdown grace of %g s is over: ending %d requests still in flight", grace, len(handlers))
    engine = app.get(ENGINE)
    if engine is not None and engine.is_running:
        exc = ShutdownError(f"the worker is shutting down and {why}; retry it on another worker")
        engine.call(lambda e: e.scheduler.fail_all(exc))
        await asyncio.wait(set(handlers), timeout=_CUT_S)
    for task in list(handlers):
        task.cancel()
    if handlers:
        await asyncio.wait(set(handlers), timeout=_CUT_S)


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[METRICS].render_async()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def create_app(config: WorkerConfig) -> web.Application:
    if config.adapters_uri and config.admin_token is None:  # the stager child needs the admin API
        config = dataclasses.replace(config, admin_token=secrets.token_urlsafe(24))
    try:
        tenants = Tenants.from_file(config.api_keys_file)
    except TenantsError as exc:
        raise keys_file_refusal(config.api_keys_file, exc) from exc
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[in_flight_middleware, error_middleware])
    allow_origins(app, parse_origins(config.allowed_origins))
    app[CONFIG] = config
    app[TENANTS] = tenants
    app[STATUS] = ServerStatus(started_at=time.time())
    setup_intake(app, config)  # admission, and the intake threads
    app[ADMIN_LOCK] = asyncio.Lock()
    app[SOURCES] = Sources(SourcesConfig(local_roots=config.local_adapter_roots,  # the engine's file limit: checked alike
                                         max_adapter_file_bytes=config.engine.max_adapter_file_bytes))
    app[METRICS] = WorkerMetrics(lambda: engine_snapshot(app), retired_grace_s=config.retired_series_grace_s,
                                 latency_series=config.adapter_latency_series, lora_info=config.lora_info_metric)
    app[IN_FLIGHT] = set()
    if tenants.path is not None:
        app.cleanup_ctx.append(_keys_watch_ctx)
    app.cleanup_ctx.append(_engine_ctx)
    if config.admin_port is not None:  # the admin API's own listener: up before the stager child, which calls it
        app.cleanup_ctx.append(admin_listener_ctx)
    app.cleanup_ctx.append(_stager_ctx)
    app.on_shutdown.append(_drain)
    app.router.add_routes(probe_routes())
    if config.metrics_port is None:
        app.router.add_get("/metrics", metrics)
    else:  # on a listener of its own (worker/admin_listener.py), up once the engine has loaded
        app.cleanup_ctx.append(metrics_listener_ctx(metrics))
    app.router.add_routes(openai_routes())
    if config.admin_port is None:
        app.router.add_routes(admin_routes())
    if tenants.is_open:
        log.warning("no API keys configured (--api-keys-file): DEVELOPMENT MODE, every caller may use every "
                    "adapter and the base model")
    elif tenants.num_keys == 0:
        log.warning("the API keys file %s lists no key: every inference request is refused (401)",
                    config.api_keys_file)
    else:
        log.info("API keys loaded for tenants: %s", ", ".join(tenants.names))
    if config.admin_token is None:
        log.warning("no --admin-token: the admin API (/admin/v1/*, /v1/load_lora_adapter) refuses every call")
    return app


async def _second_signal_ends_the_grace(app: web.Application) -> None:
    """Shutting down: SIGTERM/SIGINT again ends the requests still in flight at once (as the grace's end
    does), instead of aiohttp's handler, which would exit 1 mid-cleanup, cutting streams and leaving
    the stager child running."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app[STATUS].end_now.set)  # aiohttp removes it after its cleanup


def _exit_if_still_loading(code: int) -> None:
    """Stopped while the model loads: end the process now. The load thread is still inside torch, and
    an interpreter shutdown around it aborts the process (\"terminate called without an active
    exception\", exit 134). The stager child starts only after the load, so none runs yet."""
    if any(t.name == _LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        logging.shutdown()  # flush the log: os._exit skips it
        os._exit(code)


def run(config: WorkerConfig) -> None:
    """Serve until SIGTERM/SIGINT; in-flight requests get `shutdown_grace_s` (a second signal ends it),
    then exit 0."""
    if config.adapters_uri and config.port == 0 and config.admin_port is None:  # the stager child pushes there
        with socket.socket() as sock:
            sock.bind(("" if config.host == ANY_HOST else config.host, 0))
            config = dataclasses.replace(config, port=sock.getsockname()[1])
    app = create_app(config)
    app.on_shutdown.insert(0, _second_signal_ends_the_grace)  # before _drain
    try:
        _serve(app, config)
    except KeyboardInterrupt:
        _exit_if_still_loading(130)
        raise
    except OSError as exc:  # the port was free when checked, before the model loaded, and is taken now
        if exc.errno != errno.EADDRINUSE:
            raise
        raise port_in_use(config.host, config.port) from exc
    _exit_if_still_loading(0)


def _serve(app: web.Application, config: WorkerConfig) -> None:
    web.run_app(
        app,
        host=None if config.host == ANY_HOST else config.host,  # None: every address of every family
        port=config.port,
        shutdown_timeout=_CUT_S,  # _drain has already waited the grace and ended what was left
        handler_cancellation=True,  # a client that goes away cancels its handler -> engine abort
        access_log=None,
        print=lambda msg: log.info("%s", msg),
    )
