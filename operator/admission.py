"""Admission: which spec of each of a pool's adapters is in force, and why a current spec is refused.

Stated, tested:
  * an adapter is served with its current spec when that spec parses and passes the checks the API
    server cannot do (baseModel, canary, tenant quota); the accepted spec is remembered in
    ``status.lastValidSpec``;
  * a refused *edit* never takes down what is serving: while the current spec does not parse or fails a
    per-adapter check or the tenant quota (phase Failed, the message names the field) the last valid
    spec stays in force, unchanged on the workers, as long as it is for this pool and still passes.
    Tenant quota counts the specs in force, a canary's bytes with its stable version's (the stable's size
    until a worker reports the canary's). A spec over the byte quota only with its canary is served
    without it. An unchanged spec that stops passing (the pool's baseModel or quota changed) is not served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter, PoolSpec
from lorafleet.operator.reports import WorkerIndex
from lorafleet.operator.rollback import with_rollback
from lorafleet.operator.tenant_quota import over_quota
from lorafleet.operator.tenant_sources import source_problem


def admit(pool: PoolSpec | None, adapters: Sequence[AdapterSpec | InvalidAdapter], *,
          pool_error: str | None = None, workers: Sequence[WorkerIndex] = ()
          ) -> tuple[dict[str, AdapterSpec], dict[str, str]]:
    """(name -> the spec in force, name -> why its current spec is refused, naming the field).

    A name in both is served with its last valid spec while the current one is refused, or, when only its canary
    is refused, with its stable version alone; a spec over the tenant's byte quota only with its canary is served
    without the canary. ``workers``: their reports give the sizes the byte quota counts (placement.spec_bytes)."""
    served: dict[str, AdapterSpec] = {}
    failures: dict[str, str] = {}
    for x in adapters:
        problem = x.error if isinstance(x, InvalidAdapter) else check_adapter(pool, x, pool_error=pool_error)
        if problem is None:
            served[x.name] = x
            continue
        failures[x.name] = problem
        held = fallback(pool, x) or _without_canary(pool, x, pool_error)
        if held is not None:
            served[x.name] = held
    # A spec over the quota steps down until it fits: an edit (moved to a full tenant, grown) to its last valid
    # spec, like after any refused edit; a spec with a canary (its size known once a worker staged it) to its
    # stable version alone; else it is not served. Each name steps down at most three times.
    while refused := over_quota(pool, list(served.values()), workers):
        for name, msg in refused.items():
            failures.setdefault(name, msg)
            a = served.pop(name)
            lighter = fallback(pool, a) or (dataclasses.replace(a, canary=None) if a.canary is not None else None)
            if lighter is not None:
                served[name] = lighter
    return served, failures


def fallback(pool: PoolSpec | None, x: AdapterSpec | InvalidAdapter) -> AdapterSpec | None:
    """The last valid spec of an adapter whose current spec is refused, when that is an edit (not the
    spec already in force) and the held spec is for this pool and still passes the per-adapter checks."""
    held = x.last_valid
    changed = isinstance(x, InvalidAdapter) or (held is not None and held.raw_spec != x.raw_spec)
    if held is not None and changed and pool is not None and held.pool == pool.name and check_adapter(pool, held) is None:
        # A canary stopped in the edit stops (rollback.py); the held spec stays its own last valid one, so that
        # quota order counts it in force also where no push of it is remembered (an operator restart).
        return dataclasses.replace(with_rollback(held, x), last_valid=held)
    return None


def _without_canary(pool: PoolSpec | None, x: AdapterSpec | InvalidAdapter, pool_error: str | None) -> AdapterSpec | None:
    """The stable version alone when only the canary is refused (its source outside the tenant's folders): the
    stable version keeps serving, also for a new adapter or after a pool's tenantSources changed."""
    bare = None if isinstance(x, InvalidAdapter) or x.canary is None else dataclasses.replace(x, canary=None)
    return bare if bare is not None and check_adapter(pool, bare, pool_error=pool_error) is None else None


def check_adapter(pool: PoolSpec | None, a: AdapterSpec, *, pool_error: str | None = None) -> str | None:
    """The checks the API server cannot do (or an older CRD did not): a message naming the field, or None."""
    if pool is None and pool_error:
        return f"spec.pool: LoRAPool {a.pool!r} has an invalid spec ({pool_error})"
    if pool is None:
        return (f"spec.pool: LoRAPool {a.pool!r} does not exist in namespace {a.namespace!r} "
                f"(deleted?); no worker serves this adapter until the pool exists again")
    if a.base_model != pool.base_model:
        return (f"spec.baseModel: {a.base_model!r} does not match LoRAPool {pool.name!r} "
                f"spec.baseModel {pool.base_model!r}; an adapter only works on its own base")
    if a.name == pool.base_model:
        return (f"metadata.name: {a.name!r} is LoRAPool {pool.name!r} spec.baseModel, the name requests for the base "
                f"model use: none would reach this adapter; give the adapter another name")
    if a.canary is not None and a.canary.source is None:
        return "spec.canary.source: required when spec.canary is set (where the canary version lives)"
    if a.canary is not None and a.canary.version == a.version:
        return (f"spec.canary.version: equals spec.version {a.version!r}; to promote, set "
                f"spec.version/source to the canary's and remove spec.canary")
    return source_problem(pool, a)
