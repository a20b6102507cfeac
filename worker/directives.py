"""The desired-state push between operator -> stager sidecar -> engine admin API, and the report back.

Operator ``PUT``s a ``DesiredState`` to a pod's stager (``/v1/directives``); the stager stages the
artifacts and forwards the engine's part to ``PUT /admin/v1/state``. ``GET /v1/state`` (stager) and
``GET /admin/v1/state`` (engine) answer a ``ReportedState``. Both are idempotent and carry a
generation: a receiver ignores a push whose generation is lower than the one it already applied, so
an operator restart or a retried push never rolls a worker back.

Running example: adapter ``sql`` of tenant ``acme`` at stable ``v2`` with a ``v3`` canary at 20 %::

    AdapterDirective(name="sql", tenant="acme",
                     stable=VersionRef("v2", "s3://adapters/sql/v2/", "ab12..."),
                     canary=VersionRef("v3", "s3://adapters/sql/v3/"), canary_weight=20,
                     warm=True, pinned=False, priority=0)
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from lorafleet.worker.eviction import POLICIES
from lorafleet.worker.tenant_folders import TenantFolders

TIERS = ("gpu", "cpu", "disk", "none")
URI_SCHEMES = ("s3://", "file://", "/")
# Whole strings only (fullmatch: `$` would also take a trailing newline, a forged line in the logs).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")  # a version's digest (the operator checks specs with it too)
EVICTION_POLICIES = tuple(POLICIES)  # lru, lfu, cost
_SETTINGS = ("eviction", "cpu_bytes")  # DesiredState's pool-wide settings
# The largest desired state a stager or engine reads (room for about 150,000 adapters at 300-450 bytes each; a
# set that large takes seconds to parse, off the event loop), whatever the inference body limit
# (--max-body-bytes): a pool's whole set travels in one push, behind the token.
MAX_STATE_BYTES = 64 << 20
# The version an `AdapterState` reports for a start-up adapter folder that is not served (one the stager's
# seed could not stage, a local --adapters one that did not load): no version of it exists, its digest is unknown.
UNSTAGED = "unstaged"
MAX_WITHIN = 32  # folders a version's `within` (or `without`) may list: the CRD's maxItems of a pool's spec.tenantSources


class _Message:
    """A dataclass message sent as JSON (keys sorted: the same state always gives the same bytes)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


class DirectiveError(ValueError):
    """A directive or report that does not follow the schema; the message names the field."""


def _require(cond: bool, field_name: str, problem: str) -> None:
    if not cond:
        raise DirectiveError(f"{field_name}: {problem}")


def _name(value: Any, field_name: str) -> str:
    _require(isinstance(value, str) and bool(_NAME_RE.fullmatch(value)), field_name,
             f"must be a name of letters, digits, '.', '_' or '-' (got {value!r})")
    return value


def is_name(value: Any) -> bool:
    """Whether `value` may name an adapter or a version (in a push, a report, load_lora_adapter)."""
    return isinstance(value, str) and bool(_NAME_RE.fullmatch(value))


def _int(value: Any, field_name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), field_name, f"must be an integer (got {value!r})")
    _require(lo is None or value >= lo, field_name, f"must be >= {lo} (got {value})")
    _require(hi is None or value <= hi, field_name, f"must be <= {hi} (got {value})")
    return value


def _bool(value: Any, field_name: str) -> bool:
    _require(isinstance(value, bool), field_name, f"must be true or false (got {value!r})")
    return value


def _check_folders(folders: Any, name: str) -> None:
    _require(isinstance(folders, tuple) and len(folders) <= MAX_WITHIN and all(
        isinstance(w, str) and w.startswith(("/", "file:///")) and w.endswith("/") and w.isprintable()
        for w in folders), name, f"must be at most {MAX_WITHIN} local folders, each ending with '/' (got {folders!r})")


def folders_from(data: dict[str, Any]) -> TenantFolders:
    """The `within` and `without` lists of a version's JSON (absent: none), checked; DirectiveError naming
    the field."""
    lists = {name: data.get(name, []) for name in ("within", "without")}
    for name, value in lists.items():
        _require(isinstance(value, list), name, f"must be a list of folders (got {value!r})")
        _check_folders(tuple(value), name)
    return TenantFolders(tuple(lists["within"]), tuple(lists["without"]))


