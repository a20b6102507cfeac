"""StoreClients: the object-store (minio) clients of one `Sources`, by how long a call may wait.

* `client()`: reads give up after `READ_S`, retried twice (listing the folders under a prefix); a 5xx
  answer is retried as a failed read is (`RETRY_STATUSES`);
* `client(quick=True)`: after `quick_timeout_s`, retried once: checks that have a cached copy to fall back on,
  and calls to a store that did not answer lately (worker/stager_store.py). `quick_timeout_s` is
  `store_check_timeout_s`, doubled after each quick call that timed out, up to QUICK_MAX_FACTOR times it, and
  back to it once one is answered in that time (`quick_outcome`): a store up but slower than the check (every
  answer in 4 s) was otherwise down for good, as every call to a store seen down is a quick one;
* `client(deadline=...)`: one of its own for a download or listing that must end by its deadline: each
  request's attempts, retries included, share the time left when it is sent, so a store that stops
  answering holds the call until about its deadline, never for every attempt's full read timeout (a read
  timeout: the store did not answer; `StoreSilent`: an object none of whose bytes came by the deadline).

Each attempt of every client ends by its bound, its connection shut down then (`_BoundedPool`): read timeouts
alone never end an answer sent a byte at a time. Every client fails fast when the store is down (minio's default
retries for minutes), and a redirect is an error, never followed: it could point anywhere, out of the
bucket/prefix allow-list.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import urllib3

from lorafleet.worker.source_error import SourceError

if TYPE_CHECKING:
    from lorafleet.worker.sources import SourcesConfig

READ_S = 30.0  # read timeout of the full client
CONNECT_S = 3.0
RETRIES = 2  # of the full client and of a deadline's
ATTEMPT_READS = 4  # an attempt of the full or quick client ends after CONNECT_S + this many read timeouts (_BoundedPool)
QUICK_MAX_FACTOR = 4  # a quick call waits at most this many times store_check_timeout_s (a hung store: 2 x 12 s a push)


class StoreSilent(ConnectionError):
    """The store sent nothing of an answer before the call's deadline (hung, frozen): an outage, answered as
    object store unavailable. A download that was receiving bytes and ran out of time is a TimeoutError,
    the version's own failure."""


class StoreClients:
    def __init__(self, config: SourcesConfig) -> None:
        self.config = config
        self._full = self._quick = None
        self.quick_timeout_s = config.store_check_timeout_s
        self._regions: dict[str, str] = {}  # bucket -> region, as the first client to ask learned it

    def quick_outcome(self, timed_out: bool, answered_in: float | None) -> None:
        """A quick call `timed_out`: the next ones wait twice as long (up to QUICK_MAX_FACTOR x the configured).
        One answered within the configured time (`answered_in` seconds): they wait that again."""
        configured = self.config.store_check_timeout_s
        if timed_out and self.quick_timeout_s < QUICK_MAX_FACTOR * configured:
            self.quick_timeout_s, self._quick = min(2 * self.quick_timeout_s, QUICK_MAX_FACTOR * configured), None
        elif answered_in is not None and answered_in <= configured and self.quick_timeout_s != configured:
            self.quick_timeout_s, self._quick = configured, None

    def client(self, *, quick: bool = False, deadline: float | None = None):
        """The client for a call (see the module docstring); `deadline`: time.monotonic() it must end by
        (a request sent after it raises TimeoutError without calling the store)."""
        if deadline is not None:
            return self._new(_DeadlinePool(deadline))
        if quick:
            client = self._quick  # read once: `quick_outcome` on another thread may clear it meanwhile
            if client is None:
                client = self._quick = self._new(_pool(self.quick_timeout_s, retries=1))
            return client
        if self._full is None:
            self._full = self._new(_pool(READ_S, retries=RETRIES))
        return self._full

    def _new(self, http: urllib3.PoolManager):
        from minio import Minio

        c = self.config
        if not c.s3_endpoint:
            raise SourceError("no object store configured: set LORAFLEET_S3_ENDPOINT (host:port)")
        client = Minio(
            c.s3_endpoint,
            access_key=c.s3_access_key,
            secret_key=c.s3_secret_key,
            secure=c.s3_secure,
            region=c.s3_region,
            http_client=http,
        )
        if isinstance(getattr(client, "_region_map", None), dict):
            # Each download has a client of its own (its deadline): without a region configured, each asked the
            # store for the bucket's location first, one more round trip per download. They share what one learned.
            client._region_map = self._regions
        return client


