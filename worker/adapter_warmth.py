"""AdapterWarmth: keeping a directive's `warm` versions GPU-resident, as part of `AdapterPool`
(worker/adapter_pool.py). (`warm` here is the directive's flag, GPU-resident on this worker; the
pool's CPU tier is another thing.)

A push marks the versions this worker keeps warm (`set_warm`) and prefetches them once. Pressure may
evict one later: the KV cache's growth, or another adapter's load. The pool brings it back by itself,
but only into room nobody else needs: a free slot and free adapter pages beyond the `kv_reserve` pages
running requests may take next, within its tenant's quota, evicting nothing; never while another
adapter waits for room (requests first), nor when the KV cache was short of pages since the last
check. Its CPU copy is placed; without one it is read again only if the CPU tier has room for it (its
size when last loaded), and placed by a later check. Pinned versions are never evicted; one off the GPU (its
load failed, or every slot was pinned when it was pinned) is wanted again by the same check, after the same
backoff, as a request would want it (evicting idle unpinned adapters), and at once when another is unpinned.

The check runs at most every `warm_check_s`, from `keep_warm` (once per engine step) and `poll` (the
idle loop; `has_pending_loads` says when one is due), looks only at warm versions, and never blocks:
loads and copies run as any other. A failed load is tried again after `warm_retry_s`, doubling with
each failure in a row (at most 64 times); one that the files or settings must fix first waits for a
load that succeeds (a push). A retired version (replaced, removed, unregistered) and one that a push
no longer marks warm are never re-warmed. Among idle adapters of one priority, cold ones are evicted
before warm ones (adapter_placement.py). A push's prefetch of a warm version displaces only idle adapters of
a lower rank (priority, then cold < warm canary < warm stable version: `_warm_rank`); with none, it is left to
this check. It works on the pool's state declared in `AdapterPool.__init__`.

A request's adapter is warmed too (`_read_ahead`): one on neither the GPU nor the CPU tier is read into the
CPU tier as the request arrives, while it waits for a seat, when the CPU budget has room for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lorafleet.worker.adapter_entry import AdapterEntry, AdapterLoadError

MAX_BACKOFF = 64  # the retry delay stops doubling at warm_retry_s × this


@dataclass(slots=True)
class WarmState:
    """How re-warming one warm version went lately."""

    failures: int = 0  # failed loads in a row
    retry_at: float = 0.0  # monotonic time before which it is not loaded again
    seen_error: AdapterLoadError | None = None  # the entry's failure already counted
    num_pages: int = 0  # its image's GPU pages and CPU bytes when last seen (0: never loaded)
    nbytes: int = 0


class AdapterWarmth:
    def set_warm(self, key: str, warm: bool) -> None:
        """Keep `key` GPU-resident whenever room allows (a directive's `warm`), or stop doing so."""
        with self._lock:
            entry = self._get(key)
            if not warm:
                self._warm.pop(key, None)
            elif key not in self._warm:
                self._warm[key] = WarmState(seen_error=entry.error)

    def is_warm(self, key: str) -> bool:
        with self._lock:
            return key in self._warm

    def keep_warm(self, kv_reserve: int = 0) -> None:
        """Once per engine step, never blocking: finish loads in flight (only those are looked at) and, when
        a check is due, bring back warm versions that pressure evicted, leaving `kv_reserve` free pages to
        the running requests."""
        if not self._inflight and (not (self._warm or self._pinned_keys) or time.monotonic() < self._next_warm_check):
            return  # most steps: nothing to look at (read without the lock: a stale look waits one step)
        with self._lock:
            if self._inflight:
                self._advance()
            self._check_warm(kv_reserve)

    # ---- internals -----------------------------------------------------------------------------
    def _warm_check_due(self) -> bool:
        """A check is due and a warm or pinned version is missing from the GPU (cheap: only those versions)."""
        if not (self._warm or self._pinned_keys) or time.monotonic() < self._next_warm_check:
            return False
        now = time.monotonic()
        return (any((e := self._entries.get(k)) is None or not e.on_gpu for k in self._warm)
                or any((e := self._pinned_off(k)) is not None and self._pinned_retry_due(e, now) for k in self._pinned_keys))

    def _pinned_off(self, key: str) -> AdapterEntry | None:
        """The pinned version `key` when it is off the GPU and nothing brings it there (no load, not wanted)."""
        e = self._entries.get(key)
        if e is None or e.retired or not e.pinned or e.on_gpu or e.fetching is not None or key in self._wanted:
            return None
        return e

    def _pinned_retry_due(self, entry: AdapterEntry, now: float) -> bool:
        """A pinned version off the GPU may be wanted again: its failure may pass, and its backoff is over."""
        state = self._pinned_retry.get(entry.key)
        return (entry.error is None or entry.error.retryable) and (state is None or now >= state.retry_at)

    def _rewant_pinned(self, now: float | None) -> None:
        """Want again the pinned versions off the GPU whose failure may pass (after their backoff; `now` None:
        at once, as an unpin may have made the room)."""
        for key in list(self._pinned_keys):
            entry = self._pinned_off(key)
            if entry is None:
                e = self._entries.get(key)
                if e is None or e.retired or not e.pinned or e.resident:  # not while on its way: the backoff doubles
                    self._pinned_retry.pop(key, None)
                continue
            if now is not None:
                self._note_outcome(entry, self._pinned_retry.setdefault(key, WarmState()), now)
            if self._pinned_retry_due(entry, float("inf") if now is None else now):  # None: no backoff
                self._want(entry)

    def _check_warm(self, kv_reserve: int) -> None:
        now = time.monotonic()
        if not (self._warm or self._pinned_keys) or now < self._next_warm_check:
            return
        self._next_warm_check = now + self.config.warm_check_s
        self._rewant_pinned(now)
        kv_short, self._kv_short = self._kv_short, False
        missing: list[tuple[AdapterEntry, WarmState]] = []
        for key, state in list(self._warm.items()):
            entry = self._entries.get(key)
            if entry is None or entry.retired:
                del self._warm[key]  # replaced, removed or unregistered: never re-warmed
                continue
            self._note_outcome(entry, state, now)
            if entry.on_gpu or entry.pinned or entry.fetching is not None or now < state.retry_at:
                continue  # there, on its way, kept by pinning, or backing off
            if entry.error is not None and not entry.error.retryable:
                continue  # the files or settings must change first
            missing.append((entry, state))
        waiting = any((e := self._entries.get(k)) is not None and not e.on_gpu
                      and not (e.image is not None and self._pinned_over_quota(e)) for k in self._wanted)
        if kv_short or waiting:
            return  # the KV cache or a request's adapter needs the room first (not one its owner's pinned quota keeps out)
        for entry, state in sorted(missing, key=lambda m: tuple(-r for r in self._warm_rank(m[0]))):  # stable first
            self._rewarm(entry, state, kv_reserve)

    def _note_outcome(self, entry: AdapterEntry, state: WarmState, now: float) -> None:
        """Count a load of `entry` that failed since the last check (anyone's), or clear the count."""
        if entry.image is not None:
            state.num_pages, state.nbytes = entry.image.num_pages, entry.image.nbytes
        if entry.resident:
            state.failures = 0
        elif entry.error is not None and entry.error is not state.seen_error:
            state.failures += 1
            state.retry_at = now + self.config.warm_retry_s * min(2 ** (state.failures - 1), MAX_BACKOFF)
        state.seen_error = entry.error

    def _rewarm(self, entry: AdapterEntry, state: WarmState, kv_reserve: int) -> None:
        """Start bringing `entry` back if it fits without evicting anything."""
        room = self.page_pool.available("adapter") - kv_reserve
        if not self._free_slots:
            return
        if entry.image is None:
            if state.num_pages <= room and self._cpu_bytes() + state.nbytes <= self.config.cpu_budget_bytes:
                self._start_fetch(entry)  # a later check places it
            return
        if entry.image.num_pages <= room and self._placement_plan(entry) == [] and self._place(entry):
            self._counts["rewarms"] += 1

    def _read_ahead(self, entry: AdapterEntry, tenant: str | None) -> None:
        """A request for `entry`, on neither the GPU nor the CPU tier and not asked for yet, arrived: its read
        starts now, behind the reads requests wait for, so that a request queued behind full seats finds its
        adapter read once the scheduler asks for it. Only while the CPU budget has room for it beside the images
        there and the reads under way, and at most one read ahead per loader thread at once (a read's size is
        a guess until one was read); one that lands over the budget leaves again (`_set_image`): no image leaves
        for it. The ask counts a CPU hit if it landed, else a miss. It fails no one (`_finish_fetch`: the ask reads
        again); none after a failed load."""
        if (entry.on_gpu or entry.image is not None or entry.fetching is not None or entry.retired
                or entry.error is not None or (entry.hung is not None and not entry.hung.done())
                or entry.key in self._wanted or entry.waiters or entry.asked_anonymously):
            return
        ahead = sum(1 for k in self._inflight if (e := self._entries.get(k)) is not None and e.read_ahead)
        if ahead >= self.config.num_load_threads:
            return
        used = self._cpu_bytes() + self._reading_bytes()
        if used + self._expected_bytes(entry) > self.config.cpu_budget_bytes:
            return
        entry.read_ahead, entry.asker = True, tenant
        self._start_fetch(entry)
