"""AdapterPlacement: where adapters live, as part of `AdapterPool` (worker/adapter_pool.py).

Placing an adapter on the GPU (pages + a slot, within its tenant's quota, evicting idle adapters if
that makes it fit) and eviction from the GPU and CPU tiers: replaced or unregistered versions first,
then (GPU) lower priorities first, within a priority cold versions before warm ones (a directive's
`warm`, worker/adapter_warmth.py), then the configured policy's order (worker/eviction.py). Never
evicted: adapters in use, pinned, a new version about to become current, or loaded for requests that
have not picked them up yet; except that a pinned current version gives way to the new version that
replaces it when nothing else makes room (every slot pinned, or their owner's GPU quota full), the switch
happening then. A version kept out while every slot is pinned fails its requests (retryable, with what to
change: the slots, or its owner's quota) rather than have them wait for what never leaves; one kept out by
its owner's pinned adapters with slots free fails the requests waiting for it the same way, and stays
wanted: it is placed once they leave (unpinned) or the quota is raised. It works on the
pool's state declared in `AdapterPool.__init__`; loading is in worker/adapter_loading.py.
"""

from __future__ import annotations

from lorafleet.worker.adapter_entry import AdapterEntry
from lorafleet.worker.adapter_image import clear_slot
from lorafleet.worker.eviction import EvictionCandidate, plan_placement
from lorafleet.worker.page_pool import PagePoolError


def _pinned_quota_message(entry: AdapterEntry) -> str:
    return f"tenant {entry.tenant!r} is at its GPU quota, held by its pinned adapters; unpin one of them or raise the quota"


