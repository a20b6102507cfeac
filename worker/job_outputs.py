"""The outputs of one CompletionJob's choices, merged as they arrive, and the one move a job may make.

A job runs on the version it resolved on arrival. A job that named no version (a bare adapter name,
`re_resolve` set) moves once, before any choice produced an output, so one answer never mixes versions
and a stream never restarts: when the engine no longer holds its version (a push replaced it meanwhile),
to the version serving now; when its version cannot load (a new stable version with a bad file), to the
version the name's split falls back to (`ServedAdapters.mark_failed`); when its canary cannot load for now
(a retryable failure), to the stable version, the split left as it is. A job that pinned `name@version`,
one that moved already, and one with output are answered with the failure. A choice that
started on the job's old version before the job moved has produced nothing (a move needs that): its output
from the old version is dropped and it runs again on the new one.

The job holds its version through its choices in the engine: each is added at once, and one still queued
behind the seats keeps its version registered until it takes it (AdapterPool.hold: no GPU slot, which the
scheduler may still let go of), so a push replacing the version fails none of the job's choices.

A job may have a time limit (--request-timeout-s), counted from its arrival (`job.arrived`, admission: its
body was read and tokenized) to its last output. When it passes, the choices still running are cancelled
at once, whether or not the caller is reading: their engine requests are aborted as when a client
leaves (KV pages and the adapter reference freed at the next step boundary), and the job fails with a 504
`deadline_exceeded` after the outputs produced in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from lorafleet.worker.adapter_entry import AdapterLoadError
from lorafleet.worker.completion_job import CompletionJob
from lorafleet.worker.engine import UnknownAdapterError
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.request_output import RequestOutput
from lorafleet.worker.served_adapters import ServedAdapters

log = logging.getLogger(__name__)

_RE_RESOLVE_TRIES, _RE_RESOLVE_PAUSE_S = 100, 0.02  # up to 2 s for a directive push to finish


async def merged_outputs(async_engine, job: CompletionJob, adapters: ServedAdapters, *,
                         limit_s: float = 0.0) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all choices as they arrive. Closing it aborts what is still running, as
    does `limit_s` seconds after the job's arrival (0: no limit), which then raises a 504 APIError."""
    queue: asyncio.Queue[tuple[int, bool, BaseException | None]] = asyncio.Queue()
    # Per choice, its outputs not taken yet, as one (RequestOutput.then): a client that stops reading holds
    # one output per choice here, not one per engine step, each with a copy of all generated so far.
    pending: dict[int, RequestOutput] = {}
    # An output was queued: the job stays on the version that produced it (`job.adapter`, which cannot
    # move once this is set: every output queued came from it).
    produced = False
    # The scheduler shares seats across tenants; in development mode (one open tenant) by adapter instead.
    tenant = None if job.tenant is None or job.tenant.is_dev else job.tenant.name

    async def run(i: int, request_id: str, adapter: str | None) -> None:
        nonlocal produced
        generated = async_engine.generate(request_id, job.prompt_ids[job.choice_prompt[i]], job.params[i],
                                          adapter, tenant=tenant)
        async with contextlib.aclosing(generated):  # leaving early aborts the engine request at once
            async for out in generated:
                if job.adapter != adapter:  # the job moved while this choice started on its old version
                    raise _Moved(adapter)
                produced = True
                if i in pending:
                    pending[i] = pending[i].then(out)
                else:
                    pending[i] = out
                    queue.put_nowait((i, True, None))

    async def pump(i: int) -> None:
        request_id = f"{job.request_id}-{i}"
        try:
            adapter = job.adapter
            try:
                await run(i, request_id, adapter)
            except (UnknownAdapterError, _Moved):
                # The version resolved on arrival went before this choice produced anything (replaced or
                # unloaded): resolve once more, for all choices of the job, and run on that; unless the job
                # has output already (from that version: it cannot change versions any more).
                if job.adapter == adapter and (produced or not await _re_resolve(job, adapter, lambda: produced)):
                    raise
                await run(i, f"{request_id}r", job.adapter)
            except AdapterLoadError as exc:
                if job.adapter == adapter and (produced or not _fall_back(job, exc, adapters)):
                    raise
                await run(i, f"{request_id}r", job.adapter)
            queue.put_nowait((i, False, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait((i, False, exc))

    tasks = [asyncio.create_task(pump(i)) for i in range(job.num_choices)]
    clock = _time_limit(job, limit_s, tasks, queue) if limit_s else None
    try:
        remaining = len(tasks)
        while remaining:
            i, has_output, exc = await queue.get()
            if exc is not None:
                raise exc
            if not has_output:
                remaining -= 1
                continue
            yield i, pending.pop(i)
    finally:
        if clock is not None:
            clock.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _time_limit(job: CompletionJob, limit_s: float, tasks: list[asyncio.Task],
                queue: asyncio.Queue) -> asyncio.TimerHandle:
    """At `limit_s` after the job's arrival: cancel its choices (which aborts their engine requests) and queue
    the 504 behind the outputs they produced in time. A job whose choices all ended in time is let be."""

    def expire() -> None:
        running = [t for t in tasks if not t.done()]
        if not running:  # its last output came in time; the caller is still reading it
            return
        for t in running:
            t.cancel()
        log.warning("request %s (%s) passed --request-timeout-s %g s: aborted its %d sequence(s) still running",
                    job.request_id, job.model, limit_s, len(running))
        queue.put_nowait((-1, False, APIError(
            504, f"the request did not finish within {limit_s:g} s, the longest this worker serves one request "
                 "(--request-timeout-s); its generation was stopped. Ask for fewer tokens (max_tokens), or retry "
                 "when the worker is less busy", type="timeout_error", code="deadline_exceeded",
            # The openai clients retry a 504 twice by default: the same request would take the limit thrice.
            headers={"x-should-retry": "false"})))

    return asyncio.get_running_loop().call_later(max(0.0, job.arrived + limit_s - time.monotonic()), expire)


class _Moved(Exception):
    """A choice's output came from a version the job has moved off (before any of its output was sent)."""

    def __init__(self, adapter: str | None) -> None:
        super().__init__(f"the job moved off {adapter}")


async def _re_resolve(job: CompletionJob, adapter: str | None, produced: Callable[[], bool]) -> bool:
    """Move the job off `adapter`, which the engine no longer holds; False if nothing replaced it, if the
    name itself is gone or refused now (the caller answers the original failure: the version went), or if
    a choice produced an output meanwhile (`produced()`: the job stays on the version that made it)."""
    if job.re_resolve is None:
        return False
    # The push swaps the served table right after registering the new version: until then the old table
    # may still name the dropped version. Bounded wait for the swap.
    for _ in range(_RE_RESOLVE_TRIES):
        if job.adapter != adapter:  # another choice of the job re-resolved meanwhile
            return True
        if produced():
            return False
        try:
            key = job.re_resolve()
        except APIError:  # unloaded, or no longer this tenant's: no version to move to
            return False
        if key != adapter:
            _move(job, key)
            return True
        await asyncio.sleep(_RE_RESOLVE_PAUSE_S)
    return False


def _fall_back(job: CompletionJob, exc: AdapterLoadError, adapters: ServedAdapters) -> bool:
    """Move a job that named no version, and whose version cannot load, to the version the name's split
    now points to (the one a new stable version was to replace), before it produced anything; False if
    there is none. Once per job: resolving spends `re_resolve`, so a second failure is the answer. A
    retryable failure leaves the split as it is; but a canary's user is served by the stable version this
    time (a canary must not answer 503 where the stable version would answer)."""
    if job.re_resolve is None:
        return False
    if exc.retryable:
        name, _, version = exc.key.partition("@")
        served = adapters.get(name)
        if (served is None or version != served.split.canary or served.split.stable in served.errors
                or not job.tenant.may_use(name, served.tenant)):  # the name may have changed owner meanwhile
            return False
        key = f"{name}@{served.split.stable}"
    else:
        adapters.mark_failed(exc.key, exc.reason)
        try:
            key = job.re_resolve()
        except APIError:  # nothing to fall back to (503), or the name is gone: the load failure is the answer
            return False
    if key == job.adapter:
        return False
    job.failed_over = job.adapter  # counted on that version too (a canary's failures must show on it)
    _move(job, key)
    return True


def _move(job: CompletionJob, key: str | None) -> None:
    """The job's one move: to engine key `key`; it spends `re_resolve`. The request holds `key`'s metric
    series from now on (`on_move`): a push may retire `key` while the job runs on it."""
    job.adapter, job.model, job.re_resolve = key, key or job.model, None
    if job.on_move is not None:
        job.on_move(key)
