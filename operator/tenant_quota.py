"""A pool's tenant quota (spec.tenantQuota) over the adapter specs in force (admission.admit), and the sizes it
counts that an adapter's status remembers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter, PoolSpec
from lorafleet.operator.placement import canary_bytes, reported_bytes
from lorafleet.operator.reports import WorkerIndex
from lorafleet.worker.directives import AdapterState


class SizeWait(str):
    """A quota refusal that is a wait (phase Pending): under a byte quota a tenant's versions of unknown size are
    staged one at a time, as each is sized only once a worker listed its objects."""


def over_quota(pool: PoolSpec | None, adapters: list[AdapterSpec], workers: Sequence[WorkerIndex] = ()
               ) -> dict[str, str]:
    """Tenant quota over the specs in force: adapter name -> message naming spec.tenant. A spec's bytes are
    its stable version's and its canary's, as workers report them (a download in progress counts its size).

    Under ``maxBytes`` a version no worker has sized yet counts 0, so one such spec of a tenant is admitted at a
    time (the one its workers are already staging, else the first in order): the others wait for its size
    (a SizeWait), as each admitted version is downloaded by every worker of the pool, then refused if over.
    A spec whose unknown version failed on every worker that reports it does not hold the others up."""
    if pool is None:
        return {}
    failures: dict[str, str] = {}
    by_tenant: dict[str, list[AdapterSpec]] = defaultdict(list)
    for a in adapters:
        by_tenant[a.tenant].append(a)
    for tenant, group in by_tenant.items():
        # First come, first served within a priority: an adapter in force in this tenant (`_in_force`) before any
        # newcomer, then by creation: a newcomer never evicts an admitted adapter, not even one created before
        # it and moved in since (spec.tenant or spec.pool edited), which is refused and keeps its last valid spec.
        group.sort(key=lambda a: (-a.priority, not _in_force(a, workers), a.created, a.name))
        sized = {a.name: _quota_bytes(a, workers) for a in group}
        failed = {a.name for a in group if sized[a.name][1] and _failed(a, sized[a.name][1], workers)}
        # The spec sized now: the first the checks admit among those its workers stage already, else among all.
        staging = {a.name for a in group if a.name not in failed and sized[a.name][1]
                   and any(s.error is None for s in _said(a, sized[a.name][1], workers))}
        refused, sizing, waiting = _tenant_admission(pool, tenant, group, sized, failed, staging)
        if sizing is None and waiting:
            refused, sizing, waiting = _tenant_admission(pool, tenant, group, sized, failed, set(sized))
        failures |= refused
        for name in waiting:
            failures[name] = SizeWait(
                f"spec.tenant: waiting: tenant {tenant!r} has a byte quota (LoRAPool {pool.name!r} "
                f"spec.tenantQuota.maxBytes), and its versions of unknown size are staged one at a time; "
                f"{sizing!r} is being sized first")
    return failures


def _in_force(a: AdapterSpec, workers: Sequence[WorkerIndex]) -> bool:
    """Whether ``a`` is admitted in its tenant and pool already: its last valid spec is of both, or a worker was
    last told to serve it for this tenant (a spec admitted before its status was written)."""
    if a.last_valid is not None and (a.last_valid.tenant, a.last_valid.pool) == (a.tenant, a.pool):
        return True
    return any(d.tenant == a.tenant for w in workers if (d := w.pushed.get(a.name)) is not None)


def _tenant_admission(pool: PoolSpec, tenant: str, group: list[AdapterSpec], sized: dict[str, tuple[int, set[str]]],
                      failed: set[str], may_size: set[str]) -> tuple[dict[str, str], str | None, list[str]]:
    """(refusals, the spec being sized, the specs waiting for it) of one tenant's specs in quota order. A
    waiting spec takes a maxAdapters slot (it is served once sized, before newer specs) but no bytes."""
    refused: dict[str, str] = {}
    sizing, waiting = None, []
    num_admitted = total = 0  # a refused adapter takes neither a slot nor bytes of the quota
    for a in group:
        size, unknown = sized[a.name]
        if pool.max_adapters_per_tenant is not None and num_admitted >= pool.max_adapters_per_tenant:
            refused[a.name] = (f"spec.tenant: tenant {tenant!r} is over LoRAPool {pool.name!r} "
                               f"spec.tenantQuota.maxAdapters ({pool.max_adapters_per_tenant}); delete "
                               f"one of its adapters or raise the quota")
            continue
        if pool.max_bytes_per_tenant is not None and total + size > pool.max_bytes_per_tenant:
            what = "with this adapter and its canary" if a.canary is not None else "with this adapter"
            refused[a.name] = (f"spec.tenant: tenant {tenant!r} is over LoRAPool {pool.name!r} "
                               f"spec.tenantQuota.maxBytes ({pool.max_bytes_per_tenant} bytes; "
                               f"{total + size} {what})")
            continue
        num_admitted += 1
        if pool.max_bytes_per_tenant is not None and unknown and a.name not in failed:
            if sizing is not None or a.name not in may_size:
                waiting.append(a.name)
                continue
            sizing = a.name
        total += size
    return refused, sizing, waiting


def _quota_bytes(a: AdapterSpec, workers: Sequence[WorkerIndex]) -> tuple[int, set[str]]:
    """(bytes the quota counts for ``a``: its stable version's and its canary's sizes as known, a download in
    progress included; the versions whose size is not known yet)."""
    stable = max(a.known_bytes, reported_bytes(a, list(workers), staging=True))
    canary = canary_bytes(a, list(workers), staging=True)
    unknown = {a.version} if stable == 0 else set()
    if a.canary is not None and canary == 0:
        unknown.add(a.canary.version)
    return stable + canary, unknown


def _said(a: AdapterSpec, versions: set[str], workers: Sequence[WorkerIndex]) -> list[AdapterState]:
    return [s for w in workers for s in w.by_name.get(a.name, ()) if s.version in versions]


def _failed(a: AdapterSpec, versions: set[str], workers: Sequence[WorkerIndex]) -> bool:
    """Whether the workers that report ``versions`` of ``a`` all report their error (a download that failed
    costs no room; it is tried again with a backoff)."""
    said = _said(a, versions, workers)
    return bool(said) and all(s.error is not None and not s.staging for s in said)


def size_settled(pool: PoolSpec | None, a: AdapterSpec, live: list[WorkerIndex]) -> bool:
    """Whether ``a``, admitted, may become the last valid spec: under a tenant byte quota only once its version's
    size is known (a worker staged it). Admitted before that (counted as 0), an edit that grew past the quota
    must still fall back to the spec before it, not find itself as the last valid one."""
    if pool is None or pool.max_bytes_per_tenant is None or a.last_valid is None or a.last_valid.version == a.version:
        return True
    return max(a.known_bytes, reported_bytes(a, live, staging=True)) > 0


def refused_size(x: AdapterSpec | InvalidAdapter, status: dict[str, Any], live: list[WorkerIndex]) -> dict[str, Any]:
    """The status of a refused spec with the size workers report for its version (status.refusedBytes; kept
    while none does): once they dropped a version over the tenant's byte quota, its size keeps it out until
    the spec (its version) or the quota changes, rather than it being admitted and downloaded again."""
    if isinstance(x, AdapterSpec) and (size := reported_bytes(x, live, staging=True)):
        status["refusedBytes"] = {"version": x.version, "bytes": size}
    return status
