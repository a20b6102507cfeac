"""The stager: its own process beside the engine (the pod's sidecar, or a child the worker starts).

It is the only component that talks to the object store or holds its credentials. It downloads
adapter directories, checks their sha256, and writes them atomically into the node-local disk cache
(`DiskCache`); the engine loads from local disk only. HTTP on localhost, every call but `/healthz`
needs `Authorization: Bearer <stager token>` (the routes: stager_http.py):

* `POST /v1/stage {"uri", "sha256"?}` -> `{"path", "sha256", "cached", "bytes"}`: the engine asks for
  an adapter it lacks. Concurrent requests for one adapter share one download.
* `PUT /v1/directives` (a `DesiredState`): forward at once, with local paths, to the engine's
  `PUT /admin/v1/state` what needs no download (worker/stager_push.py), stage every version, then forward
  the rest; a newer push takes over from one still staging. Answered once staged, or with `Prefer:
  respond-async` (the operator's) 202 once forwarded at once while its versions are still being staged
  (reported at tier `none` with `staging`); a stager that has forwarded nothing yet takes what its engine
  reports it holds (`GET /admin/v1/directives`) as forwarded, and answers once staged only when the engine
  cannot tell (it serves adapters no push gave it). A push that finds its engine starting (its model loading:
  503 `not_ready`, or nothing listening) is answered at once with respond-async, stages meanwhile, and reaches
  the engine once it is up (stager_push.py); `/readyz` (stager_http.py) can wait for that. Same generation:
  no-op; lower: 409. A version that cannot be staged (store down, digest mismatch) is reported with its
  error; an adapter whose new version fails keeps its previously forwarded (already local) version, so the
  store being down never takes away what is served (nor after a restart: each cache entry records the URI
  it was staged from, so a version without a sha256 falls back to its last copy as before the restart). A store that
  does not answer costs a push one quick check, and one that stops answering during the push one
  download's timeout, not every version's timeouts (worker/stager_store.py): the rest of the push serves
  cached copies. A copy keyed by its sha256 goes to a URI only once that URI's own objects hashed to it
  (staged_copy.ORIGINS_FILE). The disk cache keeps, whatever its budget, the copies the engine may read
  (worker/stager_holds.py): those it is served, those the push in progress stages, and those of versions a
  push replaced while the engine still reports them (a fallback); the others go first.
* `GET /v1/state`: the engine's `ReportedState`, plus tier `disk` for staged versions the engine has
  not loaded, staging errors, a `disk` section (cache bytes, downloads, hits, progress) and, while
  `--stager-adapters` is what is served, a `seed` section (folders not served and why, its push's generation).
* `GET /metrics` (no token): the disk tier's hits, misses, downloads, failures, latency, cache (`lorafleet_stager_*`).

Run: `python -m lorafleet.worker.stager --stager-port 8100 --stager-cache-dir /cache ...`; the token comes
from `LORAFLEET_STAGER_TOKEN` (not visible in `ps`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from lorafleet.worker import staged_copy
from lorafleet.worker.directives import AdapterDirective, DesiredState, ReportedState
from lorafleet.worker.disk_cache import DiskCache, cache_write, dir_bytes
from lorafleet.worker.sources import Etags, SourceError, Sources, check_digest, verify_digest
from lorafleet.worker.staged_copy import DIGEST_FILE, Staged, last_copies, record_source, verify_staged_copy
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_engine import EngineLink
from lorafleet.worker.stager_holds import CacheHolds
from lorafleet.worker.stager_local import LocalReads, forget_flight
from lorafleet.worker.stager_locks import KeyLocks
from lorafleet.worker.stager_metrics import StagerMetrics, progress_by_uri
from lorafleet.worker.stager_push import apply_push
from lorafleet.worker.stager_report import FolderSizes, stager_state
from lorafleet.worker.stager_seed import SeedReport, seed
from lorafleet.worker.stager_store import StoreDown, StoreHealth, StoreThreads, timed_out
from lorafleet.worker.staging_errors import is_object_fault, is_refusal
from lorafleet.worker.store_clients import StoreSilent
from lorafleet.worker.tenant_folders import NO_FOLDERS, TenantFolders

log = logging.getLogger("lorafleet.stager")
_STALL_GRACE_S = 120.0  # beyond download_timeout_s: the store's calls end by then, what follows (verifying) may not
RECENT_DOWNLOADS = 100  # download times kept for `disk_stats` (all of them: the histogram in /metrics)


class Stager:
    def __init__(self, config: StagerConfig) -> None:
        self.config = config
        self.sources = Sources(config.sources_config())
        self.cache = DiskCache(Path(config.stager_cache_dir), config.stager_cache_bytes, config.stager_cache_limit_bytes)
        self._locks = KeyLocks()  # per cache key, while in use
        self._flights: dict[tuple[str, str], asyncio.Future] = {}  # (cache key, uri) -> its stage in progress
        # uri -> cache key of its last staged copy (store-down fallback); an earlier run's, from the cache's entries
        self._by_uri: dict[str, str] = last_copies(self.cache)
        self.holds = CacheHolds(self.cache.root, config.stage_lease_s)
        self.counts = {"downloads": 0, "download_bytes": 0, "hits": 0, "misses": 0, "failures": 0}
        self.download_seconds: deque[float] = deque(maxlen=RECENT_DOWNLOADS)
        self.downloading: dict[str, tuple[str, int, int]] = {}  # cache key -> (uri, bytes done, total), in progress
        self.generation = 0
        self.unsent: int | None = None  # a generation whose forward the engine refused: taken again if pushed again
        self.unsent_why = ""  # why (its report's error until a forward reaches the engine)
        self.desired: DesiredState | None = None
        self.forwarded: dict[str, AdapterDirective] = {}  # name -> directive with local paths
        self.staged: dict[tuple[str, str], Staged] = {}  # (name, version) -> staged copy
        self.errors: dict[tuple[str, str], str] = {}
        self.pending: dict[tuple[str, str], str] = {}  # versions of the push in progress not forwarded yet -> URI
        # The push (its start; None: stages outside a push) whose one object fault was excused (_stage_key)
        self._excused: float | None = -1.0
        self._excused_at = 0.0  # when the listing that excused it began
        self.seed_report: SeedReport | None = None  # while what is served is the seed's (`--stager-adapters`)
        self.delivered = False  # a push reached the engine (or an earlier stager's had: adopted), /readyz's gate
        self.started_at = time.monotonic()
        self.engine = EngineLink(config.engine_url, config.admin_token) if config.engine_url else None
        self._pool_size = (0, 0)  # the engine's last reported (pool_bytes, pool_slots): said while it is away
        self.apply_lock = asyncio.Lock()  # a push's steps that change what is forwarded (never a download)
        self.staging_lock = asyncio.Lock()  # one push stages at a time
        self.superseded = asyncio.Event()  # the latest push's: set once a newer one begins
        self._pushes: set[asyncio.Task] = set()  # start()'s
        self.local_reads = LocalReads(self._local)  # local folders being checked, each on a thread of its own
        self.folder_sizes = FolderSizes()  # of the local folders staged (GET /v1/state)
        self.metrics = StagerMetrics(self.cache)
        self.registry = self.metrics.registry
        self.store, self.store_threads = StoreHealth(self.metrics), StoreThreads(config.stage_concurrency)

    # ---- staging -------------------------------------------------------------------------------
    async def stage(self, uri: str, sha256: str | None, *, held: set[str] | None = None,
                    push_start: float | None = None, folders: TenantFolders = NO_FOLDERS) -> Staged:
        """Stage `uri` into the disk cache. Its cache key is protected from eviction before the cache is
        looked up: added to `held` (a push's keys), or else (the engine's request) leased for
        `stage_lease_s`, as the engine loads from the path after it is handed out. `push_start` (time.monotonic())
        of a push: the store is not called again once it failed since (StoreHealth). `folders`: VersionRef's."""
        if sha256 is not None:
            sha256 = sha256.lower()
        if not self.sources.is_s3(uri):
            staged = await self.local_reads.read(uri, self.config.download_timeout_s, folders)
            if sha256 is not None and staged.sha256 != sha256:  # a shared read may predate the files' change
                staged = await self.local_reads.read(uri, self.config.download_timeout_s, folders)
            check_digest(staged.sha256, sha256, uri)  # each caller's own: one read serves them all
            self.metrics.requests.labels("local").inc()
            return staged
        self.sources.check_s3(uri)
        etags = None  # what the key names: the download must fetch exactly these objects
        fell_back = None  # the listing's failure, where the URI's last copy is to serve instead
        if sha256 is not None:
            key, copy = sha256, self.copy_for(sha256, uri)
            if copy is None and self._same_bytes(uri, sha256):
                key = self._by_uri[uri]  # staged before under its listing's key (the seed's): no second download
            elif copy is None:  # to be downloaded: a store seen down is checked quickly first
                self.store.skip(push_start)
                if self.store.is_quick(push_start):
                    await self._list(uri, True)
        else:
            fallback = self._by_uri.get(uri)  # the last staged copy of this URI, served while the store is down
            if fallback is not None and self.cache.get(fallback) is None:
                fallback = None
            try:
                self.store.skip(push_start)
                etags = await self._list(uri, fallback is not None or self.store.is_quick(push_start))
                key = "u-" + hashlib.sha256(repr((uri, etags)).encode()).hexdigest()[:40]
            except Exception as exc:
                # Only while the store cannot be reached: its refusal (access denied, the bucket gone) is an
                # answer, and may be how an adapter was withdrawn.
                if fallback is None or isinstance(exc, SourceError) or is_refusal(exc):
                    raise
                key, fell_back = fallback, exc
                self.store.fell_back(uri, key)
        if held is not None:
            held.add(key)
        else:
            self.holds.lease(key)
        # Concurrent requests for one adapter share one flight: one download, and all of them get its
        # result or its error. A caller that goes away (client disconnect) does not cancel it for the others.
        flight = self._flights.get((key, uri))
        if flight is None:
            flight = asyncio.ensure_future(self._stage_key(uri, sha256, key, etags, push_start, fell_back))
            self._flights[(key, uri)] = flight
            flight.add_done_callback(functools.partial(forget_flight, self._flights, (key, uri)))
        try:
            staged = await asyncio.shield(flight)
            if held is not None:  # its entry, or the variant of it with this URI's own tokenizer files
                held.add(staged.path.name)
        except Exception:
            self._count_request("miss")
            raise
        finally:
            if held is None:  # the engine's request; a push forgets once, when it is done
                self.forget_uris()
        self._count_request("hit" if staged.cached else "miss")
        check_digest(staged.sha256, sha256, uri)  # whatever the entry's key: the bytes handed out are the ones asked for
        return staged

    async def _list(self, uri: str, quick: bool, start: float | None = None) -> Etags:
        """The objects under `uri`: a quick check, or a listing that ends by `download_timeout_s`; `start`: when the
        call counts as made (default: now). A store answering a byte at a time is cut off here, as silent."""
        start = time.monotonic() if start is None else start
        deadline = None if quick else start + self.config.download_timeout_s
        limit = 4 * self.sources.clients.quick_timeout_s if quick else deadline - time.monotonic() + 1.0
        listing = self.store_threads.run(self.sources.object_etags, uri, quick=quick, deadline=deadline)
        try:
            etags = await self.store_threads.within(listing, limit, f"{uri}: the listing")
        except Exception as exc:
            self.sources.clients.quick_outcome(quick and timed_out(exc), None)  # slow, maybe: the next waits longer
            if deadline is not None and time.monotonic() >= deadline and timed_out(exc):
                # Ended by its client at the deadline or here after it, whichever came first: one answer, silence.
                silent = StoreSilent(f"{uri}: the listing did not end within {self.config.download_timeout_s:g} s")
                self.store.failed(silent, start)
                raise silent from None
            self.store.failed(exc, start)
            raise
        self.store.answered(start)
        self.sources.clients.quick_outcome(False, time.monotonic() - start if quick else None)
        return etags

    async def _answers(self, uri: str, start: float | None = None) -> bool:
        """Whether the store answers a quick listing of `uri` now. A download's failure that may be its
        object's own (staging_errors.is_object_fault) is then that version's, and the push's other versions
        still call the store: one broken object had failed every version staged after it, push after push."""
        try:
            await self._list(uri, True, start)
        except Exception:  # noted as the outage it is
            return False
        return True

    def copy_for(self, key: str, uri: str) -> Path | None:
        """Entry `key` if it may go to `uri`: keyed by a digest, once `uri`'s objects hashed to it (ORIGINS_FILE)."""
        path = self.cache.get(key)
        return path if path is not None and (len(key) != 64 or staged_copy.has_origin(path, uri)) else None

    def _same_bytes(self, uri: str, sha256: str) -> bool:
        """`uri`'s last staged copy holds exactly the files of digest `sha256` (and is still cached)."""
        key = self._by_uri.get(uri)
        path = self.cache.get(key) if key is not None else None
        try:
            return path is not None and (path / DIGEST_FILE).read_text().strip() == sha256
        except OSError:
            return False

    def _local(self, uri: str, folders: TenantFolders) -> Staged:
        path = self.sources.local_path(uri, folders)
        return Staged(path, self.sources.verify_local(path, None, uri, folders), cached=True)

    def _count_request(self, outcome: str) -> None:
        self.counts["hits" if outcome == "hit" else "misses"] += 1
        self.metrics.requests.labels(outcome).inc()

    async def _stage_key(self, uri: str, sha256: str | None, key: str, etags: Etags | None = None,
                         push_start: float | None = None, fell_back: Exception | None = None) -> Staged:
        """Entry `key` for `uri`: found in the cache, else downloaded. `fell_back`: the listing failed and `key` is
        the URI's last copy; gone or damaged, it is never filled by a download (the key names other bytes than
        the ones the URI holds now): the listing's failure is the answer."""
        async with self._locks.hold(key):  # one cache key, other URIs: the second finds the first's copy
            path = self.copy_for(key, uri)  # another URI's copy of these bytes: this URI's are downloaded first
            if path is not None and key in self.cache.unverified:
                path = await self.store_threads.run(verify_staged_copy, self.cache, key)
            if path is not None:
                self._by_uri[uri] = key
                record_source(path, uri)  # its last copy now, also for a stager restarted later
                return Staged(path, (path / DIGEST_FILE).read_text().strip(), cached=True)
            if fell_back is not None:
                raise fell_back
            t0, start = time.perf_counter(), time.monotonic()
            deadline = start + self.config.download_timeout_s
            try:
                # The download gives up at the deadline itself (and removes its temp copy); the outer bound
                # only covers a thread that still hangs after it.
                path = await asyncio.wait_for(
                    self.store_threads.run(self._download, uri, sha256, key, deadline, etags, push_start),
                    self.config.download_timeout_s + _STALL_GRACE_S)
            except StoreDown:  # not tried: no failed download
                raise
            except Exception as exc:
                self.counts["failures"] += 1
                self.metrics.failures.inc()
                # One object's fault per push (each engine request's, no push's record touched) is excused when
                # the store answers a listing now; a second one, or a stall, is the store's.
                pushed = push_start is not None
                excuse = is_object_fault(exc) and not self.store.is_down and not (pushed and push_start == self._excused)
                # A second fault of the push is the store's even if its call began before the listing that excused
                # the first (stages side by side): dated just after that listing began, so that listing's answer
                # does not end the outage, and a newer push's calls (made later) are not spared by it.
                second = is_object_fault(exc) and pushed and push_start == self._excused
                listed_at = time.monotonic()
                before = self._excused, self._excused_at
                if excuse and pushed:  # taken before the listing's answer: a fault beside it is a second one
                    self._excused, self._excused_at = push_start, listed_at
                if not (excuse and await self._answers(uri, listed_at)):
                    self._excused, self._excused_at = before
                    self.store.failed(exc, max(start, self._excused_at + 1e-6) if second else start)
                raise
            self.store.answered(start)
            self.download_seconds.append(time.perf_counter() - t0)
            self.metrics.seconds.observe(self.download_seconds[-1])
            staged_copy.note_download(path, uri)  # also when an entry of the same bytes was there: this copy was dropped
            self.counts["downloads"] += 1
            nbytes = dir_bytes(path)
            self.counts["download_bytes"] += nbytes
            self.metrics.downloads.inc()
            self.metrics.download_bytes.inc(nbytes)
            self._by_uri[uri] = path.name  # `key`, or its variant of this URI's own tokenizer files
            if path.name != key:
                self.holds.lease(path.name)  # as `key` is (held or leased) until what staged it is served
            return Staged(path, (path / DIGEST_FILE).read_text().strip(), cached=False)

    def _download(self, uri: str, sha256: str | None, key: str, deadline: float, etags: Etags | None,
                  push_start: float | None) -> Path:
        # Checked as the thread starts: a stage of this push that waited (for this key's lock, for a thread)
        # while another download found the store down does not call it.
        self.store.skip(push_start)

        def fill(tmp: Path) -> None:
            reserved = [None]  # this fill's (a fill retried after a full disk reserves again)

            def progress(done: int, total: int) -> None:
                if reserved[0] != total:  # listed (again): room for its bytes, keeping the URI's last copy, the
                    reserved[0] = total  # fallback should this download fail with the store down
                    self.cache.reserve(tmp, total, protect=lambda: {*self.protected(), *filter(None, [self.last_copy(uri)])})
                self.downloading[key] = (uri, done, total)  # by key: one URI may be downloaded under two at once

            self.sources.download(uri, tmp, progress=progress, deadline=deadline, etags=etags)
            digest = verify_digest(tmp, sha256, uri)  # before the rename: a bad download is never visible
            cache_write(lambda: (tmp / DIGEST_FILE).write_text(digest + "\n"))
            cache_write(lambda: staged_copy.note_download(tmp, uri))  # counted in the entry's size
            # Another URI's copy of this digest with other tokenizer files: this URI's files are its own copy,
            # or the loader would check (and serve) the other URI's tokenizer files for it.
            staged_copy.keep_variant(self.cache, key, tmp, protect=lambda: {*self.protected(), key})

        try:
            return self.cache.put(key, fill, protect=self.protected)
        except staged_copy.VariantKept as variant:
            return variant.path
        finally:
            self.downloading.pop(key, None)

    def last_copy(self, uri: str) -> str | None:
        """The cache key of `uri`'s last staged copy (what a store outage falls back to)."""
        return self._by_uri.get(uri)

    def protected(self) -> set[str]:
        return self.holds.protected(self.staged)

    def forget_uris(self) -> None:
        """Forget the URIs no longer desired whose copy left the cache (no outage fallback left to give):
        one entry per URI ever staged would pile up over a long life of adapter churn."""
        desired = {ref.uri for a in (self.desired.adapters if self.desired is not None else ())
                   for ref in (a.stable, a.canary) if ref is not None}
        cached = set(self.cache.entries())
        self._by_uri = {u: k for u, k in self._by_uri.items() if k in cached or u in desired}

    # ---- directives ----------------------------------------------------------------------------
    async def apply(self, desired: DesiredState, *, seed: SeedReport | None = None,
                    begun: asyncio.Event | None = None) -> ReportedState:
        """Stage and forward `desired` (worker/stager_push.py); its report once its versions are staged, or once
        a newer push took over. What needs no download reaches the engine first: `begun` is set then (else, when
        nothing was forwarded since the stager started, once the push ends). `seed`:
        the seed's report when it made this push (its failures are reported with the push's own); None for
        a push from elsewhere, which ends the seed."""
        return await apply_push(self, desired, seed=seed, begun=begun)

    def start(self, desired: DesiredState) -> tuple[asyncio.Task, asyncio.Event]:
        """`apply(desired)` in a task of the stager's own, which runs to its end whether or not anyone waits
        for it (a push answered before its downloads are in), and the event `apply` sets once the push has
        reached the engine with what needs no download, or once it ends (refused, or its first step left out)."""
        begun = asyncio.Event()
        task = asyncio.ensure_future(self.apply(desired, begun=begun))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: its waiter may have gone
        return task, begun

    def cancel_pushes(self) -> None:
        for task in list(self._pushes):
            task.cancel()

    async def state(self) -> ReportedState:
        """What `GET /v1/state` answers (worker/stager_report.py)."""
        return await stager_state(self)

    def disk_stats(self) -> dict[str, Any]:
        return {"cache_bytes": self.cache.used_bytes, "cache_reserved_bytes": self.cache.reserved_bytes,
                "cache_entries": len(self.cache.entries()),
                "cache_evictions": self.cache.evictions, **self.counts, "store": self.store.to_dict(),
                "downloading": progress_by_uri(self.downloading), "download_seconds": list(self.download_seconds)}

    async def seed(self, uri: str) -> SeedReport:
        """Serve every adapter folder under `uri` that stages, report the others (worker/stager_seed.py)."""
        return await seed(self, uri)


if __name__ == "__main__":
    from lorafleet.worker.stager_cli import main  # its flags and start-up checks

    main()

