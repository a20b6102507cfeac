"""A pool's `spec.tenantSources`: where each tenant's adapter files may come from.

The stagers' allow-lists (--s3-allow, --local-roots) say which locations a pool's workers may read at
all; they know nothing of tenants. Without more, the author of a LoRAAdapter may name any allowed
location under any `spec.tenant`, so another tenant's adapter files could be served as their own.
`spec.tenantSources` closes that: URI prefixes holding `{tenant}` (the adapter's spec.tenant) and
`{namespace}` (its namespace), e.g. `s3://adapters/tenants/{tenant}/`. When it is set, an adapter's
source and its canary's must lie under one of them, expanded for that adapter; otherwise its spec
is refused naming the field (its last valid spec stays in force only if it passes too).

Matching is by whole segments of the URI normalised as the stager normalises it before fetching
('..' and relative paths refused, '.' and empty segments dropped: worker/sources.py), so
`tenants/ab/` is not under `tenants/a/` and `tenants/a//x/` is. A local path is compared as written: the stager resolves symlinks against its
roots only, so a link under one tenant's folder into another's is for the roots' owner to avoid.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from lorafleet.worker.sources import SourceError, local_uri_path, parse_s3

if TYPE_CHECKING:
    from lorafleet.operator.crd_models import AdapterSpec, PoolSpec

PLACEHOLDERS = ("{tenant}", "{namespace}")
_BRACES = re.compile(r"\{[^{}]*\}|[{}]")


def parse_tenant_sources(value: Any) -> tuple[str, ...]:
    """spec.tenantSources as a tuple (empty when absent); a SpecError naming the entry that is not a
    folder prefix of s3://bucket/..., file:///... or /..., or that holds braces other than the two
    placeholders."""
    from lorafleet.operator.crd_models import SpecError  # it imports this module (at its top)

    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"spec.tenantSources: {value!r} must be a list of URI prefixes")
    for i, prefix in enumerate(value):
        name = f"spec.tenantSources[{i}]"
        if not prefix.isprintable():
            raise SpecError(f"{name}: {prefix!r} must hold no control or invisible characters")
        unknown = [m for m in _BRACES.findall(prefix) if m not in PLACEHOLDERS]
        if unknown:
            raise SpecError(f"{name}: {prefix!r} holds {unknown[0]!r}; the placeholders are {' and '.join(PLACEHOLDERS)}")
        if not prefix.endswith("/"):
            raise SpecError(f"{name}: {prefix!r} must end with '/' (a folder: the prefix of tenant 'a' would "
                            f"otherwise hold tenant 'ab''s names)")
        try:
            _segments(prefix.replace("{tenant}", "t").replace("{namespace}", "n"))
        except SourceError as exc:
            raise SpecError(f"{name}: {exc}") from None
    return tuple(value)


def _segments(uri: str) -> tuple[str, ...]:
    """The normalised segments of a source URI, its scheme and bucket first; SourceError where the
    stager would refuse it."""
    if uri.startswith("s3://"):
        loc = parse_s3(uri)
        return ("s3", loc.bucket, *(p for p in loc.prefix.split("/") if p))
    if not uri.startswith(("/", "file:///")):
        raise SourceError(f"{uri!r} must be s3://bucket/prefix/, file:///path or /path")
    return ("file", *PurePosixPath(local_uri_path(uri)).parts[1:])


def expand(pool: PoolSpec, adapter: AdapterSpec) -> list[str]:
    """The pool's tenantSources for this adapter's tenant and namespace."""
    return [p.replace("{tenant}", adapter.tenant).replace("{namespace}", adapter.namespace)
            for p in pool.tenant_sources]


def source_problem(pool: PoolSpec, adapter: AdapterSpec) -> str | None:
    """Why an adapter's source or canary source lies outside its tenant's folders (naming the field), or
    None; always None for a pool without tenantSources."""
    if not pool.tenant_sources:
        return None
    allowed = []
    for prefix in expand(pool, adapter):
        try:
            allowed.append(_segments(prefix))
        except SourceError:  # the tenant's name makes no valid URI here (an S3 bucket takes no capitals)
            continue
    sources = [("spec.source", adapter.source)]
    if adapter.canary is not None and adapter.canary.source is not None:
        sources.append(("spec.canary.source", adapter.canary.source))
    for field_name, source in sources:
        try:
            parts = _segments(source.uri)
        except SourceError as exc:
            return f"{field_name}.uri: {exc}"
        if not any(parts[:len(a)] == a for a in allowed):
            return (f"{field_name}.uri: {source.uri!r} is not under LoRAPool {pool.name!r} spec.tenantSources "
                    f"for tenant {adapter.tenant!r} in namespace {adapter.namespace!r} "
                    f"({', '.join(expand(pool, adapter))}); an adapter's files come from its own tenant's folders")
    return None
