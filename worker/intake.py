"""Request intake: what a request costs before admission counts its sequences (reading its body,
parsing the JSON, tokenizing), bounded so that a burst cannot grow memory and CPU with connections x
--max-body-bytes while the queue is full anyway.

Before the body is read, a request is refused with 429 and `Retry-After` when not even one more
sequence of its tenant would be admitted now (`queue_full`, `tenant_queue_full`: its requests being read
count), or when `--max-intake-requests` requests are in intake already (`intake_full`). A body that has not arrived
`--request-read-timeout-s` after the worker began reading it is answered 408 (`request_timeout`), which
frees its intake place: clients that upload slowly cannot hold intake. Bodies over LARGE_BODY_BYTES
are parsed off the event loop, one at a time and paced (ParseTurns), then tokenized on the intake threads
(both by turns of tenants), so that the event loop (and /healthz with it) and the engine's steps keep going
while they are; a text past the context by its length alone is refused untokenized (token_floor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import _default_expect_handler

from lorafleet.worker.admission import (
    INTAKE_FULL,
    REQUEST_TIMEOUT,
    TENANT_INTAKE_FULL,
    TENANT_QUEUE_FULL,
    Admission,
)
from lorafleet.worker.app_keys import (
    ADMISSION,
    CONFIG,
    ENGINE,
    INTAKE_THREADS,
    INTAKE_WAITS,
    METRICS,
    PARSE_TURNS,
    STATUS,
    TENANTS,
)
from lorafleet.worker.fair_executor import FairExecutor
from lorafleet.worker.intake_waits import IntakeWaits
from lorafleet.worker.metrics import UNRESOLVED_LABEL
from lorafleet.worker.openai_protocol import APIError, parse_json
from lorafleet.worker.parse_turns import ParseTurns
from lorafleet.worker.tenants import AuthenticationError, Tenant
from lorafleet.worker.worker_config import WorkerConfig

LARGE_BODY_BYTES = 64 * 1024  # larger bodies are parsed off the event loop
INTAKE_THREADS_NUM = min(32, (os.cpu_count() or 1) + 4)  # as asyncio's default executor


def ready_engine(app: web.Application):
    """The engine (a 503 with Retry-After while the worker starts or drains)."""
    if app[STATUS].draining or ENGINE not in app:
        raise APIError(503, "the worker is shutting down or not ready; retry on another worker",
                       type="service_unavailable", code="not_ready", headers={"Retry-After": "1"})
    return app[ENGINE].engine


def authenticate(request: web.Request) -> Tenant:
    """The caller's tenant, from its bearer key (401 without a key the keys file knows)."""
    try:
        return request.app[TENANTS].authenticate(request.headers.get("Authorization"))
    except AuthenticationError as exc:
        raise APIError(401, str(exc), type="authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"}) from None


def refused(app: web.Application, reason: str, tenant: str, num_seqs: int | None = None) -> APIError:
    """The 429 of a refusal by admission (`reason`: queue_full, tenant_queue_full, intake_full), counted in
    the metrics. `num_seqs`: what the request needs, when known (after its body was parsed)."""
    admission = app[ADMISSION]
    app[METRICS].rejected.labels(reason).inc()
    retry = str(app[CONFIG].retry_after_s)
    headers = {"Retry-After": retry}
    needs = "no sequence, but your requests being read reach that many" if num_seqs == 0 else \
        f"{num_seqs} more" if num_seqs else "at least 1 more"
    if reason == TENANT_QUEUE_FULL:
        held = admission.num_admitted_by_tenant.get(tenant, 0)
        reading = admission.num_in_intake_by_tenant.get(tenant, 0)
        more = f" and {reading} requests being read" if reading else ""
        cap = admission.tenant_cap(several_tenants(app))
        why = "--max-sequences-per-tenant" if cap == admission.max_per_tenant else \
            f"of the worker's {admission.capacity}, a quarter stays for the other tenants"
        return APIError(429, f"tenant {tenant} has {held} sequences admitted{more} and may have at most "
                             f"{cap} at once ({why}); this request needs "
                             f"{needs}. Retry after {retry} s or when your requests in flight finish",
                        type="rate_limit_error", code=reason, headers=headers)
    if reason == TENANT_INTAKE_FULL:
        return APIError(429, f"tenant {tenant} has {admission.num_in_intake_by_tenant.get(tenant, 0)} requests being "
                             f"read, the most one tenant may (of the worker's {admission.max_intake} intake places, "
                             f"--max-intake-requests, a quarter stays for the others); retry after {retry} s",
                        type="rate_limit_error", code=reason, headers=headers)
    if reason == INTAKE_FULL:
        return APIError(429, f"the worker is reading {admission.num_in_intake} requests already (at most "
                             f"{admission.max_intake} at once, --max-intake-requests); retry after {retry} s",
                        type="rate_limit_error", code=reason, headers=headers)
    return APIError(429, f"the worker's queue is full ({admission.capacity} sequences admitted); retry "
                         f"after {retry} s", type="rate_limit_error", code=reason, headers=headers)


