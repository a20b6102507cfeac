"""AdapterReports: what `AdapterPool` (worker/adapter_pool.py) tells about itself: per-adapter
descriptions for state reports, the pages a request's KV cache can never have (worker/kv_room.py),
counters and byte totals, Prometheus gauges, and the invariant check.
It reads the pool's state declared in `AdapterPool.__init__`.
"""

from __future__ import annotations

import time

from lorafleet.worker.adapter_entry import AdapterEntry, AdapterNotFoundError
from lorafleet.worker.adapter_pool_check import check_adapter_pool


class AdapterReports:
    def entry(self, key: str) -> AdapterEntry:
        """`key`'s entry, also a replaced version still kept for the requests that ran on it (retire_pending)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.retired:
                raise AdapterNotFoundError(f"adapter {key!r} is not registered")
            return entry

    def content_tag(self, key: str) -> tuple[str, int]:
        """What the KV computed with `key` depends on: the key and its registration (AdapterNotFoundError once
        retired)."""
        return key, self.entry(key).serial

    def describe(self) -> list[dict]:
        """Per adapter version: tier, refcount, uses, bytes, pinned, error (for state reports)."""
        with self._lock:
            out = []
            for e in self._entries.values():
                if e.retired and e.refcount == 0:
                    continue  # replaced: held only for queued requests it was loaded for
                out.append({
                    "key": e.key, "name": e.name, "version": e.version, "tenant": e.tenant,
                    "tier": e.tier(), "refcount": e.refcount, "hits": e.uses,
                    "bytes": e.gpu_bytes if e.on_gpu else (e.image.nbytes if e.image is not None else 0),
                    "pinned": e.pinned, "current": self._current.get(e.name) == e.key, "retired": e.replaced,
                    "error": str(e.error) if e.error is not None else None,
                    # requests that hold it or will take it again (a replaced version stays for them)
                    "holders": e.refcount + len(e.detached),
                })
            return out

    def pinned_slot_keys(self) -> list[str] | None:
        """Keys of the adapters holding the GPU slots when every slot (--max-loras) is held by a pinned one,
        else None. Pinned adapters never leave on their own: until one is unpinned or --max-loras raised, no
        other version can become GPU-resident (a warm one that pressure evicted is never placed again)."""
        with self._lock:
            owners = list(self._slot_owner.values())
            if self._free_slots or not all(e.pinned for e in owners):
                return None
            return sorted(e.key for e in owners)

    def registered(self) -> list[str]:
        with self._lock:
            return [k for k, e in self._entries.items() if not e.replaced]

    def kv_held_pages(self, key: str | None) -> tuple[int, int]:
        """(adapter `key`'s pages, pinned adapters' pages): what the KV cache of a request for `key`
        (None: the base model) can never have while it runs. Pinned adapters are placed as soon as there
        is room and never evicted; an adapter never read counts as no pages (its size is not known; once read
        it is, evicted or not). A name counts once, at its largest pinned version: while a pinned version
        replaces another, only one of the two stays. The request's own version is its own pages; a pinned
        version of its name beside it (the stable version of a canary, the version it replaces) counts too: both
        may be on the GPU for as long as the request runs."""
        with self._lock:
            own = self._entries.get(key) if key is not None else None
            by_name: dict[str, int] = {}
            for k in list(self._pinned_keys):  # O(pinned versions), not O(registered)
                e = self._entries.get(k)
                if e is None or not e.pinned:
                    self._pinned_keys.discard(k)
                elif own is None or e.key != own.key:  # another pinned version of its own name stays too
                    by_name[e.name] = max(by_name.get(e.name, 0), _num_pages(e))
            return (_num_pages(own) if own is not None else 0), sum(by_name.values())

    def stats(self) -> dict:
        with self._lock:
            gpu = [e for e in self._slot_owner.values() if e.resident]
            cpu = list(self._imaged.values())
            pages = self.page_pool.stats()
            return {
                "registered": sum(1 for e in self._entries.values() if not e.replaced),
                # the most adapter bytes and adapters the GPU pool could hold at once (the operator places by them)
                "capacity_bytes": self.page_pool.most("adapter") * pages["page_bytes"],
                "slots": self.config.max_slots,
                "eviction": self.policy.name,
                "cpu_budget_bytes": self.config.cpu_budget_bytes,
                # host memory behind the CPU tier: the arena's slabs (page-locked on GPU hosts), and their pages in use
                "host_bytes": self._arena.figures(),
                "resident": {"gpu": len(gpu), "cpu": len(cpu)},
                "bytes": {"gpu": sum(e.gpu_bytes for e in gpu), "cpu": sum(e.image.nbytes for e in cpu)},
                "hits": dict(self._counts["hits"]),
                "misses": dict(self._counts["misses"]),
                "loads": dict(self._counts["loads"]),
                "load_failures": self._counts["load_failures"], "refusals": self._counts["refusals"],
                "warm": len(self._warm), "rewarms": self._counts["rewarms"],
                "evictions": {t: dict(v) for t, v in self._counts["evictions"].items()},
                "in_flight": sum(1 for e in self._entries.values() if e.fetching is not None or e.copying is not None),
                "waiting": len(self._wanted),
                "reads_waiting": self._reads_waiting(),  # of them, unread until the CPU budget has room
                "fragmentation": self.page_pool.fragmentation("adapter"),
                "page_pool": pages,
            }

    def check(self) -> None:
        """Raise AssertionError unless pages, slots, layout, refcounts and quotas agree."""
        with self._lock:
            check_adapter_pool(page_pool=self.page_pool, layout=self.layout, entries=self._entries,
                               slot_owner=self._slot_owner, free_slots=self._free_slots, config=self.config,
                               current=self._current)
            imaged = {k: e for k, e in self._entries.items() if e.image is not None}
            assert self._imaged.keys() == imaged.keys() and all(self._imaged[k] is e for k, e in imaged.items()), \
                f"CPU images {sorted(imaged)}, listed {sorted(self._imaged)}"

    # ---- internals: bookkeeping ----------------------------------------------------------------
    def _count(self, what: str, tier: str, waiter: object = None) -> None:
        """Count a lookup; a request's GPU miss (`waiter`) is noted: its wait for the adapter (`_waited`) starts
        once the scheduler asks for it (`_asked`), not as it arrives, when it may wait for a seat first."""
        self._counts[what][tier] += 1
        (self.metrics.hits if what == "hits" else self.metrics.misses).labels(tier).inc()
        if what == "misses" and tier == "gpu" and waiter is not None:
            self._missed_at[waiter] = None

    def _asked(self, waiter: object) -> None:
        """The scheduler asked for the adapter of a request that missed it, and it is not on the GPU: its wait
        begins (the first time only)."""
        if waiter is not None and waiter in self._missed_at and self._missed_at[waiter] is None:
            self._missed_at[waiter] = time.monotonic()

    def _waited(self, waiter: object, *, took_it: bool) -> None:
        """A request that missed its adapter on the GPU took its slot (its wait is observed: the load's queue,
        read and copy, and GPU room, which the load histogram leaves out; 0 when the adapter was there by the
        time the scheduler asked, the request having waited for a seat, not for it) or went away."""
        if waiter not in self._missed_at:
            return
        asked = self._missed_at.pop(waiter)
        if took_it:
            self.metrics.wait_seconds.observe(0.0 if asked is None else time.monotonic() - asked)

    def _cpu_bytes(self) -> int:
        """Bytes of the CPU tier's images."""
        return sum(e.image.nbytes for e in self._imaged.values())

    def _update_gauges(self) -> None:  # O(slots + images), not O(registered): it runs at every load and eviction
        gpu = [e for e in self._slot_owner.values() if e.resident]
        cpu = list(self._imaged.values())
        m = self.metrics
        m.resident.labels("gpu").set(len(gpu))
        m.resident.labels("cpu").set(len(cpu))
        m.bytes.labels("gpu").set(sum(e.gpu_bytes for e in gpu))
        m.bytes.labels("cpu").set(sum(e.image.nbytes for e in cpu))
        m.fragmentation.set(self.page_pool.fragmentation("adapter"))
        m.reads_waiting.set(self._reads_waiting())
        m.watch_page_pool(self.page_pool)  # page counts are read at scrape time, KV pages move every step
        m.watch_arena(self._arena)

    def _reads_waiting(self) -> int:
        """Adapters wanted on the GPU, neither read nor being read: their reads wait for CPU room."""
        return sum(1 for k in self._wanted if (e := self._entries.get(k)) is not None and not e.on_gpu
                   and e.image is None and e.fetching is None)


def _num_pages(entry: AdapterEntry) -> int:
    """GPU pages `entry` holds, or will take once placed (0: its size is not known yet: never read)."""
    if entry.on_gpu:
        return len(entry.page_ids)
    return entry.image.num_pages if entry.image is not None else entry.image_pages
