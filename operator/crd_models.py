"""Typed views of the LoRAPool and LoRAAdapter custom resources (group lorafleet.dev, v1alpha1).

The API server's OpenAPI schema (crds/) already refuses malformed objects; parsing here is a second
line for what slips past (hand-edited objects, an older CRD): it raises ``SpecError`` naming the field.
The two agree: the patterns below are the CRDs' (and worker/directives.py's), so whatever parses can
be turned into a worker directive.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from lorafleet.operator.tenant_sources import parse_tenant_sources
from lorafleet.worker.directives import SHA256_RE
from lorafleet.worker.tenants import UNOWNED

if TYPE_CHECKING:
    from lorafleet.operator.autoscaler import ScalingSpec

GROUP = "lorafleet.dev"
VERSION = "v1alpha1"
POOLS = "lorapools"
ADAPTERS = "loraadapters"
DEFAULT_STAGER_PORT = 8001
EVICTION_POLICIES = ("lru", "lfu", "cost")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")

# Kubernetes quantity syntax (resource.Quantity) without a minus sign; the CRDs carry the same pattern.
_QUANTITY_RE = re.compile(r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([KMGTPE]i)|([numkMGTPE])|[eE]([+-]?[0-9]+))?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
MAX_QUANTITY = 2**63 - 1  # int64, as the API server stores integers


def _bounded_quantity_pattern() -> str:
    """The quantity syntax with at most as many digits before the point as keep the value below 1.2e18 (so
    within int64) for each unit: 18 without one (or with n, u, m, a negative exponent), 15 with k, Ki or
    e0-e3, 12 with M, Mi or e4-e6, 9 with G, Gi or e7-e9, 6 with T, Ti or e10-e12, 3 with P, Pi or
    e13-e15, and one digit 0-6 with E, Ei or e16-e18. The CRDs carry it as it is (a schema test checks)."""
    def mantissa(digits: int) -> str:
        return rf"0*[0-9]{{1,{digits}}}(\.[0-9]*)?|\.[0-9]+"

    units = [(mantissa(18), r"[num]?|[eE]-[0-9]+"), (mantissa(15), r"k|Ki|[eE]\+?0*[0-3]"),
             (mantissa(12), r"M|Mi|[eE]\+?0*[4-6]"), (mantissa(9), r"G|Gi|[eE]\+?0*[7-9]"),
             (mantissa(6), r"T|Ti|[eE]\+?0*1[0-2]"), (mantissa(3), r"P|Pi|[eE]\+?0*1[3-5]"),
             (r"0*[0-6](\.[0-9]*)?|\.[0-9]+", r"E|Ei|[eE]\+?0*1[6-8]")]
    return r"^\+?(" + "|".join(f"({m})({u})" for m, u in units) + r")$"


BOUNDED_QUANTITY_PATTERN = _bounded_quantity_pattern()
_BOUNDED_QUANTITY_RE = re.compile(BOUNDED_QUANTITY_PATTERN)
QUANTITY_LIMITS = ("about 1e18 bytes at most: up to 18 digits before the point, 15 with k/Ki/e0-e3, 12 with "
                   "M/Mi/e4-e6, 9 with G/Gi/e7-e9, 6 with T/Ti/e10-e12, 3 with P/Pi/e13-e15, one digit 0-6 with "
                   "E/Ei/e16-e18")
URI_RE = re.compile(r"^(s3://[^/]+/.*|file:///.*|/.*)$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")  # tenant, version, adapter name
# A Deployment name: a DNS-1123 subdomain.
DEPLOYMENT_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class SpecError(ValueError):
    """A spec the operator cannot act on; the message starts with the field path."""


def parse_quantity(value: Any, field_name: str) -> int:
    """Kubernetes byte quantity ("16Gi", "500M", "1e9", 1024) -> bytes, rounded up like Quantity.Value()."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        if value > MAX_QUANTITY:
            raise SpecError(f"{field_name}: {value!r} is more than {MAX_QUANTITY} bytes")
        return value
    m = _QUANTITY_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise SpecError(f"{field_name}: {value!r} is not a byte quantity >= 0 (e.g. 512Mi, 16Gi, 1e9, 1000000)")
    if not _BOUNDED_QUANTITY_RE.fullmatch(value):  # as the CRD refuses it
        raise SpecError(f"{field_name}: {value!r} is too large for a byte quantity ({QUANTITY_LIMITS})")
    number, binary, decimal, exponent = Fraction(m.group(1)), m.group(2), m.group(3), m.group(4)
    if binary:
        number *= _BINARY[binary]
    else:
        power = _DECIMAL[decimal] if decimal else int(exponent or 0)
        # Exact below |power| 400; past it the value is 0, a fraction of a byte (rounded up), or beyond int64.
        number *= Fraction(10) ** max(-400, min(power, 400))
    if math.ceil(number) > MAX_QUANTITY:
        raise SpecError(f"{field_name}: {value!r} is more than {MAX_QUANTITY} bytes")
    return math.ceil(number)