@dataclass(slots=True, frozen=True)
class VersionRef:
    """One version of an adapter and where its PEFT directory lives."""

    version: str
    uri: str
    sha256: str | None = None
    # A local source's tenant folders (its pool's spec.tenantSources, filled in for its tenant): the folder
    # and the files in it must resolve (symlinks followed) inside one of them. Empty: no such rule.
    within: tuple[str, ...] = ()
    # Regions of those where other tenants' folders lie too (worker/tenant_folders.py): what resolves inside
    # one must lie in a `within` folder below it.
    without: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _name(self.version, "version")
        _require(isinstance(self.uri, str) and self.uri.startswith(URI_SCHEMES), "uri",
                 f"must start with one of {', '.join(URI_SCHEMES)} (got {self.uri!r})")
        _require(self.uri.isprintable(), "uri", f"must hold no control characters (got {self.uri!r})")
        _require(self.sha256 is None or (isinstance(self.sha256, str) and bool(SHA256_RE.fullmatch(self.sha256))),
                 "sha256", "must be 64 lowercase hex digits")
        for name in ("within", "without"):
            _check_folders(getattr(self, name), name)

    @property
    def folders(self) -> TenantFolders:
        return TenantFolders(self.within, self.without)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": self.version, "uri": self.uri, "sha256": self.sha256}
        if self.within:  # absent when empty, as an older operator sends it
            data["within"] = list(self.within)
        if self.without:
            data["without"] = list(self.without)
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str) -> VersionRef:
        _require(isinstance(data, dict), where, "must be an object with version, uri, sha256")
        try:
            folders = folders_from(data)
            return cls(data.get("version"), data.get("uri"), data.get("sha256"), folders.within, folders.without)
        except DirectiveError as exc:
            raise DirectiveError(f"{where}.{exc}") from None


@dataclass(slots=True)
class AdapterDirective:
    """What one worker should do with one adapter: register stable (+ canary), keep warm, pin."""

    name: str
    tenant: str
    stable: VersionRef
    canary: VersionRef | None = None
    canary_weight: int = 0  # percent of users routed to the canary, sticky per user
    warm: bool = False  # keep GPU-resident on this worker
    pinned: bool = False  # never evicted on this worker
    priority: int = 0  # higher survives eviction longer

    def __post_init__(self) -> None:
        _name(self.name, "name")
        _name(self.tenant, "tenant")
        _require(isinstance(self.stable, VersionRef), "stable", "must be a VersionRef")
        _require(self.canary is None or isinstance(self.canary, VersionRef), "canary", "must be a VersionRef or null")
        _int(self.canary_weight, "canary_weight", lo=0, hi=100)
        _require(self.canary is not None or self.canary_weight == 0, "canary_weight",
                 "must be 0 when there is no canary")
        _require(self.canary is None or self.canary.version != self.stable.version, "canary.version",
                 "must differ from the stable version")
        _bool(self.warm, "warm")
        _bool(self.pinned, "pinned")
        _int(self.priority, "priority")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tenant": self.tenant, "stable": self.stable.to_dict(),
                "canary": None if self.canary is None else self.canary.to_dict(), "canary_weight": self.canary_weight,
                "warm": self.warm, "pinned": self.pinned, "priority": self.priority}

    @property
    def versions(self) -> tuple[str, ...]:
        return (self.stable.version,) if self.canary is None else (self.stable.version, self.canary.version)

    @classmethod
    def from_dict(cls, data: Any) -> AdapterDirective:
        _require(isinstance(data, dict), "adapters[]", "must be an object")
        name = data.get("name", "?")
        try:
            canary = data.get("canary")
            return cls(
                name=data.get("name"),
                tenant=data.get("tenant"),
                stable=VersionRef.from_dict(data.get("stable"), "stable"),
                canary=None if canary is None else VersionRef.from_dict(canary, "canary"),
                canary_weight=data.get("canary_weight", 0),
                warm=data.get("warm", False),
                pinned=data.get("pinned", False),
                priority=data.get("priority", 0),
            )
        except DirectiveError as exc:
            raise DirectiveError(f"adapters[{name}].{exc}") from None