# Answers a store sends when it sheds load (S3's 503 SlowDown, a gateway's 502/504) or fails for a moment: asked
# again, as boto3 does, at once and then after 1 s (urllib3's backoff; a Retry-After is not waited for, as it
# could outlast the call's deadline). The last answer is passed on as it came, to be classified
# (worker/staging_errors.py).
RETRY_STATUSES = (500, 502, 503, 504)


def _retry(retries: int) -> urllib3.Retry:
    return urllib3.Retry(total=retries, backoff_factor=0.5, connect=1, redirect=False,
                         status_forcelist=RETRY_STATUSES, raise_on_status=False, respect_retry_after_header=False)


class _BoundedPool(urllib3.PoolManager):
    """A pool each of whose attempts ends by its bound (`bound()`: time.monotonic() for an attempt sent now): at it,
    a timer shuts the attempt's connection down. Read timeouts alone never end an answer that comes a byte at a
    time, each before the read timeout (a congested link, a store in trouble): a listing, whose whole body is read
    inside the request, held its thread for as long as the store kept trickling, long after its caller gave up."""

    def __init__(self, bound: Callable[[], float], **kw) -> None:
        super().__init__(**kw)
        self.bound = bound
        self.pool_classes_by_scheme = {"http": _BoundedHTTPPool, "https": _BoundedHTTPSPool}

    def _new_pool(self, scheme, host, port, request_context=None):
        pool = super()._new_pool(scheme, host, port, request_context)
        pool.bound = self.bound
        return pool


def _cut_when_due(pool, conn, method, url, *args, **kw):
    """`conn`'s request (`_make_request`), its connection shut down if it is still running at the pool's bound;
    past it (a retry after a cut), not sent: the request ends there, as its retries ran out (a TimeoutError
    would be retried after a back-off, the thread held a second or more past the bound)."""
    left = pool.bound() - time.monotonic()
    if left <= 0:
        raise urllib3.exceptions.MaxRetryError(pool, url, TimeoutError("not sent: the call's time is up"))
    done = threading.Event()
    _arm(left, conn, done)
    try:
        return urllib3.HTTPConnectionPool._make_request(pool, conn, method, url, *args, **kw)
    finally:
        done.set()


def _arm(after_s: float, conn, done: threading.Event) -> None:
    timer = threading.Timer(after_s, _shut, (conn, done))
    timer.daemon = True
    timer.start()


def _shut(conn, done: threading.Event) -> None:
    if done.is_set():
        return
    sock = getattr(conn, "sock", None)
    if sock is None:  # still connecting (within CONNECT_S): looked at again shortly
        _arm(0.05, conn, done)
        return
    with contextlib.suppress(OSError):  # closed meanwhile
        sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns: the attempt fails (ProtocolError)


class _BoundedHTTPPool(urllib3.HTTPConnectionPool):
    _make_request = _cut_when_due


class _BoundedHTTPSPool(urllib3.HTTPSConnectionPool):
    _make_request = _cut_when_due


def _pool(read_s: float, *, retries: int) -> urllib3.PoolManager:
    """The full and quick clients' pool: each attempt ends CONNECT_S + ATTEMPT_READS read timeouts after it is sent."""
    attempt_s = CONNECT_S + ATTEMPT_READS * read_s
    return _BoundedPool(lambda: time.monotonic() + attempt_s, timeout=urllib3.Timeout(connect=CONNECT_S, read=read_s),
                        retries=_retry(retries))


class _DeadlinePool(_BoundedPool):
    """A pool whose every request ends by `deadline`: its 1 + RETRIES attempts wait at most an equal share
    of the time left when it is sent (and never longer than the full client's timeouts)."""

    def __init__(self, deadline: float) -> None:
        super().__init__(lambda: deadline, retries=_retry(RETRIES))
        self.deadline = deadline

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw):
        share = (self.deadline - time.monotonic()) / (1 + RETRIES)
        if share <= 0:
            raise TimeoutError(f"{method} {url}: not sent, the call's deadline has passed")
        kw["timeout"] = urllib3.Timeout(connect=min(CONNECT_S, share), read=min(READ_S, share))
        return super().urlopen(method, url, redirect, **kw)
