"""A pool's tenant quota (spec.tenantQuota) over the adapter specs in force (reconcile.admit)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec
from lorafleet.operator.placement import spec_bytes
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
