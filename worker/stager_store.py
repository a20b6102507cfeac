"""StoreHealth: whether the object store answers, as the stager last saw it.

A push stages a few of its versions at once (`stage_concurrency`). A store that is down, or hung (it accepts connections and
never answers), would make every version's listing wait out the client's read timeouts and retries,
minutes per push, while later pushes queue behind it. So:

* a push's first call to the store, every check that a cached copy is current (a version without a
  sha256) and every call while the store is down are quick ones (`store_check_timeout_s`, one retry; doubled
  after a quick call that timed out, up to 4 times it: a store slower than the check is not down for good);
  the others (a download, the listing a copy without a sha256 is keyed by) end by `download_timeout_s`
  (worker/store_clients.py), so a store that answered the push's first call and then hangs costs the
  push one download's timeout;
* the first failure to reach the store, or a call it did not answer in time (a connect or read timeout,
  an object none of whose bytes came by the deadline), marks it down (the first 5xx or cut body of a push's
  downloads only if a quick listing of its version fails too: else that object's own failure; not a stall,
  throttling or a second one): for the rest of the push that made
  that call no version calls it again (`StoreDown`); a call made before a push began (a superseded push's
  download, left running, that times out later) marks the store down but does not spare the newer push
  its own quick call; the state is the one the latest-made call found (a late failure of a call older than
  one the store answered, or a late answer to a call older than one it failed, changes nothing): a version
  with a cached copy is served from it, one without fails at once. A download that was receiving bytes and
  ran out of `download_timeout_s` (a big adapter, a slow link) is that version's failure alone: the store
  answered, the other versions still call it. Stages of one push that run at once share this: one that
  waited for another's download (the same cache key) or for a thread does not call the store once it is down;
* the next push calls it again (quickly), and the first answer ends the outage: versions are checked
  and new uploads picked up as before.

The outage is logged when it starts and ends, counted in `lorafleet_stager_store_up` and
`lorafleet_stager_store_fallbacks`, and reported under `"store"` in `GET /v1/state`'s `disk` section.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import urllib3

from lorafleet.worker.stager_metrics import StagerMetrics
from lorafleet.worker.staging_errors import is_busy, staging_error
from lorafleet.worker.store_clients import StoreSilent

log = logging.getLogger("lorafleet.stager")
T = TypeVar("T")


class StoreDown(ConnectionError):
    """Not tried: the store did not answer earlier in this push (answered as object store unavailable)."""


def timed_out(exc: BaseException) -> bool:
    """Whether a call failed as an answer did not come in time (a read timeout, the call's own limit), not as the
    store could not be reached or refused it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TimeoutError | StoreSilent | urllib3.exceptions.ReadTimeoutError):
            return True
        exc = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc.__cause__ or exc.__context__
    return False


def is_outage(exc: BaseException) -> bool:
    """A failure to reach the store (down, hung, a dropped connection) or a call it did not answer in time
    (a read timeout, StoreSilent), not its refusal (an S3 error answer: a missing object, access denied), a
    download that ran out of its time while bytes came (TimeoutError), the adapter's fault (a digest
    mismatch) or the node's full disk."""
    if type(exc).__name__ == "S3Error":  # an answer: down only when it says so itself (busy, throttling, restarting)
        return is_busy(exc)
    return isinstance(exc, Exception) and staging_error(exc, "").code == "object_store_unavailable"