def _int(value: Any, field_name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (lo is not None and value < lo) or (
            hi is not None and value > hi):
        bound = f" {lo}..{hi}" if hi is not None else f" >= {lo}" if lo is not None else ""
        raise SpecError(f"{field_name}: {value!r} must be an integer{bound}")
    return value


def deployment_name(value: Any, field_name: str) -> str:
    if not isinstance(value, str) or len(value) > 253 or not DEPLOYMENT_NAME_RE.fullmatch(value):
        raise SpecError(f"{field_name}: {value!r} is not a Deployment name (lowercase letters, digits, '-' and '.', "
                        f"at most 253)")
    return value


def _name(value: Any, field_name: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise SpecError(f"{field_name}: {value!r} must be 1-253 letters, digits, '.', '_' or '-' "
                        f"(starting with a letter or digit)")
    return value


@dataclass(slots=True, frozen=True)
class Source:
    uri: str
    sha256: str | None = None
    credentials_secret: str | None = None

    @classmethod
    def parse(cls, data: Any, field_name: str) -> Source:
        if not isinstance(data, dict) or not isinstance(data.get("uri"), str):
            raise SpecError(f"{field_name}.uri: required (s3://bucket/prefix/, file:///path or /path)")
        if not URI_RE.fullmatch(data["uri"]):
            raise SpecError(f"{field_name}.uri: {data['uri']!r} must be s3://bucket/prefix, file:///path or /path")
        if not data["uri"].isprintable():  # as the worker's directive holds it (a pasted no-break space, a tab)
            i, bad = next((i, c) for i, c in enumerate(data["uri"]) if not c.isprintable())
            raise SpecError(f"{field_name}.uri: {data['uri']!r} must hold no control or invisible characters "
                            f"(U+{ord(bad):04X} at position {i}; tabs, line breaks, no-break or zero-width spaces "
                            f"are refused)")
        sha256 = data.get("sha256")
        if sha256 is not None and not (isinstance(sha256, str) and SHA256_RE.fullmatch(sha256)):
            raise SpecError(f"{field_name}.sha256: {sha256!r} must be 64 lowercase hex digits (`cat "
                            f"adapter_config.json adapter_model.safetensors | sha256sum`)")
        secret = data.get("credentialsSecret")
        if secret is not None and not isinstance(secret, str):
            raise SpecError(f"{field_name}.credentialsSecret: {secret!r} must be a Secret name")
        return cls(data["uri"], sha256, secret)


@dataclass(slots=True, frozen=True)
class Canary:
    version: str
    source: Source | None  # None is invalid; kept so reconcile can report it by field name
    weight: int


def _selector(selector: Any) -> dict[str, Any]:
    """A non-empty LabelSelector: the CRD's minProperties/minItems and CEL rule say the same."""
    field_name = "spec.workerSelector"
    if not isinstance(selector, dict) or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        raise SpecError(f"{field_name}: required (matchLabels/matchExpressions of the worker pods)")
    labels = selector.get("matchLabels")
    if labels is not None and not (isinstance(labels, dict) and labels
                                   and all(isinstance(v, str) for v in labels.values())):
        raise SpecError(f"{field_name}.matchLabels: must map label names to string values (not empty)")
    exprs = selector.get("matchExpressions")
    if exprs is not None and not (isinstance(exprs, list) and exprs and all(
            isinstance(e, dict) and isinstance(e.get("key"), str) and e.get("operator") in SELECTOR_OPERATORS
            for e in exprs)):
        raise SpecError(f"{field_name}.matchExpressions: each needs a key and an operator "
                        f"({', '.join(SELECTOR_OPERATORS)}); not empty")
    for i, e in enumerate(exprs or []):  # Kubernetes refuses these: In with no values would match no pod
        values, listed = e.get("values"), e["operator"] in ("In", "NotIn")
        if listed and not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
            raise SpecError(f"{field_name}.matchExpressions[{i}].values: {e['operator']} needs a non-empty list of "
                            f"label values")
        if not listed and values:
            raise SpecError(f"{field_name}.matchExpressions[{i}].values: must be empty for {e['operator']}")
    return selector


def pool_selector(body: dict[str, Any]) -> dict[str, Any] | None:
    """A pool's spec.workerSelector when that parses, whether or not the rest of its spec does: a pool with
    an invalid spec still holds the pods it selects (controller.py). None: the selector itself is invalid."""
    try:
        return _selector((body.get("spec") or {}).get("workerSelector"))
    except SpecError:
        return None


@dataclass(slots=True)
class PoolSpec:
    name: str
    namespace: str
    base_model: str
    worker_selector: dict[str, Any]
    model_uri: str = ""
    worker_port: int = 8000
    stager_port: int = DEFAULT_STAGER_PORT
    gpu_bytes: int = 0  # per worker: the most adapter bytes placement keeps warm there (with its own report)
    cpu_bytes: int = 0
    eviction: str = "lru"
    max_adapters_per_tenant: int | None = None
    max_bytes_per_tenant: int | None = None
    scaling: ScalingSpec | None = None  # spec.scaling: the autoscaler's policy
    tenant_sources: tuple[str, ...] = ()  # spec.tenantSources: each tenant's folders (operator/tenant_sources.py)
    generation: int = 0
    status: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> PoolSpec:
        from lorafleet.operator.autoscaler import ScalingSpec  # it imports this module

        meta, spec = body.get("metadata", {}), body.get("spec") or {}
        if not isinstance(spec.get("baseModel"), str) or not spec["baseModel"]:
            raise SpecError("spec.baseModel: required (the base model identity adapters must match)")
        selector = _selector(spec.get("workerSelector"))
        memory, quota = _object(spec, "adapterMemory"), _object(spec, "tenantQuota")
        max_adapters, max_bytes = quota.get("maxAdapters"), quota.get("maxBytes")
        if spec.get("workerDeployment") is not None:  # read from the body where trust is decided (worker_trust.py)
            deployment_name(spec["workerDeployment"], "spec.workerDeployment")
        eviction = spec.get("eviction", "lru")
        if eviction not in EVICTION_POLICIES:
            raise SpecError(f"spec.eviction: {eviction!r} must be one of {', '.join(EVICTION_POLICIES)}")
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace", ""),
            base_model=spec["baseModel"],
            worker_selector=selector,
            model_uri=spec.get("modelURI", ""),
            worker_port=_int(spec.get("workerPort", 8000), "spec.workerPort", lo=1, hi=65535),
            stager_port=_int(spec.get("stagerPort", DEFAULT_STAGER_PORT), "spec.stagerPort", lo=1, hi=65535),
            gpu_bytes=parse_quantity(memory.get("gpuBytes", 0), "spec.adapterMemory.gpuBytes"),
            cpu_bytes=parse_quantity(memory.get("cpuBytes", 0), "spec.adapterMemory.cpuBytes"),
            eviction=eviction,
            max_adapters_per_tenant=None if max_adapters is None else _int(
                max_adapters, "spec.tenantQuota.maxAdapters", lo=0),
            max_bytes_per_tenant=None if max_bytes is None else parse_quantity(max_bytes, "spec.tenantQuota.maxBytes"),
            scaling=None if spec.get("scaling") is None else ScalingSpec.parse(spec["scaling"]),
            tenant_sources=parse_tenant_sources(spec.get("tenantSources")),
            generation=int(meta.get("generation", 0)),
            status=dict(body.get("status") or {}),
        )


def _object(spec: dict[str, Any], key: str) -> dict[str, Any]:
    """An optional block of a spec, {} when absent; a SpecError where it is not an object (it would raise an
    AttributeError, which no caller takes for an invalid spec: every pool's pass that reads it would fail)."""
    value = spec.get(key) or {}
    if not isinstance(value, dict):
        raise SpecError(f"spec.{key}: {value!r} must be an object")
    return value


def drain_spec(body: dict[str, Any], *, selector: dict[str, Any] | None = None) -> PoolSpec | None:
    """What draining a deleting pool whose spec does not parse needs: its workerSelector (``selector`` in its
    place, if given) and its sidecars' port (spec.stagerPort, the default where that is the invalid field).
    None: its selector is invalid (and none is given)."""
    selector = pool_selector(body) if selector is None else selector
    if selector is None:
        return None
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    try:
        port = _int(spec.get("stagerPort", DEFAULT_STAGER_PORT), "spec.stagerPort", lo=1, hi=65535)
    except SpecError:
        port = DEFAULT_STAGER_PORT
    return PoolSpec(meta.get("name", ""), meta.get("namespace", ""), "", selector, stager_port=port)


@dataclass(slots=True)
class AdapterSpec:
    name: str
    namespace: str
    pool: str
    tenant: str
    base_model: str
    version: str
    source: Source
    canary: Canary | None = None
    warm: int | str = 0  # number of workers keeping it GPU-resident, or "all"
    pinned: bool = False
    priority: int = 0
    generation: int = 0
    created: str = ""  # creationTimestamp: quota admission is first come, first served
    deleting: bool = False
    # Last size a worker reported (status.bytes; status.refusedBytes of this version): quota counts it once known
    known_bytes: int = 0
    known_canary_bytes: int = 0  # the same for its canary version (status.canaryBytes of that version)
    status: dict[str, Any] = field(default_factory=dict)
    raw_spec: dict[str, Any] = field(default_factory=dict)  # as written; remembered once accepted
    last_valid: AdapterSpec | None = None  # from status.lastValidSpec: kept in force while an edit is invalid

    @property
    def spec_json(self) -> str:
        """``raw_spec`` as status.lastValidSpec stores it (a string: a merge patch replaces it whole)."""
        return json.dumps(self.raw_spec, sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, body: dict[str, Any]) -> AdapterSpec:
        meta, status = body.get("metadata", {}), body.get("status") or {}
        adapter = cls._parse(meta, body.get("spec") or {}, status)
        adapter.last_valid = last_valid_spec(meta, status)
        return adapter

    @classmethod
    def _parse(cls, meta: dict[str, Any], spec: dict[str, Any], status: dict[str, Any]) -> AdapterSpec:
        _name(meta.get("name", ""), "metadata.name")
        for key in ("pool", "tenant", "baseModel", "version"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise SpecError(f"spec.{key}: required")
        _name(spec["tenant"], "spec.tenant")
        if spec["tenant"] == UNOWNED:  # the worker lets the keys file's patterns grant such adapters to anyone
            raise SpecError(f'spec.tenant: "{UNOWNED}" is reserved (adapters of no tenant in particular); name the '
                            f'owning tenant')
        _name(spec["version"], "spec.version")
        warm = spec.get("warm", 0)
        if not (warm == "all" or (isinstance(warm, int) and not isinstance(warm, bool) and warm >= 0)):
            raise SpecError(f"spec.warm: {warm!r} must be a count >= 0 or 'all'")
        pinned = spec.get("pinned", False)
        if not isinstance(pinned, bool):
            raise SpecError(f"spec.pinned: {pinned!r} must be true or false")
        canary = None
        if spec.get("canary"):
            c = spec["canary"]
            if not isinstance(c, dict):
                raise SpecError("spec.canary: must be an object with version, source and weight")
            weight = _int(c.get("weight", 0), "spec.canary.weight", lo=0, hi=100)
            if not isinstance(c.get("version"), str) or not c["version"]:
                raise SpecError("spec.canary.version: required when spec.canary is set")
            _name(c["version"], "spec.canary.version")
            source = Source.parse(c["source"], "spec.canary.source") if c.get("source") else None
            canary = Canary(c["version"], source, weight)
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace", ""),
            pool=spec["pool"],
            tenant=spec["tenant"],
            base_model=spec["baseModel"],
            version=spec["version"],
            source=Source.parse(spec.get("source"), "spec.source"),
            canary=canary,
            warm=warm,
            pinned=pinned,
            priority=_int(spec.get("priority", 0), "spec.priority"),
            generation=int(meta.get("generation", 0)),
            created=str(meta.get("creationTimestamp", "")),
            deleting=bool(meta.get("deletionTimestamp")),
            known_bytes=max(_status_bytes(status, spec["version"]), _sized(status.get("refusedBytes"), spec["version"])),
            known_canary_bytes=_sized(status.get("canaryBytes"), canary.version if canary else None),
            status=dict(status),
            raw_spec=dict(spec),
        )


def _status_bytes(status: dict[str, Any], version: str) -> int:
    """status.bytes when it is the size of ``version`` (status.bytesVersion; a status written before that field:
    when workers served ``version``, or it names no version at all), else 0: a new version's size is not known
    until a worker staged it."""
    measured = status.get("bytesVersion", status.get("stableVersion", version))
    return _sized({"version": measured, "bytes": status.get("bytes")}, version)


def _sized(remembered: Any, version: str | None) -> int:
    """The bytes of a status's ``{version, bytes}`` entry (canaryBytes, refusedBytes) when it is of ``version``
    (else 0: not known)."""
    if version is None or not isinstance(remembered, dict) or remembered.get("version") != version:
        return 0
    size = remembered.get("bytes")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


def last_valid_spec(meta: dict[str, Any], status: dict[str, Any]) -> AdapterSpec | None:
    """The spec the operator last accepted (status.lastValidSpec), or None when absent or unreadable."""
    text = status.get("lastValidSpec")
    if not isinstance(text, str):
        return None
    try:
        spec = json.loads(text)
        return AdapterSpec._parse(meta, spec, status) if isinstance(spec, dict) else None
    except (ValueError, SpecError):  # json.JSONDecodeError is a ValueError
        return None


@dataclass(slots=True)
class InvalidAdapter:
    """A spec that does not parse: Failed, its last valid spec kept in force, unloaded by name when deleted."""

    name: str
    namespace: str
    error: str  # the SpecError message, starting with the field path
    generation: int = 0
    deleting: bool = False
    status: dict[str, Any] = field(default_factory=dict)
    last_valid: AdapterSpec | None = None
    raw_spec: dict[str, Any] = field(default_factory=dict)  # as written (a rollback in it still applies: rollback.py)


def parse_adapter(body: dict[str, Any]) -> AdapterSpec | InvalidAdapter:
    """Never raises: a body that does not parse becomes an ``InvalidAdapter``."""
    try:
        return AdapterSpec.parse(body)
    except SpecError as exc:
        meta, status, spec = body.get("metadata") or {}, body.get("status") or {}, body.get("spec")
        return InvalidAdapter(name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")),
                              error=str(exc), generation=int(meta.get("generation", 0) or 0),
                              deleting=bool(meta.get("deletionTimestamp")), status=dict(status),
                              last_valid=last_valid_spec(meta, status), raw_spec=spec if isinstance(spec, dict) else {})
