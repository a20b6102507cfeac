"""AdapterPool: GPU residency of adapters in the unified page pool, the CPU tier, versions, eviction.

Tiers: hot = pages of the shared `PagePool` + a slot in the `LoRALayout`; warm = a packed `AdapterImage` in
(pinned) CPU memory, pages of the `HostArena`; cold = the entry's loader (the stager's disk copy). The step
loop only ever calls non-blocking verbs: `acquire` answers a slot or None (a load was started or is under way; retry next step),
`release` drops a reference, `poll` advances loads. Disk->CPU parsing runs in loader threads; CPU->GPU copies
run on a side CUDA stream (or a loader thread on CPU devices). A slot becomes visible in the layout only once
its copy is complete, so nothing ever computes with a half-loaded adapter.

Versions: keys are `name@version`; `resolve(name)` answers the current version. Adding a new
version loads it beside the old one and switches `resolve` when it is resident; requests holding the
old slot finish on it, and the old version is dropped (pages and slot freed) as soon as nothing holds
it: no reference, no copy in flight, no queued request it was loaded for. The same goes for a version
unregistered or removed. A version registered beside the current one (`make_current=False`, a canary)
is promoted with `make_current(key)`, which retires the old one the same way; the current version
registered again as a canary while a new one loads stays registered beside it (a swap). The content
digest of a key is fixed at its first load: a reload with other bytes fails instead of serving them
under the old key; a dropped key is forgotten, and registering it again makes a fresh version.

Here: the public verbs; registration and versions in adapter_versions.py, loading in adapter_loading.py, placement
and eviction in adapter_placement.py, a directive's `warm` versions in adapter_warmth.py, reports in adapter_reports.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from lorafleet.kernels.lora_layout import NUM_PROJS, PROJS, LoRALayout
from lorafleet.worker.adapter_entry import AdapterEntry, AdapterLoadError, AdapterNotFoundError
from lorafleet.worker.adapter_image import ModelDims
from lorafleet.worker.adapter_loading import AdapterLoading, limit_cpu_threads
from lorafleet.worker.adapter_metrics import TIERS, AdapterMetrics
from lorafleet.worker.adapter_placement import AdapterPlacement
from lorafleet.worker.adapter_pool_config import AdapterPoolConfig, TenantQuota
from lorafleet.worker.adapter_reports import AdapterReports
from lorafleet.worker.adapter_versions import AdapterVersions
from lorafleet.worker.adapter_warmth import AdapterWarmth, WarmState
from lorafleet.worker.eviction import make_policy
from lorafleet.worker.fair_executor import FairExecutor
from lorafleet.worker.host_arena import HostArena
from lorafleet.worker.page_copier import PageCopier
from lorafleet.worker.page_pool import PagePool

__all__ = ["AdapterPool", "AdapterPoolConfig", "TenantQuota"]


class AdapterPool(AdapterVersions, AdapterLoading, AdapterPlacement, AdapterWarmth, AdapterReports):
    def __init__(self, page_pool: PagePool, dims: ModelDims, config: AdapterPoolConfig | None = None) -> None:
        self.config = config = config or AdapterPoolConfig()
        self._own_config = config  # as started: what configure(None) goes back to
        self.page_pool, self.dims = page_pool, dims
        self.policy = make_policy(config.eviction_policy)
        self.metrics = AdapterMetrics()
        self.metrics.watch_page_pool(page_pool)
        pool = page_pool.pool
        self.device = pool.device
        self._cuda = pool.device.type == "cuda"
        self._pin = self._cuda if config.pin_cpu is None else config.pin_cpu
        self._arena = HostArena(page_pool.page_elems, pool.dtype, pin=self._pin, budget_bytes=config.cpu_budget_bytes)
        shape = (dims.num_layers, NUM_PROJS, config.max_slots)
        self.layout = LoRALayout(
            pool=pool,
            ranks=torch.zeros(shape, dtype=torch.int32, device=self.device),
            scales=torch.zeros(shape, dtype=torch.float32, device=self.device),
            a_offsets=torch.zeros(*shape, config.max_rank, dtype=torch.int64, device=self.device),
            b_offsets=torch.zeros(*shape, config.max_rank, dtype=torch.int64, device=self.device),
            row_align=dims.row_align(page_pool.page_elems),
            widths=tuple(dims.in_out(p) for p in PROJS),
        )
        self._executor = self._loader_threads()
        self._jobs: dict = {}  # the loader threads' reads (future -> [when a thread took it]) not finished
        # CPU devices copy pages on a thread of their own: a read stuck on a hung disk never holds a copy back.
        self._copy_executor = None if self._cuda else ThreadPoolExecutor(1, thread_name_prefix="adapter-copy")
        self._copier = PageCopier(pool, self._copy_executor)
        page_pool.set_reclaimer("adapter", self.reclaim_for_kv)
        self._lock = threading.RLock()
        self._entries: dict[str, AdapterEntry] = {}
        self.on_dropped = lambda tag: None  # content_tag of each registration dropped (any thread): the prefix cache's
        # Entries pinned at some point (pruned as read): the KV room is asked per request, pinned ones are few.
        self._pinned_keys: set[str] = set()
        self._current: dict[str, str] = {}  # name -> key that resolve() answers
        self._pending: dict[str, str] = {}  # name -> new version loading beside the current one
        self._kept: dict[str, str] = {}  # name -> the key kept registered at the switch if it is the current one then
        self._slot_owner: dict[int, AdapterEntry] = {}
        self._imaged: dict[str, AdapterEntry] = {}  # the entries with a CPU image: scans of the tier, not the registry
        self._free_slots = list(range(config.max_slots - 1, -1, -1))
        self._wanted: dict[str, None] = {}  # keys to bring to the GPU, in request order
        self._missed_at: dict[object, float | None] = {}  # GPU miss's waiter -> when first asked for (None: not yet)
        self._quota_due: set[str] = set()  # keys whose owner changed while in use or copying (set_tenant)
        self._failures: deque[tuple[str, AdapterLoadError]] = deque(maxlen=100)
        self._inflight: set[str] = set()  # keys with a load or copy running
        self._tick = 0
        self._warm: dict[str, WarmState] = {}  # versions a directive keeps warm (adapter_warmth.py)
        self._pinned_retry: dict[str, WarmState] = {}  # pinned versions off the GPU: their backoff (same)
        self._next_warm_check = 0.0  # monotonic time of the next look for missing warm versions
        self._kv_short = False  # the KV cache asked for pages since the last look
        self._counts = {"hits": dict.fromkeys(TIERS, 0), "misses": dict.fromkeys(TIERS, 0),
                        "loads": {"cpu": 0, "gpu": 0}, "load_failures": 0, "refusals": 0, "rewarms": 0,
                        "evictions": {"gpu": {}, "cpu": {}}}

    # ---- pool-wide settings (a push may set them) ------------------------------------------------
    def configure(self, *, eviction_policy: str | None = None, cpu_budget_bytes: int | None = None) -> None:
        """Switch the eviction policy and the CPU tier's byte budget at runtime; None = the value the pool
        was started with. Entries keep their use counts and last uses, so a new policy orders them at once.
        A smaller budget evicts CPU copies now, in the policy's order, never one being copied to the GPU
        or about to be."""
        with self._lock:
            own, self._room = self._own_config, None  # reads waiting in line are looked at afresh (worker/read_room.py)
            policy = own.eviction_policy if eviction_policy is None else eviction_policy
            budget = own.cpu_budget_bytes if cpu_budget_bytes is None else cpu_budget_bytes
            config = replace(self.config, eviction_policy=policy, cpu_budget_bytes=budget)  # validates both
            if policy != self.policy.name:
                self.policy = make_policy(policy)
            self.config = config
            self._trim_cpu(protect=None)
            self._arena.set_budget(budget)
            self._update_gauges()

    # ---- pinning -------------------------------------------------------------------------------
    def pin(self, key: str) -> None:
        with self._lock:
            entry = self._get(key)
            entry.pinned = True
            self._pinned_keys.add(key)
            self._want(entry)

    def unpin(self, key: str) -> None:
        with self._lock:
            self._get(key).pinned = False
            self._rewant_pinned(None)  # a pinned version refused for want of a slot may take this one's now

    def replaces_pinned(self, key: str) -> bool:
        """Whether `key` is about to replace its name's pinned version on the GPU, which gives it its slot (now,
        once the requests on it are done, or once its own copy lands) even when every slot is pinned."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and not entry.retired and self._replaced_pinned(entry, copying=True) is not None

    def set_tenant(self, key: str, tenant: str) -> None:
        """`key`'s owner is now `tenant` (its GPU quota is charged to it). On the GPU and over the new owner's
        quota there, it leaves the GPU once idle (at once, or when its last request releases it or its copy
        lands); pinned or warm, it comes back within that quota (evicting the owner's other idle adapters first)."""
        with self._lock:
            self._set_tenant(self._get(key), tenant)

    # ---- the step loop's verbs -----------------------------------------------------------------
    def acquire(self, key: str, waiter: object = None, *, count: bool = True, tenant: str | None = None) -> int | None:
        """Slot of `key` with one more reference, or None while it loads (the load is started here; call
        again next step). `key` is `name@version`, or a bare name resolved to its current version now
        (`slot_key(slot)` tells which). `waiter` (the sequence id) lets a failed load fail exactly the
        requests that waited for it (AdapterLoadError; later ones start a new load). count=False: a
        request taking it again is not a new GPU hit or miss. `tenant`: the request's (its read's loader group)."""
        with self._lock:
            self._advance()
            if "@" not in key:
                key = self.resolve(key)
            entry = self._entries.get(key)
            if entry is None:
                raise AdapterNotFoundError(f"adapter {key!r} is not registered")
            if waiter is not None and waiter in entry.failed_waiters:
                raise entry.failed_waiters.pop(waiter)
            if waiter is None and entry.failed_anonymous:
                entry.failed_anonymous = False
                if entry.error is not None and not entry.resident:  # else a later load succeeded
                    raise entry.error
            # A replaced version still serves the requests that hold it or that it was loaded for; once
            # none does it is dropped, and a request that resolved it earlier resolves the name again.
            if entry.retired and not entry.resident:
                raise AdapterNotFoundError(f"adapter {key!r} was replaced or unregistered")
            self._tick += 1
            first_look = waiter is None or waiter not in entry.waiters  # a waiting request was counted
            if count and first_look:
                self._count("hits" if entry.resident else "misses", "gpu")
            if entry.resident:
                entry.refcount, entry.uses, entry.last_used = entry.refcount + 1, entry.uses + 1, self._tick
                entry.count_holder(tenant)
                entry.waiters.discard(waiter)
                self._waited(waiter, took_it=True)
                if waiter in entry.detached:
                    self.reattached(entry, waiter)
                return entry.slot
            self._asked(waiter)
            if first_look:
                if not entry.on_gpu and entry.fetching is None:  # this request starts the load
                    self._count("hits" if entry.image is not None else "misses", "cpu")
                    entry.asker = tenant
                elif entry.read_ahead and not entry.ahead_counted:  # read ahead of it, not yet there: a CPU miss
                    self._count("misses", "cpu")
                    entry.ahead_counted = True
                if waiter is not None:
                    entry.waiters.add(waiter)
                else:
                    entry.asked_anonymously = True
            self._want(entry)
            if entry.fetching is not None:  # a warm-up's read queued: a request waits for it now
                self._executor.promote(entry.fetching)
            return None

    def release(self, slot: int, *, detach: object = None, tenant: str | None = None) -> None:
        """Give back one reference to the adapter in `slot` (`tenant`: as acquire's); `detach`: the id of a request
        that will take it again (as `abandon`'s), noted under the same lock, so that no retirement comes between."""
        with self._lock:
            entry = self._slot_owner.get(slot)
            if entry is None or entry.refcount <= 0:
                raise RuntimeError(f"release of slot {slot} that holds no reference")
            entry.count_holder(tenant, -1)
            if detach is not None and not entry.retired:
                entry.detached.add(detach)
            entry.refcount -= 1
            self._tick += 1
            entry.last_used = self._tick  # in use until now: as recent as one acquired now (LRU)
            if entry.refcount > 0:
                return
            if entry.retire_pending is not None and not entry.detached:
                self._retire(entry, entry.retire_pending)  # replaced while its last request ran on it
            if self._drop_if_unused(entry):  # a replaced or unregistered version's last request finished
                self._update_gauges()
            else:
                self._check_quota_due(entry)
            if self._wanted:
                self._sweep_wanted()  # it may make room for an adapter nobody's acquire retries (prefetch, pin)

    def hold(self, key: str, waiter: object, *, count: bool = False, tenant: str | None = None) -> str:
        """A request resolved to `key` is queued and has not taken it yet: a version switch or unregistration
        meanwhile leaves the version registered until the request takes it (acquire) or goes (abandon), as for
        a request that gave it back to take it again (`detached`), so that a rollout fails no queued request.
        AdapterNotFoundError if it went since the request resolved it (the caller resolves the name again).
        `count`: the request's one GPU lookup, a hit if the version is resident as it arrives, else a miss (the
        engine's requests are counted here, not when the scheduler reaches them: those queued behind the first
        for a cold adapter reach it once it is loaded), and its read ahead (`_read_ahead`; `tenant`'s turn)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.retired:
                raise AdapterNotFoundError(f"adapter {key!r} was replaced or unregistered")
            if count:
                self._count("hits" if entry.resident else "misses", "gpu", waiter)
                self._read_ahead(entry, tenant)
            entry.detached.add(waiter)
            return key

    def abandon(self, key: str, waiter: object, *, detach: bool = False) -> None:
        """A waiting request went away (aborted) before its adapter arrived. `detach`: it only stops waiting for now
        and will take it again (it ran on this version): not retired before it does, or goes away (`reattached`)."""
        with self._lock:
            entry, self._room = self._entries.get(key), None  # what it waited for may leave room (worker/read_room.py)
            if not detach:
                self._waited(waiter, took_it=False)
            if entry is not None:
                entry.waiters.discard(waiter)
                entry.failed_waiters.pop(waiter, None)
                if detach and not entry.retired:
                    entry.detached.add(waiter)
                    return
                if waiter in entry.detached:
                    self.reattached(entry, waiter)
                if not (entry.on_gpu or entry.waiters or entry.detached or entry.asked_anonymously or entry.pinned
                        or entry.key in self._warm or self._pending.get(entry.name) == entry.key):
                    self._wanted.pop(entry.key, None)  # its read ends on the CPU: no idle adapter is evicted for it
                if self._drop_if_unused(entry):  # loaded for that request only, and replaced since
                    self._update_gauges()
                else:
                    self._check_quota_due(entry)
            if self._wanted:
                self._sweep_wanted()  # reads it held back may start (others' acquire may not come: a prefetch, a hold)

    def poll(self) -> list[tuple[str, AdapterLoadError]]:
        """Advance loads without waiting: finish parsed loads and completed copies, place wanted
        adapters, bring back evicted warm versions when a check is due (`keep_warm`). Returns the
        failures since the last call (the last 100)."""
        with self._lock:
            self._advance()
            self._sweep_wanted()
            self._check_warm(kv_reserve=0)
            failures = list(self._failures)
            self._failures.clear()
            self._update_gauges()
            return failures

    def has_pending_loads(self) -> bool:
        """True while loads are in flight, adapters wait to be placed, or a look for missing warm versions is due."""
        with self._lock:
            return bool(self._inflight or self._wanted) or self._warm_check_due()

    def loads_in_flight(self) -> bool:
        """True while a read or a copy runs (it finishes on its own: poll() soon picks it up)."""
        with self._lock:
            return bool(self._inflight)

    def _loader_threads(self) -> FairExecutor:
        # Optionally bound the CPU threads a loader's torch ops fan out to (GPU workers only).
        cpu_threads = self.config.loader_cpu_threads if self._cuda else None
        return FairExecutor(self.config.num_load_threads, spare_threads=self.config.spare_load_threads,
                            thread_name_prefix="adapter-load", initializer=limit_cpu_threads, initargs=(cpu_threads,))

    # ---- explicit residency: can_load / load / evict, prefetch ---------------------------------
    def prefetch(self, key: str, tier: str = "gpu") -> None:
        """Warm an adapter before traffic arrives: into the CPU tier, or all the way to the GPU."""
        if tier not in ("gpu", "cpu"):
            raise ValueError(f"prefetch tier must be 'gpu' or 'cpu', got {tier!r}")
        with self._lock:
            entry = self._get(key)
            if tier == "gpu":
                self._want(entry)
            elif entry.image is None and entry.fetching is None:
                self._start_fetch(entry)

    def can_load(self, key: str) -> bool:
        """True if `key` is resident, or its CPU image could be placed now (evicting if allowed)."""
        with self._lock:
            entry = self._get(key)
            if entry.on_gpu:
                return True
            return entry.image is not None and self._placement_plan(entry) is not None

    def load(self, key: str, timeout: float | None = 60.0) -> int:
        """Bring `key` to the GPU and wait (tools, start-up, tests; never the step loop). Returns its
        slot (without taking a reference)."""
        with self._lock:
            entry = self._get(key)
            entry.failed_anonymous = False
            entry.error = None
            entry.asked_anonymously = not entry.on_gpu  # refused, as requests are, while pinned adapters keep it out
            failures = entry.failures
            self._want(entry)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self.poll()
                if entry.resident:
                    return entry.slot
                if self._entries.get(key) is not entry or entry.retired:
                    raise AdapterNotFoundError(f"adapter {key!r} was removed or replaced while it loaded")
                # A load of it failed, or its owner's pinned adapters keep it out (still wanted), since this call
                # began (told here or first to another caller), and no copy to the GPU has begun since.
                if entry.failures != failures and entry.error is not None and not entry.on_gpu:
                    entry.failed_anonymous = False
                    raise entry.error
                if key not in self._wanted and not entry.on_gpu and entry.fetching is None:
                    self._want(entry)  # it landed and left the GPU again before this looked
            if deadline is not None and time.monotonic() > deadline:
                with self._lock:
                    entry.asked_anonymously = False
                raise TimeoutError(f"{key} did not become resident within {timeout} s (pool full of pinned "
                                   f"or in-use adapters, or KV cache holding the pages?)")
            self._wait_some(0.005)

    def evict(self, key: str, tier: str = "gpu") -> None:
        """Evict `key` from a tier. Refused while requests use or wait for it, or it is pinned (GPU tier)."""
        with self._lock:
            entry = self._get(key)
            if tier == "gpu":
                if entry.refcount > 0 or entry.pinned or entry.copying is not None or entry.waiters:
                    raise RuntimeError(f"{key} cannot be evicted: refcount={entry.refcount}, pinned={entry.pinned}, "
                                       f"copying={entry.copying is not None}, queued requests={len(entry.waiters)}")
                if entry.resident:
                    self._evict_gpu(entry, "capacity")
            elif tier == "cpu":
                if entry.image is not None and entry.copying is None:
                    self._evict_cpu(entry, "budget")
            else:
                raise ValueError(f"tier must be 'gpu' or 'cpu', got {tier!r}")
            self._update_gauges()

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until no load is in flight and nothing wanted can be placed (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self.poll()
                busy = any(e.fetching is not None or e.copying is not None for e in self._entries.values())
                placeable = any(
                    (e := self._entries.get(k)) is not None and e.image is not None and not e.on_gpu
                    and self._placement_plan(e) is not None
                    for k in self._wanted
                )
                if not busy and not placeable:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("adapter loads still in flight")
            self._wait_some(0.005)

    def close(self) -> None:
        """Cancel the loads still queued; a read under way (a hung mount) ends on its own thread, unwaited."""
        self._executor.shutdown(wait=False)
        if self._copy_executor is not None:
            self._copy_executor.shutdown(wait=True, cancel_futures=True)

    # ---- queries -------------------------------------------------------------------------------
    def slot_key(self, slot: int) -> str | None:
        return entry.key if (entry := self._slot_owner.get(slot)) is not None else None

    def slot_rank(self, slot: int) -> int | None:
        """The largest rank of the adapter in `slot` (fixed with its digest), None for an empty slot."""
        return entry.max_rank if (entry := self._slot_owner.get(slot)) is not None else None