@dataclass(slots=True)
class DesiredState(_Message):
    """A worker's full desired adapter set; anything registered but not listed is to be unloaded.

    The pool-wide settings (its LoRAPool's ``spec.eviction`` and ``spec.adapterMemory.cpuBytes``) are
    optional: None means the worker's own configuration, and a push without them (an older operator)
    leaves them out of its JSON.
    """

    generation: int
    adapters: list[AdapterDirective] = field(default_factory=list)
    eviction: str | None = None  # eviction policy of the adapter pool: lru | lfu | cost
    cpu_bytes: int | None = None  # byte budget of the CPU (warm) tier

    def __post_init__(self) -> None:
        _int(self.generation, "generation", lo=0)
        dup = sorted(n for n, c in Counter(a.name for a in self.adapters).items() if c > 1)
        _require(not dup, "adapters", f"names must be unique (duplicated: {', '.join(dup)})")
        _require(self.eviction is None or self.eviction in EVICTION_POLICIES, "eviction",
                 f"must be one of {', '.join(EVICTION_POLICIES)} or absent (got {self.eviction!r})")
        if self.cpu_bytes is not None:
            _int(self.cpu_bytes, "cpu_bytes", lo=0)

    def by_name(self) -> dict[str, AdapterDirective]:
        return {a.name: a for a in self.adapters}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"generation": self.generation, "adapters": [a.to_dict() for a in self.adapters]}
        for key in _SETTINGS:
            if getattr(self, key) is not None:  # None, the worker's own: absent, as an older operator sends it
                data[key] = getattr(self, key)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> DesiredState:
        _require(isinstance(data, dict), "desired state", "must be a JSON object")
        adapters = data.get("adapters", [])
        _require(isinstance(adapters, list), "adapters", "must be a list")
        return cls(generation=data.get("generation"), adapters=[AdapterDirective.from_dict(a) for a in adapters],
                   eviction=data.get("eviction"), cpu_bytes=data.get("cpu_bytes"))

    @classmethod
    def from_json(cls, text: str | bytes) -> DesiredState:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise DirectiveError(f"desired state: not valid JSON ({exc})") from None
        return cls.from_dict(data)


@dataclass(slots=True)
class AdapterState:
    """What one worker actually holds of one adapter version."""

    name: str
    version: str
    tier: str = "none"  # gpu | cpu | disk | none (registered, nothing local yet)
    refcount: int = 0
    hits: int = 0
    bytes: int = 0
    pinned: bool = False
    error: str | None = None  # last staging/loading failure for this version
    # Share of the name's users the worker sends to this version now (its split as applied); None: not told
    # (a version only staged on disk, or a worker that does not report it).
    traffic_percent: int | None = None
    # The stager is still staging it for the push it applies (a download in progress): not lost, on its way.
    staging: bool = False
    # While staging: the bytes its download has brought so far (`bytes` is then the download's total, 0 while not
    # known). None: no download of it in progress (not begun, or a check or hash of a cached copy).
    bytes_done: int | None = None
    # Set when this version is not GPU-resident and cannot become so on this worker: every one of its GPU
    # adapter slots (--max-loras), this many, is held by a pinned adapter. None: it can, or the worker does
    # not say (an older one).
    num_pinned_slots: int | None = None

    def __post_init__(self) -> None:
        _name(self.name, "name")
        _name(self.version, "version")
        _require(self.tier in TIERS, "tier", f"must be one of {', '.join(TIERS)} (got {self.tier!r})")
        for f in ("refcount", "hits", "bytes"):
            _int(getattr(self, f), f, lo=0)
        _bool(self.pinned, "pinned")
        _require(self.error is None or isinstance(self.error, str), "error", "must be a string or null")
        if self.traffic_percent is not None:
            _int(self.traffic_percent, "traffic_percent", lo=0, hi=100)
        _bool(self.staging, "staging")
        if self.bytes_done is not None:
            _int(self.bytes_done, "bytes_done", lo=0)
        if self.num_pinned_slots is not None:
            _int(self.num_pinned_slots, "num_pinned_slots", lo=1)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _STATE_FIELDS if f != "bytes_done" or self.bytes_done is not None}

    @property
    def is_loaded(self) -> bool:
        """Servable without a download: resident on GPU or in the CPU cache, and not failed."""
        return self.error is None and self.tier in ("gpu", "cpu")

    @classmethod
    def from_dict(cls, data: Any) -> AdapterState:
        _require(isinstance(data, dict), "adapters[]", "must be an object")
        known = {k: data[k] for k in ("name", "version", "tier", "refcount", "hits", "bytes", "pinned", "error",
                                      "traffic_percent", "staging", "num_pinned_slots", "bytes_done") if k in data}
        try:
            return cls(**known)
        except TypeError as exc:
            raise DirectiveError(f"adapters[]: {exc}") from None
        except DirectiveError as exc:
            raise DirectiveError(f"adapters[{data.get('name', '?')}].{exc}") from None