def check_room(app: web.Application, tenant: str) -> None:
    """Raise the 429 at once, before the body is read, when not even one more sequence of `tenant` fits."""
    if reason := app[ADMISSION].early_refusal(tenant, several_tenants(app)):
        raise refused(app, reason, tenant)


async def expect_room(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: the answer the request would get before its body is read (401, a 503 while the
    worker starts, the 429 when not one more sequence of its tenant fits, or every intake place is taken and
    --intake-wait-s is 0) goes
    instead of 100 Continue, so a client that waits for it (curl, some HTTP libraries) never uploads a body a
    full worker would not read; else 100 Continue."""
    app = request.app
    try:
        ready_engine(app)
        tenant = authenticate(request).name
        check_room(app, tenant)
        reason = app[ADMISSION].intake_refusal(tenant, shared=several_tenants(app))
        if reason and (reason != INTAKE_FULL or not app[CONFIG].intake_wait_s):  # a full intake is waited for
            raise refused(app, reason, tenant)
    except APIError as exc:  # counted as the handler would have (it does not run)
        endpoint = "chat" if request.path.endswith("/chat/completions") else "completions"
        app[METRICS].observe_request(adapter=UNRESOLVED_LABEL, endpoint=endpoint, status=exc.status)
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    return await _default_expect_handler(request)


def several_tenants(app: web.Application) -> bool:
    """Whether several tenants share the worker (a keys file with two or more): one may then hold at most three
    quarters of its intake places and of its sequences."""
    tenants = app[TENANTS]
    return not tenants.is_open and len(tenants.names) > 1


class IntakePlace:
    """One intake place held. Work it hands to the intake threads (`run`), or a parse it holds (`hold`), keeps
    the place until that work ends, even when the handler is cancelled first (its client left): the threads hold
    no more parses and tokenizations than there are places, whoever disconnects. Work still queued then is
    cancelled, and frees the place at once."""

    def __init__(self, threads: FairExecutor, tenant: str) -> None:
        self.work: asyncio.Future | None = None  # the last work handed to the executor
        self._threads, self.tenant = threads, tenant

    async def run(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the intake threads, in its tenant's turn: one tenant's megabyte prompts being tokenized
        do not queue another tenant's small request behind them all (26 s behind eight, first come first
        served)."""
        return await self.hold(self._threads.submit(self.tenant, fn))

    async def hold(self, job: Future) -> Any:
        """`job`'s result, the job kept as this place's work: a handler cancelled (its client left) while the job
        runs leaves the place held until it ends, and one cancelled while it waits cancels it (it never runs, and
        what it holds goes)."""
        work = self.work = asyncio.wrap_future(job)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            job.cancel()  # nothing for a job already running
            raise
        finally:
            # Done: forgotten, here and in this frame, so that its exception's traceback (holding this frame, and the
            # request's parsed body in its own) is not kept in a reference cycle until a collection comes.
            if work.done():
                self.work = None
            work = job = None


def setup_intake(app: web.Application, config: WorkerConfig) -> None:
    """The worker's admission, and the threads intake work runs on (released at the app's cleanup)."""
    admission = app[ADMISSION] = Admission(config.capacity, config.max_sequences_per_tenant, config.intake_limit)
    app[INTAKE_WAITS] = IntakeWaits(admission)
    threads = app[INTAKE_THREADS] = FairExecutor(INTAKE_THREADS_NUM, spare_threads=2, thread_name_prefix="intake")
    parses = app[PARSE_TURNS] = ParseTurns()

    async def stop(_: web.Application) -> None:
        threads.shutdown(wait=False)
        parses.shutdown()

    app.on_cleanup.append(stop)


@contextlib.asynccontextmanager
async def intake_place(app: web.Application, tenant: str, sequences: bool = True) -> AsyncIterator[IntakePlace]:
    """Hold one of the `--max-intake-requests` intake places while reading, parsing and tokenizing; none
    free for --intake-wait-s (IntakeWaits): 429 intake_full, the body unread; nor where `tenant`'s admitted
    sequences and requests in intake reach --max-sequences-per-tenant (429 tenant_queue_full: one tenant cannot
    hold every intake place). `sequences` False: a request that will need none (/tokenize): its tenant's
    requests in intake alone count."""
    admission, waits = app[ADMISSION], app[INTAKE_WAITS]
    if reason := await waits.enter(tenant, sequences, several_tenants(app), app[CONFIG].intake_wait_s):
        raise refused(app, reason, tenant, None if sequences else 0)
    place = IntakePlace(app[INTAKE_THREADS], tenant)

    def leave() -> None:
        admission.leave_intake(tenant)
        waits.wake()

    try:
        yield place
    finally:
        work = place.work
        if work is None or work.done():
            leave()
        else:  # the handler was cancelled while its work runs: the place is left when the work ends
            def left(done: asyncio.Future) -> None:
                leave()
                if not done.cancelled():
                    done.exception()  # retrieved: nobody awaits it any more

            work.add_done_callback(left)


async def read_body(request: web.Request) -> bytes:
    """The whole body, or 408 request_timeout (counted in the metrics) when it has not arrived within
    --request-read-timeout-s. Over --max-body-bytes: aiohttp raises 413."""
    app = request.app
    timeout = app[CONFIG].request_read_timeout_s
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except RequestPayloadError:  # a body that does not decompress as its Content-Encoding says
        request.protocol.close()  # the connection closes after the answer, what is left of the body unread
        request.content.feed_eof()
        encoding = request.headers.get("Content-Encoding", "")[:40]
        raise APIError(400, f"the request body could not be read as its Content-Encoding ({encoding!r}) says; send "
                            "it compressed as named, or uncompressed without the header", code="invalid_body",
                       headers={"Connection": "close"}) from None
    except TimeoutError:
        app[METRICS].rejected.labels(REQUEST_TIMEOUT).inc()
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (--request-read-timeout-s); "
                            "send the body with the headers, or retry", code=REQUEST_TIMEOUT) from None


async def read_json(request: web.Request, then: Callable[[Any], Any] | None = None,
                    place: IntakePlace | None = None) -> Any:
    """The parsed body (see `read_body`), and `then(body)` when given. A body over LARGE_BODY_BYTES is parsed off
    the event loop: with an intake `place`, in its tenant's turn on the one paced parse thread (ParseTurns), with
    `then` on the intake threads; without one (the admin API's), in the default executor."""
    raw = await read_body(request)

    def parse() -> Any:
        body = parse_json(raw)
        return body if then is None else then(body)

    if len(raw) <= LARGE_BODY_BYTES:
        return parse()
    if place is None:  # the admin API's: a trusted caller
        return await asyncio.get_running_loop().run_in_executor(None, parse)
    body = await request.app[PARSE_TURNS].parse(raw, place.tenant, place)
    return body if then is None else await place.run(lambda: then(body))
