"""A pool's `spec.tenantSources`: where each tenant's adapter files may come from.

The stagers' allow-lists (--s3-allow, --local-roots) say which locations a pool's workers may read at
all; they know nothing of tenants. Without more, the author of a LoRAAdapter may name any allowed
location under any `spec.tenant`, so another tenant's adapter files could be served as their own.
`spec.tenantSources` closes that: folder prefixes whose segments are literals or exactly one of
`{tenant}` (the adapter's spec.tenant) and `{namespace}` (its namespace), e.g.
`s3://adapters/tenants/{tenant}/`. When it is set, an adapter's source and its canary's must lie under
one of them with the placeholders bound to its own tenant and namespace, and under none bound to
another's (entries may overlap: with `s3://a/{tenant}/` and `s3://a/legacy/{tenant}/`, tenant
`legacy` may not name `s3://a/legacy/b/`, which is tenant b's); otherwise its spec is refused naming
the field (its last valid spec stays in force only if it passes too).

URIs are compared segment by segment as the stager normalises them before fetching ('..' and
relative paths refused, '.' and empty segments dropped: worker/sources.py), so `tenants/ab/` is not
under `tenants/a/` and `tenants/a//x/` is. A local path is compared as written; a symlink under one
tenant's folder into another's is refused by the stager: a local version's directive lists its tenant's
folders (`own_folders`) and the regions of them where other tenants' folders lie too (`foreign_regions`),
and the folder and its files must resolve inside its tenant's folders and, inside such a region, inside an
own folder below it (worker/tenant_folders.py).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from lorafleet.worker.sources import SourceError, local_uri_path, parse_s3

if TYPE_CHECKING:
    from lorafleet.operator.crd_models import AdapterSpec, PoolSpec

PLACEHOLDERS = ("{tenant}", "{namespace}")
# The CRD's pattern and rule (crds/lorafleet.dev_lorapools.yaml): whole-segment placeholders, no '..'.
_SEGMENT = r"([^/{}\x00-\x1f\x7f-\xa0]+|\{tenant\}|\{namespace\})"
PREFIX_RE = re.compile(rf"(s3://{_SEGMENT}/|file:///|/)({_SEGMENT}/)*")
_PARENT = re.compile(r"(^|/)[.][.](/|$)")


def parse_tenant_sources(value: Any) -> tuple[str, ...]:
    """spec.tenantSources as a tuple (empty when absent); a SpecError naming the entry the CRD refuses
    too: not a folder of s3://bucket/..., file:///... or /..., a placeholder that is not a whole
    segment, an empty or '..' segment, a control character."""
    from lorafleet.operator.crd_models import SpecError  # it imports this module (at its top)

    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"spec.tenantSources: {value!r} must be a list of URI prefixes")
    for i, prefix in enumerate(value):
        if not PREFIX_RE.fullmatch(prefix) or _PARENT.search(prefix):
            raise SpecError(f"spec.tenantSources[{i}]: {prefix!r} must be a folder (ending with '/') of "
                            f"s3://bucket/, file:/// or /, each segment a name or exactly one of "
                            f"{' and '.join(PLACEHOLDERS)}, none of them empty or '..'")
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


def _bindings(pattern: tuple[str, ...], parts: tuple[str, ...]) -> dict[str, str] | None:
    """The placeholders' values when `parts` lies under `pattern` (segment by segment), else None."""
    if len(parts) < len(pattern):
        return None
    bound: dict[str, str] = {}
    for want, got in zip(pattern, parts, strict=False):
        if want in PLACEHOLDERS:
            if bound.setdefault(want, got) != got:
                return None
        elif want != got:
            return None
    return bound


