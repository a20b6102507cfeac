"""Typed views of the LoRAPool and LoRAAdapter custom resources (group lorafleet.dev, v1alpha1).

The API server's OpenAPI schema (crds/) already refuses malformed objects; parsing here is a second
line for what slips past (hand-edited objects, an older CRD): it raises ``SpecError`` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

GROUP = "lorafleet.dev"
VERSION = "v1alpha1"
POOLS = "lorapools"
ADAPTERS = "loraadapters"
DEFAULT_STAGER_PORT = 8001

_QUANTITY_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)?$")
_SUFFIX = {None: 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
URI_RE = re.compile(r"^(s3://[^/]+/.*|file:///.*|/.*)$")


class SpecError(ValueError):
    """A spec the operator cannot act on; the message starts with the field path."""


def parse_quantity(value: Any, field_name: str) -> int:
    """Kubernetes byte quantity ("16Gi", "500M", 1024) -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _QUANTITY_RE.match(str(value)) if isinstance(value, str) else None
    if m is None:
        raise SpecError(f"{field_name}: {value!r} is not a byte quantity (e.g. 512Mi, 16Gi, 1000000)")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


@dataclass(slots=True, frozen=True)
class Source:
    uri: str
    sha256: str | None = None
    credentials_secret: str | None = None

    @classmethod
    def parse(cls, data: Any, field_name: str) -> Source:
        if not isinstance(data, dict) or not isinstance(data.get("uri"), str):
            raise SpecError(f"{field_name}.uri: required (s3://bucket/prefix/, file:///path or /path)")
        if not URI_RE.match(data["uri"]):
            raise SpecError(f"{field_name}.uri: {data['uri']!r} must be s3://bucket/prefix, file:///path or /path")
        return cls(data["uri"], data.get("sha256"), data.get("credentialsSecret"))


@dataclass(slots=True, frozen=True)
class Canary:
    version: str
    source: Source | None  # None is invalid; kept so reconcile can report it by field name
    weight: int


@dataclass(slots=True)
class PoolSpec:
    name: str
    namespace: str
    base_model: str
    worker_selector: dict[str, Any]
    model_uri: str = ""
    worker_port: int = 8000
    stager_port: int = DEFAULT_STAGER_PORT
    gpu_bytes: int = 0  # per worker, for placement when a worker does not report its pool size
    cpu_bytes: int = 0
    eviction: str = "lru"
    max_adapters_per_tenant: int | None = None
    max_bytes_per_tenant: int | None = None
    generation: int = 0
    status: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> PoolSpec:
        meta, spec = body.get("metadata", {}), body.get("spec") or {}
        if not isinstance(spec.get("baseModel"), str) or not spec["baseModel"]:
            raise SpecError("spec.baseModel: required (the base model identity adapters must match)")
        selector = spec.get("workerSelector")
        if not isinstance(selector, dict) or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            raise SpecError("spec.workerSelector: required (matchLabels/matchExpressions of the worker pods)")
        memory = spec.get("adapterMemory") or {}
        quota = spec.get("tenantQuota") or {}
        max_bytes = quota.get("maxBytes")
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace", ""),
            base_model=spec["baseModel"],
            worker_selector=selector,
            model_uri=spec.get("modelURI", ""),
            worker_port=int(spec.get("workerPort", 8000)),
            stager_port=int(spec.get("stagerPort", DEFAULT_STAGER_PORT)),
            gpu_bytes=parse_quantity(memory.get("gpuBytes", 0), "spec.adapterMemory.gpuBytes"),
            cpu_bytes=parse_quantity(memory.get("cpuBytes", 0), "spec.adapterMemory.cpuBytes"),
            eviction=spec.get("eviction", "lru"),
            max_adapters_per_tenant=quota.get("maxAdapters"),
            max_bytes_per_tenant=None if max_bytes is None else parse_quantity(max_bytes, "spec.tenantQuota.maxBytes"),
            generation=int(meta.get("generation", 0)),
            status=dict(body.get("status") or {}),
        )


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
    known_bytes: int = 0  # last size a worker reported (status.bytes): quota counts it once known
    status: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> AdapterSpec:
        meta, spec = body.get("metadata", {}), body.get("spec") or {}
        for key in ("pool", "tenant", "baseModel", "version"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise SpecError(f"spec.{key}: required")
        warm = spec.get("warm", 0)
        if not (warm == "all" or (isinstance(warm, int) and not isinstance(warm, bool) and warm >= 0)):
            raise SpecError(f"spec.warm: {warm!r} must be a count >= 0 or 'all'")
        canary = None
        if spec.get("canary"):
            c = spec["canary"]
            weight = c.get("weight", 0)
            if not isinstance(weight, int) or not 0 <= weight <= 100:
                raise SpecError(f"spec.canary.weight: {weight!r} must be an integer percentage 0-100")
            if not isinstance(c.get("version"), str) or not c["version"]:
                raise SpecError("spec.canary.version: required when spec.canary is set")
            source = Source.parse(c["source"], "spec.canary.source") if c.get("source") else None
            canary = Canary(c["version"], source, weight)
        status = body.get("status") or {}
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
            pinned=bool(spec.get("pinned", False)),
            priority=int(spec.get("priority", 0)),
            generation=int(meta.get("generation", 0)),
            created=str(meta.get("creationTimestamp", "")),
            deleting=bool(meta.get("deletionTimestamp")),
            known_bytes=int(status.get("bytes", 0) or 0),
            status=dict(status),
        )
