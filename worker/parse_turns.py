"""Large request bodies' JSON parsed on one thread, tenants by turns, paced (ParseTurns)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

from lorafleet.worker.fair_executor import FairExecutor
from lorafleet.worker.openai_fields import parse_json

if TYPE_CHECKING:
    from lorafleet.worker.intake import IntakePlace

REST_PER_PARSE = 3.0  # seconds of rest after a parse, per second of it


class ParseTurns:
    """Large bodies' JSON parsed on one thread, tenants by turns, resting after each parse three times as long
    as it took (REST_PER_PARSE).

    json.loads holds the interpreter lock from start to end: a body of a million small values keeps every other
    thread, the event loop's (/healthz) and the engine's step among them, waiting 0.1-0.3 s, and bodies parsed
    back to back on several threads left them the lock only between two parses. One at a time, with a rest three
    times as long as each parse, the parses take at most about a quarter of the interpreter's time, and the
    others' work waits for at most one of them; a tenant's queue of bodies holds another tenant's for at most
    one parse (FairExecutor's turns). A body whose request left while it waited is not parsed. Under a flood of
    such bodies (bench/intake_flood.py, 2 cores) another tenant kept 70-73% of its tokens/s with waits of 0.55 s
    at most, and /healthz answered within 0.34 s; before, 24-31%, waits of 13-17 s, and up to 4.7 s."""

    def __init__(self) -> None:
        self._thread = FairExecutor(1, thread_name_prefix="intake-parse")
        self._rest_until = 0.0  # monotonic time before which no parse starts (read and written on its thread)

    async def parse(self, raw: bytes, tenant: str, place: IntakePlace | None = None) -> Any:
        """`raw`'s JSON, parsed in `tenant`'s turn; the job held by the request's intake `place` (its place is
        kept while the parse runs, and a job still queued when the request leaves is dropped)."""
        left = threading.Event()  # set when the request leaves: a job resting before its parse then parses nothing
        job = self._thread.submit(tenant, lambda: self._parse(raw, left))
        try:
            return await (asyncio.wrap_future(job) if place is None else place.hold(job))
        except asyncio.CancelledError:
            left.set()
            raise
        finally:
            job = None  # an invalid body's error (its traceback holds this frame): no cycle keeps the body

    def _parse(self, raw: bytes, left: threading.Event) -> Any:
        if (rest := self._rest_until - time.monotonic()) > 0:
            left.wait(rest)  # its request leaving ends it: the next job rests what is left of it
        if left.is_set():
            return None
        start = time.thread_time()  # the parse's own time: the lock it held, not the waits for it
        try:
            return parse_json(raw)
        finally:
            self._rest_until = time.monotonic() + REST_PER_PARSE * (time.thread_time() - start)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)