def source_problem(pool: PoolSpec, adapter: AdapterSpec) -> str | None:
    """Why an adapter's source or canary source lies outside its tenant's folders, or also inside another
    tenant's (naming the field), or None; always None for a pool without tenantSources."""
    if not pool.tenant_sources:
        return None
    patterns = []
    for prefix in pool.tenant_sources:
        try:
            patterns.append((prefix, _segments(prefix)))
        except SourceError:  # no folder the stager would fetch: it matches nothing
            continue
    own = {"{tenant}": adapter.tenant, "{namespace}": adapter.namespace}
    sources = [("spec.source", adapter.source)]
    if adapter.canary is not None and adapter.canary.source is not None:
        sources.append(("spec.canary.source", adapter.canary.source))
    for field_name, source in sources:
        try:
            parts = _segments(source.uri)
        except SourceError as exc:
            return f"{field_name}.uri: {exc}"
        matches = [(prefix, b) for prefix, pattern in patterns if (b := _bindings(pattern, parts)) is not None]
        other = next(((p, b) for p, b in matches if any(own[k] != v for k, v in b.items())), None)
        if other is not None:
            whose = ", ".join(f"{k.strip('{}')} {v!r}" for k, v in other[1].items())
            return (f"{field_name}.uri: {source.uri!r} lies under LoRAPool {pool.name!r} spec.tenantSources "
                    f"entry {other[0]!r} for {whose}, not tenant {adapter.tenant!r} in namespace "
                    f"{adapter.namespace!r}; an adapter's files come from its own tenant's folders")
        if not matches:
            mine = [p.replace("{tenant}", adapter.tenant).replace("{namespace}", adapter.namespace)
                    for p in pool.tenant_sources]
            return (f"{field_name}.uri: {source.uri!r} is not under LoRAPool {pool.name!r} spec.tenantSources "
                    f"for tenant {adapter.tenant!r} in namespace {adapter.namespace!r} ({', '.join(mine)}); "
                    f"an adapter's files come from its own tenant's folders")
    return None


def own_folders(pool: PoolSpec | None, adapter: AdapterSpec, uri: str) -> tuple[str, ...]:
    """For a local source of `adapter` in a pool with tenantSources: the local entries it lies under with
    the placeholders bound to its own tenant and namespace, filled in (the folders the stager requires the
    resolved folder and its files to lie in: VersionRef.within). Empty for S3 sources and other pools."""
    if pool is None or not pool.tenant_sources or uri.startswith("s3://"):
        return ()
    own = {"{tenant}": adapter.tenant, "{namespace}": adapter.namespace}
    try:
        parts = _segments(uri)
    except SourceError:
        return ()
    folders = []
    for prefix in pool.tenant_sources:
        try:
            pattern = _segments(prefix)
        except SourceError:
            continue
        bound = _bindings(pattern, parts) if pattern[0] == "file" else None
        if bound is not None and all(own[k] == v for k, v in bound.items()):
            folders.append(prefix.replace("{tenant}", adapter.tenant).replace("{namespace}", adapter.namespace))
    return tuple(folders)


def foreign_regions(pool: PoolSpec | None, within: tuple[str, ...]) -> tuple[str, ...]:
    """The fixed part (the segments before the first placeholder, as written) of each local tenantSources
    entry that lies at or under one of `within` (`own_folders`'): a region of the tenant's own folders where
    other tenants' folders lie too (VersionRef.without). With `/a/{tenant}/` and `/a/legacy/{tenant}/`,
    tenant legacy's `/a/legacy/` holds tenant b's `/a/legacy/b/`. An entry without placeholders is
    everyone's folder, and the fixed part of an entry that filled in gives an own folder lies above it."""
    if pool is None or not within:
        return ()
    own = [_segments(w) for w in within]
    regions = []
    for prefix in pool.tenant_sources:
        cut = min((i for i in (prefix.find(p) for p in PLACEHOLDERS) if i >= 0), default=-1)
        if cut < 0 or prefix.startswith("s3://"):
            continue
        try:
            fixed = _segments(prefix[:cut])
        except SourceError:
            continue
        if any(fixed[:len(o)] == o for o in own if len(fixed) >= len(o)):
            regions.append(prefix[:cut])
    return tuple(dict.fromkeys(regions))
