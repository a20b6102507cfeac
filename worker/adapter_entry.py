"""AdapterEntry: one registered adapter version (`name@version`) and where it is in the tiers.

Per-adapter state is plain Python; only the pool's `LoRALayout` reaches kernels. Tiers:
`image` set = warm (CPU tier), `resident` = hot (GPU pages + slot, layout rows written), `copying`
= pages and slot taken, host-to-device copy in flight (never visible to kernels until done).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorafleet.worker.adapter_image import AdapterImage

Loader = Callable[[], Any]  # returns LoRAWeights (modules, nbytes, ...); runs in a loader thread


class AdapterLoadError(RuntimeError):
    """Loading `key` failed (download, digest, corrupt file, shape); only its waiting requests fail.
    `retryable`: the cause may pass (a read error, a timeout, a failed device copy, slots held by pinned
    adapters), so a later request loads it again; else the files or the settings must change first."""

    def __init__(self, key: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(f"adapter {key}: {message}")
        self.key = key
        self.reason = message
        self.retryable = retryable


class AdapterNotFoundError(KeyError):
    """No adapter of that name (or name@version) is registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "adapter not registered"


def split_key(key: str) -> tuple[str, str]:
    name, sep, version = key.partition("@")
    if not sep or not name or not version:
        raise ValueError(f"adapter key {key!r} must be 'name@version'")
    return name, version


_serials = itertools.count()


@dataclass(slots=True)
class AdapterEntry:
    key: str
    name: str
    version: str
    tenant: str
    loader: Loader | None
    pinned: bool = False
    priority: int = 0  # higher survives GPU eviction longer (the pushed directive's priority)
    image: AdapterImage | None = None  # CPU tier
    digest: str | None = None  # content digest fixed at first load: a reload must match it
    max_rank: int = 0  # its largest rank, fixed with the digest (known once it has been on the CPU)
    slot: int | None = None
    page_ids: list[int] = field(default_factory=list)
    gpu_bytes: int = 0  # bytes of its GPU pages while on_gpu
    resident: bool = False
    fetching: Future | None = None
    fetch_started: float = 0.0  # monotonic time the current load was asked for
    fetch_began: list = field(default_factory=list)  # [monotonic time a loader thread took it], once it did
    hung: Future | None = None  # a read past the time limit whose thread has not come back
    read_group: str = ""  # the loader group its last read went to (an asking tenant's, or its owner's)
    image_bytes: int = 0  # the size of its last image (0: never read): what reading it again takes
    image_pages: int = 0  # ...and the GPU pages it takes (its digest fixes them): known once read, evicted or not
    copying: Any = None  # a Future (CPU device) or a (done_event, start_event) pair (CUDA)
    refcount: int = 0
    holders: dict[str, int] = field(default_factory=dict)  # tenant -> the references its requests hold
    uses: int = 0
    last_used: int = 0
    retired: bool = False
    retire_reason: str = "version"  # version | unregister
    # Requests that ran on it (they have output) and gave it back to free its room (the scheduler's let-go):
    # they take it again, so it is not retired while any is left, nor while a request holds it; a retirement
    # meanwhile waits (retire_pending: it can still leave the GPU and be read again for them).
    detached: set = field(default_factory=set)
    retire_pending: str | None = None
    load_seconds: float = 0.0  # last disk->CPU load
    serial: int = field(default_factory=lambda: next(_serials))  # this registration's, unique: a key dropped and
    # registered again may carry other weights (prefix_cache.py keeps KV per registration)
    copy_seconds: float = 0.0  # last CPU->GPU copy
    error: AdapterLoadError | None = None  # last failure, for reports
    waiters: set = field(default_factory=set)  # waiter ids of acquire() calls that got None
    # Waiter -> the failure of the load it waited for, to be told once (a later load may have succeeded).
    failed_waiters: dict = field(default_factory=dict)
    failed_anonymous: bool = False
    failures: int = 0  # loads failed and callers refused so far: a load() waiting tells the ones after its start
    # The tenant of the request whose acquire starts its read: the loader group it is read in (fair_executor.py),
    # so that adapters one owner ("default": an --adapters folder, a keys file's patterns) lends to many tenants
    # are read in turns per asking tenant, not in one queue for all. None: its owner's group.
    asker: str | None = None
    asked_anonymously: bool = False  # an acquire() without a waiter, or load(), waits for it: refused as a waiter is
    read_ahead: bool = False  # the read in flight started as a request arrived (AdapterPool.hold), before any ask
    ahead_counted: bool = False  # an ask counted its CPU-tier miss while that read was in flight

    def count_holder(self, tenant: str | None, count: int = 1) -> None:
        """`tenant`'s requests hold `count` more references (fewer, negative); None: a caller of no tenant."""
        if tenant is not None and (left := self.holders.get(tenant, 0) + count) > 0:
            self.holders[tenant] = left
        elif tenant is not None:
            self.holders.pop(tenant, None)

    @property
    def replaced(self) -> bool:
        """Replaced or unregistered: no new request names it, whether it is gone (retired) or still kept for
        the requests that ran on it (retire_pending)."""
        return self.retired or self.retire_pending is not None

    @property
    def on_gpu(self) -> bool:
        """Holds GPU pages (resident or copying)."""
        return self.slot is not None

    def tier(self) -> str:
        if self.resident:
            return "gpu"
        if self.image is not None:
            return "cpu"
        return "none"


class AdapterSlots(Protocol):
    """The part of the AdapterPool the scheduler uses. `acquire` raises when the adapter cannot be
    loaded (only the sequences waiting for it fail)."""

    def acquire(self, key: str, waiter: object = None, *, count: bool = True,
                tenant: str | None = None) -> int | None: ...
    def release(self, slot: int) -> None: ...
    def abandon(self, key: str, waiter: object) -> None: ...
    def entry(self, key: str) -> AdapterEntry: ...


def replaced_version(key: str, adapter_pool: AdapterSlots) -> bool:
    """A push replaced version `key` (it is kept only for the requests that resolved it): one with nothing
    generated yet that cannot have it (every slot pinned by its successor) goes to the current version."""
    try:
        return adapter_pool.entry(key).replaced
    except AdapterNotFoundError:
        return True


def adapter_pages(key: str, adapter_pool: AdapterSlots) -> int | None:
    """GPU pages adapter `key` takes (None: not in CPU memory, or unknown)."""
    try:
        image = adapter_pool.entry(key).image
    except AdapterNotFoundError:
        return None
    return None if image is None else image.num_pages
