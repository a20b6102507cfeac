"""A pool's tenant quota (spec.tenantQuota) over the adapter specs in force (reconcile.admit), and the sizes it
counts that an adapter's status remembers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter, PoolSpec
from lorafleet.operator.placement import reported_bytes, spec_bytes
from lorafleet.operator.reports import WorkerIndex


def over_quota(pool: PoolSpec | None, adapters: list[AdapterSpec], workers: Sequence[WorkerIndex] = ()
               ) -> dict[str, str]:
    """Tenant quota over the specs in force: adapter name -> message naming spec.tenant. A spec's bytes are
    its stable version's and its canary's (placement.spec_bytes)."""
    if pool is None:
        return {}
    failures: dict[str, str] = {}
    by_tenant: dict[str, list[AdapterSpec]] = defaultdict(list)
    for a in adapters:
        by_tenant[a.tenant].append(a)
    for tenant, group in by_tenant.items():
        # First come, first served within a priority: a new adapter never evicts an admitted older one.
        group.sort(key=lambda a: (-a.priority, a.created, a.name))
        num_admitted = total = 0  # a refused adapter takes neither a slot nor bytes of the quota
        for a in group:
            size = spec_bytes(a, list(workers))
            if pool.max_adapters_per_tenant is not None and num_admitted >= pool.max_adapters_per_tenant:
                failures[a.name] = (f"spec.tenant: tenant {tenant!r} is over LoRAPool {pool.name!r} "
                                    f"spec.tenantQuota.maxAdapters ({pool.max_adapters_per_tenant}); delete "
                                    f"one of its adapters or raise the quota")
            elif pool.max_bytes_per_tenant is not None and total + size > pool.max_bytes_per_tenant:
                what = "with this adapter and its canary" if a.canary is not None else "with this adapter"
                failures[a.name] = (f"spec.tenant: tenant {tenant!r} is over LoRAPool {pool.name!r} "
                                    f"spec.tenantQuota.maxBytes ({pool.max_bytes_per_tenant} bytes; "
                                    f"{total + size} {what})")
            else:
                num_admitted += 1
                total += size
    return failures


def size_settled(pool: PoolSpec | None, a: AdapterSpec, live: list[WorkerIndex]) -> bool:
    """Whether ``a``, admitted, may become the last valid spec: under a tenant byte quota only once its version's
    size is known (a worker staged it). Admitted before that (counted as 0), an edit that grew past the quota
    must still fall back to the spec before it, not find itself as the last valid one."""
    if pool is None or pool.max_bytes_per_tenant is None or a.last_valid is None or a.last_valid.version == a.version:
        return True
    return max(a.known_bytes, reported_bytes(a, live)) > 0


def refused_size(x: AdapterSpec | InvalidAdapter, status: dict[str, Any], live: list[WorkerIndex]) -> dict[str, Any]:
    """The status of a refused spec with the size workers report for its version (status.refusedBytes; kept
    while none does): once they dropped a version over the tenant's byte quota, its size keeps it out until
    the spec (its version) or the quota changes, rather than it being admitted and downloaded again."""
    if isinstance(x, AdapterSpec) and (size := reported_bytes(x, live)):
        status["refusedBytes"] = {"version": x.version, "bytes": size}
    return status
