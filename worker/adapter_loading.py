"""AdapterLoading: how an adapter travels to the GPU, as part of `AdapterPool` (worker/adapter_pool.py).

disk/stager -> `AdapterImage` in (pinned) CPU memory in a loader thread (`_start_fetch`), then CPU ->
its pool pages through the `PageCopier` (`_start_copy`); `_advance` finishes whatever completed
without blocking, `_sweep_wanted` moves the adapters waiting for room on. A slot becomes visible in
the layout only when its copy finished. A failure fails exactly the requests waiting for that load; a new
version loading to become current stays so after a retryable failure (a read error, a timeout: the next
request's load may succeed and switch to it), not after one that cannot pass by itself (its files).
It works on the pool's state (`_entries`, `_wanted`, `_inflight`, `_pending`, ...) declared in
`AdapterPool.__init__`; placement and eviction are in worker/adapter_placement.py.
"""

from __future__ import annotations

import time
from concurrent.futures import wait as wait_futures

import torch

from lorafleet.worker.adapter_entry import AdapterEntry, AdapterLoadError
from lorafleet.worker.adapter_image import pack_adapter
from lorafleet.worker.engine_errors import is_failure
from lorafleet.worker.read_room import STUCK_READ_S, ReadRoom


class AdapterLoading:
    _room: ReadRoom | None = None  # the last sweep's, kept up to date with the reads started since
    _largest_image = 0  # bytes of the largest image read so far: what a read of an adapter never read may take
    _last_advance = 0.0  # monotonic time of the last _advance: a read crossing STUCK_READ_S since makes a sweep

    def _advance(self) -> bool:
        """Finish what completed among the loads in flight (cheap: only those are looked at)."""
        timeout = self.config.load_timeout_s
        now = time.monotonic()
        last, self._last_advance = self._last_advance, now
        changed = False
        for key in list(self._inflight):
            entry = self._entries.get(key)
            if entry is None:
                self._inflight.discard(key)
                continue
            if entry.fetching is not None and entry.fetch_began and last < entry.fetch_began[0] + STUCK_READ_S <= now:
                changed = True  # stuck from now on, it holds no room (worker/read_room.py): reads in line may start
            if entry.fetching is not None and entry.fetching.done():
                self._finish_fetch(entry)
                changed = True
            elif entry.fetching is not None and timeout is not None and (
                    why := self._fetch_overdue(entry, now, timeout)) is not None:
                # Its thread is stuck: its result, if it ever comes, is dropped, and no second read of this
                # version starts while it has not come back (each would hold one more thread).
                entry.hung, entry.fetching = entry.fetching, None
                entry.hung.add_done_callback(lambda done, entry=entry: self._unhung(entry, done))
                self._fail(entry, why, tier="disk", retryable=True)
                changed = True
            if entry.copying is not None and self._copier.is_done(entry.copying):
                self._finish_copy(entry)
                changed = True
            if entry.fetching is None and entry.copying is None:
                self._inflight.discard(key)
        if timeout is not None and self._inflight:
            self._replace_stuck_threads(now, timeout)
        if changed:  # memory moved: adapters waiting for room may fit now
            self._sweep_wanted()
            self._update_gauges()
        return changed

    def _sweep_wanted(self) -> None:
        """Place the wanted adapters read already, start the reads of the others. A slot that frees goes to an
        adapter a request waits for before a pin or a warm-up, and to the tenant whose requests hold the fewest
        slots (`_busy_slots`), in request order within one tenant's: in the order they were asked for, one tenant's
        burst of adapters took every slot that freed while another tenant's request waited (13-20 s for a first
        token, where its turn came at the next slot)."""
        unread, ready = [], []
        for key in list(self._wanted):
            entry = self._entries.get(key)
            if entry is None or entry.on_gpu:
                self._wanted.pop(key, None)
            elif entry.image is None:
                if entry.fetching is None:
                    unread.append(entry)
            else:
                ready.append(entry)
        busy = self._busy_slots() if ready else {}
        while ready:  # the first (a request's, of the least busy tenant)
            entry = min(ready, key=lambda e: (not _waited_for(e), busy.get(_group(e), 0)))
            ready.remove(entry)
            if self._try_place(entry):
                busy[_group(entry)] = busy.get(_group(entry), 0) + 1
        if self._start_wanted_reads(unread):
            self._trim_cpu(protect=None)  # idle images make way for the reads a request waits for

    def _busy_slots(self) -> dict[str, int]:
        """tenant -> GPU slots its requests use now (an adapter one owner lends to many counts for each tenant
        using it), or that are being copied for it. A pinned adapter no request uses counts for nobody: it would
        keep its owner's next request behind every other tenant's for as long as it stays pinned."""
        busy: dict[str, int] = {}
        for entry in self._slot_owner.values():
            users = list(entry.holders) or ([_group(entry)] if entry.refcount > 0 or entry.copying is not None else [])
            for tenant in users:
                busy[tenant] = busy.get(tenant, 0) + 1
        return busy

    def _read_room(self) -> ReadRoom:
        """The room the CPU budget leaves for reads for the GPU now (worker/read_room.py)."""
        room = ReadRoom(self.config.cpu_budget_bytes, self.config.num_load_threads,
                        lambda owner, count, nbytes: self.config.quota(owner).exceeded(count, nbytes))
        for entry in self._slot_owner.values():  # what cannot leave the GPU: in use, being copied, pinned
            if entry.refcount > 0 or entry.copying is not None or entry.pinned:
                busy = room.busy.setdefault(entry.tenant, [0, 0])
                busy[0] += 1
                busy[1] += entry.gpu_bytes
        stuck = time.monotonic() - STUCK_READ_S
        for key in self._wanted.keys() | self._inflight:  # an image being copied is still in the CPU tier
            entry = self._entries.get(key)
            if entry is None or entry.resident:
                continue
            group = _group(entry)  # an image found in the CPU tier: the tenant asking now
            if entry.copying is not None:
                room.took(group, entry.image.nbytes)
            elif key not in self._wanted or not _waited_for(entry):
                continue  # a warm-up's, or one whose requests were refused (pinned adapters keep it out): not paced
            elif entry.image is not None:
                if not room.waits_for_quota(entry.tenant, entry.image.nbytes):  # else its owner's quota, not room
                    room.took(group, entry.image.nbytes)
            elif entry.fetching is not None and not _stuck(entry, stuck):
                room.waits_for_quota(entry.tenant, self._expected_bytes(entry))
                room.took(group, self._expected_bytes(entry), first_read=not entry.image_bytes)
        return room

    def _expected_bytes(self, entry: AdapterEntry) -> int:
        """What a read of `entry` will take: its last image's size, else the largest image read so far (0: none)."""
        return entry.image_bytes or self._largest_image

    def _start_wanted_reads(self, unread: list[AdapterEntry], room: ReadRoom | None = None) -> bool:
        """Start the reads of `unread` (wanted on the GPU, neither read nor being read) the CPU budget has room
        for (worker/read_room.py): a request's before a warm-up's, each group's in request order. The room
        stays for the newly wanted adapters until the next sweep (`_want`). Whether any started."""
        order = {e.key: i for i, e in enumerate(unread)}
        unread.sort(key=lambda e: (not _waited_for(e), order[e.key]))
        self._room = room = room or self._read_room()
        room.budget = self.config.cpu_budget_bytes  # configure() may have changed it since the sweep
        began = False
        for entry in unread:
            group, nbytes = entry.asker or entry.tenant, self._expected_bytes(entry)
            if not _waited_for(entry):
                self._start_fetch(entry)  # a warm-up (prefetch, pinned, a new version's): as without pacing
                continue
            if room.quota_waits.get(entry.tenant) and room.held_back(entry.tenant, nbytes):
                continue  # one image at a time waits for its owner's GPU quota: it is placed first when a place frees
            if not room.may_read(group, nbytes, first_read=not entry.image_bytes):
                continue  # its group has no room now: the next sweep looks again
            self._start_fetch(entry)
            room.took(group, nbytes, first_read=not entry.image_bytes)
            room.waits_for_quota(entry.tenant, nbytes)
            began = True
        return began

    def _reading_bytes(self) -> int:
        """Bytes the reads under way will take once they land (`_expected_bytes`; stuck ones not counted)."""
        stuck = time.monotonic() - STUCK_READ_S
        return sum(self._expected_bytes(e) for key in self._inflight if (e := self._entries.get(key)) is not None
                   and e.fetching is not None and not _stuck(e, stuck))

    def _pack(self, weights):
        return pack_adapter(weights.modules, self.dims, page_elems=self.page_pool.page_elems,
                            max_rank=self.config.max_rank, dtype=self.page_pool.pool.dtype, pin=self._pin,
                            name=getattr(weights, "name", None), allocate=self._arena.allocate)

    def _want(self, entry: AdapterEntry) -> None:
        if entry.resident or entry.retired:
            return
        new = entry.key not in self._wanted
        self._wanted.setdefault(entry.key, None)
        if entry.image is None:
            if entry.fetching is None and new:  # behind its group's reads in line (the last sweep's room), else now
                self._start_wanted_reads([entry], self._room)
            elif entry.fetching is None and self._room is None:  # room may have come since (an abandon, a new budget,
                self._sweep_wanted()  # a failure): every read in line is looked at again, in its order
        elif not entry.on_gpu:
            self._try_place(entry)

    def _start_fetch(self, entry: AdapterEntry) -> None:
        if entry.hung is not None and not entry.hung.done():
            self._fail(entry, "its last read has not come back (a hung disk or mount?); it is not read again "
                              "until that one returns", tier="disk", retryable=True)
            return
        entry.hung = None
        loader, pack = entry.loader, self._pack
        began: list[float] = []  # when a loader thread took the job (the time limit counts from there)

        def job():
            began.append(time.monotonic())
            t0 = time.perf_counter()
            weights = loader()
            try:
                image = pack(weights)
            except RuntimeError as exc:  # host memory (pinned) short may pass; another failure does not
                said = str(exc).lower()  # torch's page-locked allocator says "CUDA error: out of memory"
                if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in said and "out of memory" not in said:
                    raise
                raise MemoryError(f"packing it into host memory failed: {exc}") from exc
            return image, time.perf_counter() - t0

        entry.fetch_started = time.monotonic()
        entry.fetch_began = began
        # Loader threads go to tenants in turn, to a load a request waits for before a warm-up (fair_executor.py).
        urgent = bool(entry.waiters) or entry.asked_anonymously
        group, entry.asker = entry.asker or entry.tenant, None
        entry.read_group = group
        entry.fetching = future = self._executor.submit(group, job, urgent=urgent)
        self._jobs[future] = began
        executor = self._executor
        future.add_done_callback(lambda done: self._job_done(executor, done))
        self._inflight.add(entry.key)

    def _unhung(self, entry: AdapterEntry, future) -> None:
        """A stuck read came back at last: its result (an image outside the CPU budget) is let go."""
        with self._lock:
            if entry.hung is future:
                entry.hung = None

    def _job_done(self, executor, future) -> None:
        with self._lock:
            if self._executor is executor:
                self._jobs.pop(future, None)

    def _replace_stuck_threads(self, now: float, timeout: float) -> None:
        """Once every loader thread is held by a read past the time limit (a hung disk or mount; its version's
        load failed, or was dropped meanwhile), later loads go to fresh threads, the loads still queued with
        them: one tenant's stuck reads never keep the others' adapters from loading."""
        hung = sum(1 for future, began in self._jobs.items() if began and not future.done() and now - began[0] > timeout)
        if hung < self.config.num_load_threads:
            return
        executor, self._executor, self._jobs = self._executor, self._loader_threads(), {}
        for entry in list(self._entries.values()):
            if entry.fetching is not None and entry.fetching.cancel():  # queued behind the stuck ones
                entry.fetching, entry.asker = None, entry.read_group  # in the same loader group again
                self._start_fetch(entry)
        executor.shutdown(wait=False)  # its threads end when their reads return

    def _fetch_overdue(self, entry: AdapterEntry, now: float, timeout: float) -> str | None:
        """Why `entry`'s load in flight fails now, if it does: it ran past the time limit, counted from when a
        loader thread took it (one queued waits for a thread: `_replace_stuck_threads` sees that one comes)."""
        if entry.fetch_began and now - entry.fetch_began[0] > timeout:
            return f"load timed out after {timeout:g} s (download or disk too slow?)"
        return None

    def _finish_fetch(self, entry: AdapterEntry) -> None:
        future, entry.fetching = entry.fetching, None
        ahead, entry.read_ahead, entry.ahead_counted = entry.read_ahead, False, False
        try:
            image, seconds = future.result()
        except BaseException as exc:  # any loader failure fails only this adapter's waiters (a library's panic too)
            if not is_failure(exc):
                raise
            # A read error or short memory may pass; what the files hold (format, shapes, config) does not change
            # by itself. A reload's read error is the adapter's AdapterError, marked transient.
            retryable = isinstance(exc, OSError | MemoryError) or getattr(exc, "transient", False)
            if ahead:  # fails no one: an ask reads again (the sweep, for one waiting now), and is told of its own
                entry.error = AdapterLoadError(entry.key, f"load failed: {exc}", retryable=retryable)
                return self._count_failure("disk", refusal=False)
            self._fail(entry, f"load failed: {exc}", tier="disk", retryable=retryable)
            return
        if entry.retired:
            return
        if entry.digest is not None and image.digest != entry.digest:
            self._fail(entry, "its content changed since it was first loaded; refusing to serve different "
                              "weights under the same name@version (register a new version)", tier="disk")
            return
        entry.error = None
        self._counts["loads"]["cpu"] += 1
        self._count("hits", "disk")
        self._loaded_from_disk(entry, seconds)
        self._set_image(entry, image, ahead=ahead and entry.key not in self._wanted)

    def _loaded_from_disk(self, entry: AdapterEntry, seconds: float) -> None:
        """A disk -> CPU load of `entry` took `seconds`: the cold-load histogram, and what reloading it
        would cost again (the cost eviction policy)."""
        entry.load_seconds = seconds
        self.metrics.load_seconds.labels("cpu").observe(seconds)

    def _set_image(self, entry: AdapterEntry, image, *, ahead: bool = False) -> None:
        """`ahead`: read ahead of any ask, it gives way to the images there: over the CPU budget, it leaves."""
        entry.image, self._imaged[entry.key] = image, entry
        entry.image_bytes, entry.read_group = image.nbytes, entry.read_group or entry.tenant  # packed at add: its owner's
        entry.image_pages = image.num_pages
        self._largest_image = max(self._largest_image, image.nbytes)
        if entry.digest is None:  # its first image: later ones are held to the same digest, so the same ranks
            entry.digest, entry.max_rank = image.digest, image.max_rank
        if ahead and self._cpu_bytes() + self._reading_bytes() > self.config.cpu_budget_bytes:
            return self._evict_cpu(entry, "budget")
        self._trim_cpu(protect=entry)
        if entry.key in self._wanted:
            self._try_place(entry)

    def _fail(self, entry: AdapterEntry, message: str, *, tier: str, retryable: bool = False,
              refusal: bool = False) -> None:
        """Fail the requests waiting for `entry`'s load; `refusal`: a policy's (quota, pinned room), counted as
        such, not as a failed load (alerts on load failures are for broken adapters, disks and devices)."""
        err = AdapterLoadError(entry.key, message, retryable=retryable)
        entry.error, self._room = err, None  # what it held leaves the reads' room (worker/read_room.py)
        entry.failed_waiters.update(dict.fromkeys(entry.waiters, err))
        # A read ahead (timed out, or other bytes) asked for by no anonymous caller: a later one reads again.
        entry.failed_anonymous = entry.asked_anonymously or bool(entry.waiters) or not entry.read_ahead
        entry.asked_anonymously = entry.read_ahead = entry.ahead_counted = False
        entry.failures += 1
        entry.waiters = set()
        self._wanted.pop(entry.key, None)
        # The current version keeps serving. A new version that may load on a retry (the next request's
        # load) stays pending, so it still switches once resident; one that cannot, no longer replaces it.
        if self._pending.get(entry.name) == entry.key and not retryable:
            del self._pending[entry.name]
            self._kept.pop(entry.name, None)
        self._count_failure(tier, refusal)
        self._failures.append((entry.key, err))

    def _count_failure(self, tier: str, refusal: bool) -> None:
        if refusal:
            self._counts["refusals"] += 1
            self.metrics.refusals.inc()
        else:
            self._counts["load_failures"] += 1
            self.metrics.load_failures.labels(tier).inc()

    def _refuse_waiters(self, entry: AdapterEntry, message: str) -> None:
        """Fail the requests waiting for `entry` (retryable), and an anonymous caller asking for it (acquire()
        without a waiter, load()), while it stays wanted (and pending if it is), so it is placed once there is
        room. With nobody waiting, nothing to answer: it only waits."""
        if not entry.waiters and not entry.asked_anonymously:
            return
        err = AdapterLoadError(entry.key, message, retryable=True)
        entry.error, self._room = err, None  # reported until it lands; its image leaves the reads' room
        entry.failed_waiters.update(dict.fromkeys(entry.waiters, err))
        entry.failed_anonymous = entry.failed_anonymous or entry.asked_anonymously
        entry.asked_anonymously = False
        entry.failures += 1
        entry.waiters = set()
        self._count_failure("gpu", refusal=True)
        self._failures.append((entry.key, err))

    def _start_copy(self, entry: AdapterEntry) -> None:
        self._inflight.add(entry.key)
        entry.copying = self._copier.start(entry.image.pages, entry.page_ids)

    def _finish_copy(self, entry: AdapterEntry) -> None:
        handle, entry.copying = entry.copying, None
        try:
            seconds = self._copier.seconds(handle)
        except Exception as exc:
            self._release_gpu(entry)
            self._fail(entry, f"copy to the device failed: {exc}", tier="gpu", retryable=True)
            if entry.retired:  # replaced or unregistered meanwhile: nothing of it stays
                self._drop(entry, reason=entry.retire_reason)
            return
        if entry.retired:  # never resident: no GPU eviction; its CPU image goes for its retirement's reason
            self._release_gpu(entry)
            self._drop(entry, reason=entry.retire_reason)
            return
        entry.image.write_slot(self.layout, entry.slot, entry.page_ids)  # the slot becomes visible here
        entry.resident = True
        entry.error = None  # a placement that failed before (every slot pinned, a failed copy) is over
        entry.asked_anonymously = False
        entry.copy_seconds = seconds
        self._counts["loads"]["gpu"] += 1
        self.metrics.load_seconds.labels("gpu").observe(seconds)
        if self._pending.get(entry.name) == entry.key:
            self._switch(entry)
        self._check_quota_due(entry)
        self._trim_cpu(protect=None)

    def _wait_some(self, timeout: float) -> None:
        with self._lock:
            fetches = [e.fetching for e in self._entries.values() if e.fetching is not None]
            copies = [e.copying for e in self._entries.values() if e.copying is not None]
        for handle in copies:
            self._copier.wait(handle, timeout)
        if fetches:
            wait_futures(fetches, timeout=timeout, return_when="FIRST_COMPLETED")
        elif not copies:
            time.sleep(timeout)


def _waited_for(entry: AdapterEntry) -> bool:
    """Whether a request (or a `load()`) waits for `entry` now: its reads and images are paced (worker/read_room.py)."""
    return bool(entry.waiters) or entry.asked_anonymously


def _stuck(entry: AdapterEntry, since: float) -> bool:
    """Whether a loader thread took `entry`'s read before `since` (monotonic) and has not finished it."""
    return bool(entry.fetch_began) and entry.fetch_began[0] < since


def limit_cpu_threads(num_threads: int | None) -> None:
    if num_threads is not None:
        torch.set_num_threads(num_threads)


def _group(entry: AdapterEntry) -> str:
    """The tenant an adapter is read and placed for: the one asking now, else the one its last read was for."""
    return entry.asker or entry.read_group or entry.tenant