class StoreHealth:
    def __init__(self, metrics: StagerMetrics) -> None:
        self.metrics = metrics
        self.down_since: float | None = None  # time.monotonic() of the failure that started the outage
        self.failed_call_at: float | None = None  # when the latest-made call that failed in this outage was made
        self.answered_at: float | None = None  # of the latest answer
        self.answered_call_at: float | None = None  # when the latest-made call that was answered was made
        self.error: str | None = None  # the latest failure
        self.num_fallbacks = 0  # versions served from a cached copy the store could not check
        metrics.store_up.set(1)

    @property
    def is_down(self) -> bool:
        return self.down_since is not None

    def is_quick(self, push_start: float | None) -> bool:
        """Whether the next call should be a quick one: while the store is down, and as a push's first
        call (`push_start`: time.monotonic() when the push began; None: not a push's call)."""
        return self.is_down or (push_start is not None and (self.answered_at or -1.0) < push_start)

    def skip(self, push_start: float | None) -> None:
        """Raise StoreDown when a call made since the push that began at `push_start` found the store down."""
        if push_start is not None and self.failed_call_at is not None and self.failed_call_at >= push_start:
            raise StoreDown(f"not tried: the store did not answer earlier in this push; the next push tries it "
                            f"again ({self.error})")

    def failed(self, exc: BaseException, call_start: float | None = None) -> None:
        """Note `exc` when it says the store could not be reached or did not answer in time. `call_start`
        (time.monotonic()): when the failed call was made (default: now), which decides the pushes it spares
        the store (`skip`)."""
        if isinstance(exc, StoreDown) or not is_outage(exc):
            return
        now = time.monotonic()
        made = now if call_start is None else call_start
        if self.answered_call_at is not None and made < self.answered_call_at:
            return  # older news: a call made after this one was answered (a superseded push's download)
        self.failed_call_at = made if self.failed_call_at is None else max(self.failed_call_at, made)
        self.error = f"{type(exc).__name__}: {exc}"[:300]
        if self.down_since is None:
            self.down_since = now
            self.metrics.store_up.set(0)
            log.warning("object store unreachable (%s): cached copies are served unchecked and other versions "
                        "fail until it answers; each push tries it once, quickly", self.error)

    def answered(self, call_start: float | None = None) -> None:
        """Note an answer to a call made at `call_start` (default: now). It ends an outage unless a call made
        after it found the store down (a late answer to an older call: the push that failed stays off it)."""
        self.answered_at = now = time.monotonic()
        made = now if call_start is None else call_start
        self.answered_call_at = made if self.answered_call_at is None else max(self.answered_call_at, made)
        if self.failed_call_at is not None and made < self.failed_call_at:
            return
        if self.down_since is not None:
            log.info("object store answers again after %.0f s of outage", now - self.down_since)
            self.down_since = self.failed_call_at = None
            self.metrics.store_up.set(1)

    def fell_back(self, uri: str, key: str) -> None:
        """`uri` is served from its cached copy `key`: the store could not say whether it is current."""
        self.num_fallbacks += 1
        self.metrics.store_fallbacks.inc()
        log.info("%s: serving the cached copy %s unchecked (object store unreachable)", uri, key)

    def to_dict(self) -> dict[str, Any]:
        down_s = None if self.down_since is None else round(time.monotonic() - self.down_since, 1)
        return {"reachable": not self.is_down, "down_s": down_s, "error": self.error if self.is_down else None,
                "fallbacks": self.num_fallbacks}


class StoreThreads:
    """The threads the stager's store calls and downloads run on, its own: `stage_concurrency` downloads may each
    wait out a slow store for minutes, and on asyncio's default threads (min(32, cores + 4)) they held up state
    reports and the JSON of forwards, a kill switch's among them, behind them."""

    def __init__(self, stage_concurrency: int) -> None:
        # A push's stages, those of the push it replaced (they go on) and the seed's listing, with room to spare.
        self._pool = ThreadPoolExecutor(max_workers=2 * stage_concurrency + 4, thread_name_prefix="stager-store")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    @staticmethod
    async def within(call: Awaitable[T], limit: float, what: str) -> T:
        """`call`'s answer, or StoreSilent (an outage) once it ran `limit` seconds."""
        try:
            return await asyncio.wait_for(call, limit)
        except TimeoutError:
            raise StoreSilent(f"{what} did not end within {limit:.0f} s") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