class AdapterPlacement:
    def _placement_plan(self, entry: AdapterEntry) -> list[AdapterEntry] | None:
        """Victims to evict so `entry` fits (pages, slot, tenant quota), or None if it cannot fit now."""
        # Not evictable: in use, pinned, a new version about to switch, or loaded for requests that
        # have not picked it up yet (evicting those makes waiting requests evict each other forever).
        candidates = [e for e in self._slot_owner.values()
                      if e.resident and e.refcount == 0 and not e.pinned and e is not entry
                      and not e.waiters and self._pending.get(e.name) != e.key]
        if self._warming_up(entry):  # a push's warm-up displaces only adapters of a lower rank
            candidates = [e for e in candidates if self._warm_rank(e) < self._warm_rank(entry)]
        plan = self._plan_with(entry, candidates)
        replaced = self._replaced_pinned(entry)
        if plan is None and replaced is not None and replaced.refcount == 0 and not replaced.waiters \
                and (self.pinned_slot_keys() is not None or self._own_quota_full(entry, replaced)
                     or self._ceiling_full(entry, replaced)):
            # A pinned version's successor while every slot is pinned, while the quota of their owner is full, or
            # while pinned adapters fill the pages adapters may take: the old version gives way (`_try_place`
            # switches to the new one then); else the new one would never be placed. (Short of pages only, with
            # room under the ceiling, the new one waits for them beside the old one, as any version does.)
            plan = self._plan_with(entry, [replaced, *candidates])
        return plan

    def _warming_up(self, entry: AdapterEntry) -> bool:
        """`entry` is wanted only to keep it warm (a push's prefetch): no request waits for it, nor a load(), and
        it is no new version that replaces its name's current one once resident (that switch waits for it)."""
        return (entry.key in self._warm and not (entry.waiters or entry.asked_anonymously or entry.pinned)
                and self._pending.get(entry.name) != entry.key)

    def _warm_rank(self, entry: AdapterEntry) -> tuple[int, int]:
        """Its priority, then cold (0), a warm canary (1), a warm version its name resolves to (2): a warm-up
        displaces only idle adapters of a lower rank, so a canary never a warm stable version of its priority
        (nor another canary), as the operator's placement plans it (a newcomer displaces lower ranks only). A
        new version pending to replace the current one ranks with it."""
        warm, key = entry.key in self._warm, entry.key
        return entry.priority, warm + (warm and key in (self._current.get(entry.name), self._pending.get(entry.name)))

    def _ceiling_full(self, entry: AdapterEntry, replaced: AdapterEntry) -> bool:
        """Whether `entry` beside the pinned version it replaces, and the other pinned adapters, is more than
        the pages adapters may ever take (the pool less the KV floor, under --max-adapter-pages)."""
        most = self.page_pool.most("adapter")
        return (most < self.page_pool.num_pages
                and entry.image.num_pages + len(replaced.page_ids) + self._pinned_pages(entry) > most)

    def _replaced_pinned(self, entry: AdapterEntry, *, copying: bool = False) -> AdapterEntry | None:
        """The pinned, GPU-resident current version that `entry`, pending to replace it, may take the slot of
        (with `copying`, also one whose copy to the GPU is still in flight: it is never a victim)."""
        if self._pending.get(entry.name) != entry.key:
            return None
        replaced = self._entries.get(self._current.get(entry.name, ""))
        if replaced is None or not replaced.pinned:
            return None
        return replaced if replaced.resident or (copying and replaced.on_gpu) else None

    def _exceeds_quota(self, entry: AdapterEntry, held: list[AdapterEntry]) -> bool:
        """Whether `entry` on the GPU beside `held` (adapters of its owner there) is over its owner's quota."""
        return self.config.quota(entry.tenant).exceeded(len(held) + 1,
                                                        sum(e.gpu_bytes for e in held) + entry.image.nbytes)

    def _own_quota_full(self, entry: AdapterEntry, replaced: AdapterEntry) -> bool:
        """Whether `entry` is over its owner's GPU quota, `replaced` (the version it replaces) counting in it."""
        return replaced.tenant == entry.tenant and self._exceeds_quota(entry, self._owned(entry.tenant))

    def _over_quota(self, entry: AdapterEntry) -> bool:
        """Whether `entry`'s owner would be over its GPU quota with it while every slot is pinned: only the
        version `entry` replaces may leave then, and it frees quota only if it is the same owner's."""
        replaced = self._replaced_pinned(entry)
        return self._exceeds_quota(entry, [e for e in self._owned(entry.tenant) if e is not replaced])

    def _pinned_over_quota(self, entry: AdapterEntry) -> bool:
        """Whether the owner's pinned adapters on the GPU, which never leave by themselves, keep `entry`
        over its owner's GPU quota. A current version whose successor is on its way (wanted, or on the GPU)
        does not count: it gives way or retires at the switch."""
        return self._exceeds_quota(entry, [e for e in self._owned(entry.tenant)
                                           if e.pinned and not e.retired and not self._successor_coming(e)])

    def _successor_coming(self, entry: AdapterEntry) -> bool:
        """A version pending to replace `entry` is wanted or on the GPU (one whose load failed is neither)."""
        pending = self._pending.get(entry.name)
        successor = self._entries.get(pending) if pending not in (None, entry.key) else None
        return successor is not None and (successor.key in self._wanted or successor.on_gpu)

    def _gives_way_later(self, entry: AdapterEntry) -> bool:
        """Whether the pinned version `entry` replaces would give way but for requests using or awaiting it,
        or for its own copy to the GPU, still in flight."""
        replaced = self._replaced_pinned(entry, copying=True)
        return replaced is not None and (not replaced.resident or bool(replaced.refcount or replaced.waiters))

    def _set_tenant(self, entry: AdapterEntry, tenant: str) -> None:
        """See AdapterPool.set_tenant."""
        if entry.tenant == tenant:
            return
        entry.tenant = tenant
        self._quota_due.add(entry.key)
        self._check_quota_due(entry)

    def _check_quota_due(self, entry: AdapterEntry) -> None:
        """`entry` changed owner: once on the GPU and idle (at once, or when its copy lands, or its last request
        is released), it leaves the GPU if the new owner is over its quota there."""
        if entry.key not in self._quota_due or (entry.on_gpu and not entry.resident):
            return  # nothing due, or copying: checked when the copy lands
        if entry.resident and (entry.refcount or entry.waiters):
            return  # in use: checked when its last request releases it
        self._quota_due.discard(entry.key)
        if entry.resident and self.config.quota(entry.tenant).exceeded(*self._gpu_usage(entry.tenant)):
            self._evict_gpu(entry, "quota")
            self._update_gauges()  # at a release or an owner change: no other change follows to update them
            if entry.pinned or entry.key in self._warm:
                self._want(entry)  # back within that quota, evicting the owner's other idle adapters first

    def residency(self, key: str) -> str:
        """For the scheduler: "gpu" (pages taken: resident or being copied), "room" (in CPU memory, waiting
        only for GPU pages or a slot), "quota" (in CPU memory, its owner's adapters on the GPU that cannot leave
        now, in use or pinned, fill the owner's quota: only they leaving make room, no other tenant's) or "load"
        (being read, or gone)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.on_gpu:
                return "gpu"
            if entry is None or entry.image is None or entry.fetching is not None:
                return "load"
            # Only the owner's adapters that cannot leave count: its idle ones give way to this one first (placement),
            # so an adapter that waits behind them waits for room, which never_fits may find it will never get.
            held = [e for e in self._owned(entry.tenant) if not self._idle(e)]
            return "quota" if self._exceeds_quota(entry, held) else "room"

    def _owned(self, tenant: str) -> list[AdapterEntry]:
        """The adapters `tenant` holds on the GPU (slots): what its quota counts."""
        return [e for e in self._slot_owner.values() if e.tenant == tenant]

    def _gpu_usage(self, tenant: str) -> tuple[int, int]:
        """(adapters, bytes) `tenant` holds on the GPU."""
        mine = self._owned(tenant)
        return len(mine), sum(e.gpu_bytes for e in mine)

    def _plan_with(self, entry: AdapterEntry, candidates: list[AdapterEntry]) -> list[AdapterEntry] | None:
        count, nbytes = self._gpu_usage(entry.tenant)
        keys = plan_placement(
            need_pages=entry.image.num_pages, nbytes=entry.image.nbytes, tenant=entry.tenant,
            quota=self.config.quota(entry.tenant),
            ordered=[(e.key, e.tenant, len(e.page_ids), e.gpu_bytes)
                     for e in self._eviction_order(candidates, by_rank=entry.key in self._warm and not entry.waiters)],
            tenant_count=count, tenant_bytes=nbytes,
            free_pages=self.page_pool.available("adapter"), free_slots=len(self._free_slots))
        return None if keys is None else [self._entries[k] for k in keys]

    def _try_place(self, entry: AdapterEntry) -> bool:
        if entry.on_gpu or entry.image is None or entry.retired:
            return entry.on_gpu
        victims = self._placement_plan(entry)
        if victims is None:
            quota = self.config.quota(entry.tenant)
            most = self.page_pool.most("adapter")
            if quota.max_bytes is not None and entry.image.nbytes > quota.max_bytes:
                self._fail(entry, f"needs {entry.image.nbytes} bytes, above tenant {entry.tenant!r}'s GPU quota of "
                                  f"{quota.max_bytes} bytes", tier="gpu", refusal=True)
            elif entry.image.num_pages > most:
                self._fail(entry, f"needs {entry.image.num_pages} pages; adapters may use at most {most} pages of "
                                  f"the pool (raise the pool size or the adapter ceiling)", tier="gpu", refusal=True)
            elif self._gives_way_later(entry):
                pass  # stays wanted: placed when the requests on the version it replaces release it (the sweep)
            elif most < self.page_pool.num_pages and entry.image.num_pages > most - (held := self._pinned_pages(entry)):
                # Pinned adapters never leave on their own: waiting would hold every request behind this one. (With
                # no ceiling or floor, kv_room.py refuses the request: its KV pages count there too.)
                self._fail(entry, f"needs {entry.image.num_pages} pages, but pinned adapters hold {held} of the "
                                  f"{most} pages adapters may use; unpin one, or raise the pool size or the "
                                  f"adapter ceiling (--max-adapter-pages)", tier="gpu", retryable=True, refusal=True)
            elif (pinned := self.pinned_slot_keys()) is not None and self._over_quota(entry):
                self._fail(entry, _pinned_quota_message(entry), tier="gpu", retryable=True, refusal=True)
            elif pinned is not None:
                # Pinned adapters never leave on their own: waiting would hang the request.
                self._fail(entry, f"every adapter slot ({len(pinned)}, --max-loras) is held by pinned adapters "
                                  f"({', '.join(pinned)}); unpin one or raise --max-loras", tier="gpu", retryable=True,
                           refusal=True)
            elif self._pinned_over_quota(entry):  # slots free, but its owner's pinned adapters fill its quota
                self._refuse_waiters(entry, _pinned_quota_message(entry))
            elif self._warming_up(entry):  # no lower rank to displace: left to the warm check's free room
                self._wanted.pop(entry.key, None)  # (wanted, it would hold every other re-warm back)
            return False
        for victim in victims:
            if victim.pinned:  # only the pinned version `entry` replaces is ever a pinned victim (_placement_plan):
                self._switch(entry)  # switch now, so its requests wait for this copy, not for a slot they never get;
                if not victim.on_gpu:  # retired, it was dropped (slot and pages freed)
                    continue
                victim.pinned = False  # kept registered (the new one's canary): it leaves the GPU as any other
            over = self._exceeds_quota(entry, self._owned(entry.tenant))
            self._evict_gpu(victim, "quota" if over and victim.tenant == entry.tenant else "capacity")
        return self._place(entry)

    def _pinned_pages(self, entry: AdapterEntry) -> int:
        """GPU pages of the pinned adapters that stay (not the pinned version `entry` replaces)."""
        replaced = self._replaced_pinned(entry, copying=True)
        return sum(len(e.page_ids) for e in self._slot_owner.values()  # those on the GPU: slots, not the registry
                   if e.pinned and e is not entry and e is not replaced)

    def _place(self, entry: AdapterEntry) -> bool:
        """Take pages and a slot for `entry` (room made already) and start its copy."""
        image = entry.image
        try:
            entry.page_ids = self.page_pool.allocate(image.num_pages, ("adapter", entry.key),
                                                     used_elems=image.used_elems)
        except PagePoolError:
            # Placed from another thread (a push's prefetch or pin): the engine thread's KV cache took the
            # pages since the plan. It stays wanted and is placed when room comes back, as if it had waited.
            return False
        entry.slot = self._free_slots.pop()
        entry.gpu_bytes = image.nbytes
        self._slot_owner[entry.slot] = entry
        self._wanted.pop(entry.key, None)
        self._start_copy(entry)
        return True

    def reclaim_for_kv(self, num_pages: int) -> int:
        """Unified paging: the KV cache needs `num_pages` more pages than are free; evict idle
        adapters (no references, not pinned, nobody waiting for them) if that is enough. Returns
        pages freed."""
        with self._lock:
            self._kv_short = True  # warm versions wait for room until the next check (adapter_warmth.py)
            idle = self._idle_resident()
            if self._usable_by_kv(idle) < num_pages:
                return 0  # evicting them all would not be enough: evict none
            freed = 0
            for victim in self._eviction_order(idle):
                if freed >= num_pages:
                    break
                freed += len(victim.page_ids)
                self._evict_gpu(victim, "kv")
            self._update_gauges()
            return freed

    def reclaimable_pages(self) -> int:
        """Pages of idle GPU-resident adapters: the KV cache could have them (see reclaim_for_kv)."""
        with self._lock:
            return self._usable_by_kv(self._idle_resident())

    def _usable_by_kv(self, idle: list[AdapterEntry]) -> int:
        """Pages the KV cache would gain if `idle` were evicted: those below the adapters' page floor
        (min_pages) stay reserved for adapters."""
        spare = self.page_pool.num_used("adapter") - self.page_pool.config.min_pages.get("adapter", 0)
        return max(0, min(sum(len(e.page_ids) for e in idle), spare))

    def _idle_resident(self) -> list[AdapterEntry]:
        """Resident adapters no request uses, holds or waits for, not pinned, not being replaced."""
        return [e for e in self._slot_owner.values() if self._idle(e)]

    def _idle(self, e: AdapterEntry) -> bool:
        return e.resident and e.refcount == 0 and not e.pinned and not e.waiters and self._pending.get(e.name) != e.key

    def _drop(self, entry: AdapterEntry, *, reason: str) -> None:
        if self._entries.get(entry.key) is not entry:
            return  # dropped already (its retirement, then its last reference given back)
        if entry.resident:
            self._release_gpu(entry)
            self._count_eviction("gpu", reason)
        if entry.image is not None:
            self._evict_cpu(entry, reason)
        if entry.fetching is not None:
            entry.fetching.cancel()
        self._entries.pop(entry.key, None)
        self._quota_due.discard(entry.key)
        self.on_dropped((entry.key, entry.serial))  # nothing computed with it is found again

    def _release_gpu(self, entry: AdapterEntry) -> None:
        slot = entry.slot
        clear_slot(self.layout, slot)
        self.page_pool.free(entry.page_ids)
        entry.page_ids = []
        entry.slot = None
        entry.resident = False
        entry.gpu_bytes = 0
        del self._slot_owner[slot]
        self._free_slots.append(slot)

    def _evict_gpu(self, entry: AdapterEntry, reason: str) -> None:
        assert entry.refcount == 0 and entry.copying is None, f"{entry.key} is in use"
        self._release_gpu(entry)
        if entry.retired:
            reason = entry.retire_reason
        self._count_eviction("gpu", reason)
        if entry.retired:
            self._drop(entry, reason=reason)

    def _count_eviction(self, tier: str, reason: str) -> None:
        self._counts["evictions"][tier][reason] = self._counts["evictions"][tier].get(reason, 0) + 1
        self.metrics.evictions.labels(tier, reason).inc()

    def _evict_cpu(self, entry: AdapterEntry, reason: str) -> None:
        entry.image = None
        self._imaged.pop(entry.key, None)
        self._count_eviction("cpu", reason)

    def _trim_cpu(self, protect: AdapterEntry | None) -> None:
        """Keep the CPU tier within its byte budget, counting the reads under way (`_reading_bytes`);
        images being copied (or about to be) stay. The arena then takes back the pages of images dropped (once no
        copy reads them); empty slabs beyond the budget leave."""
        holders = list(self._imaged.values())
        total = self._cpu_bytes() + self._reading_bytes()
        if total > self.config.cpu_budget_bytes:
            candidates = [e for e in holders
                          if e is not protect and e.copying is None and not (e.key in self._wanted and not e.on_gpu)]
            for cand in self.policy.order([self._candidate(e, tier="cpu") for e in candidates]):
                if total <= self.config.cpu_budget_bytes:
                    break
                victim = self._entries[cand.key]
                total -= victim.image.nbytes
                self._evict_cpu(victim, "budget")
        self._arena.collect()

    def set_priority(self, key: str, priority: int) -> None:
        """A higher priority survives GPU eviction longer: lower ones go first, the policy orders each."""
        with self._lock:
            self._get(key).priority = priority

    def _eviction_order(self, candidates: list[AdapterEntry], *, by_rank: bool = False) -> list[AdapterEntry]:
        """Replaced/unregistered versions first, then lower priorities first; within a priority cold
        versions before those a directive keeps warm (`by_rank`, for a warm-up: warm canaries before the
        versions their names resolve to); each group in the configured policy's order (the sort is stable)."""
        retired = [e for e in candidates if e.replaced]
        rest = [self._entries[c.key] for c in self.policy.order([self._candidate(e) for e in candidates
                                                                  if not e.replaced])]
        return retired + sorted(rest, key=self._warm_rank if by_rank else lambda e: (e.priority, e.key in self._warm))

    def _candidate(self, entry: AdapterEntry, tier: str = "gpu") -> EvictionCandidate:
        if tier == "gpu":
            nbytes = entry.gpu_bytes
            # Bringing it back costs a copy if the CPU tier still has it, else a load as well.
            reload = entry.copy_seconds + (0.0 if entry.image is not None else entry.load_seconds)
        else:
            nbytes, reload = entry.image.nbytes, entry.load_seconds
        return EvictionCandidate(entry.key, nbytes, entry.last_used, entry.uses, reload)