_STATE_FIELDS = tuple(f.name for f in fields(AdapterState))


@dataclass(slots=True)
class ReportedState(_Message):
    """A worker's actual state; one ``AdapterState`` per (name, version) it knows about."""

    generation_applied: int = 0  # highest DesiredState.generation fully acted upon
    adapters: list[AdapterState] = field(default_factory=list)
    pool_bytes: int = 0  # adapter bytes the pool can hold (GPU)
    pool_slots: int = 0  # adapters the pool can hold on the GPU at once (its --max-loras); 0 = not said
    pool_used_bytes: int = 0
    kv_usage: float = 0.0  # KV pages over those the KV cache could hold (free and idle adapters'), 0..1
    error: str | None = None  # a directive the receiver refused, with the reason
    # A stager none of whose pushes has reached its engine yet (a new pod: its model may still be loading). Its
    # pod is not ready: the operator pushes it its pool's set all the same, so that it stages while it starts.
    awaiting_push: bool = False
    pushed_generation: int | None = None  # the stager's: the generation of the push it holds (0: none yet)

    def __post_init__(self) -> None:
        _int(self.generation_applied, "generation_applied", lo=0)
        _require(isinstance(self.awaiting_push, bool), "awaiting_push", f"must be a boolean (got {self.awaiting_push!r})")
        if self.pushed_generation is not None:  # None: not said (the engine's own report, an older stager)
            _int(self.pushed_generation, "pushed_generation", lo=0)
        _int(self.pool_bytes, "pool_bytes", lo=0)
        _int(self.pool_slots, "pool_slots", lo=0)
        _int(self.pool_used_bytes, "pool_used_bytes", lo=0)
        _require(isinstance(self.kv_usage, int | float) and 0.0 <= self.kv_usage <= 1.0, "kv_usage",
                 f"must be a fraction in [0, 1] (got {self.kv_usage!r})")

    def to_dict(self) -> dict[str, Any]:
        data = {f: getattr(self, f) for f in _REPORT_FIELDS}
        data["adapters"] = [a.to_dict() for a in self.adapters]
        return data

    def find(self, name: str, version: str) -> AdapterState | None:
        for a in self.adapters:
            if a.name == name and a.version == version:
                return a
        return None

    @classmethod
    def from_dict(cls, data: Any) -> ReportedState:
        _require(isinstance(data, dict), "reported state", "must be a JSON object")
        adapters = data.get("adapters", [])
        _require(isinstance(adapters, list), "adapters", "must be a list")
        return cls(
            generation_applied=data.get("generation_applied", 0),
            adapters=[AdapterState.from_dict(a) for a in adapters],
            pool_bytes=data.get("pool_bytes", 0),
            pool_slots=data.get("pool_slots", 0),
            pool_used_bytes=data.get("pool_used_bytes", 0),
            kv_usage=data.get("kv_usage", 0.0),
            error=data.get("error"),
            awaiting_push=data.get("awaiting_push", False),
            pushed_generation=data.get("pushed_generation"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ReportedState:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise DirectiveError(f"reported state: not valid JSON ({exc})") from None
        return cls.from_dict(data)


_REPORT_FIELDS = tuple(f.name for f in fields(ReportedState))
