"""Pure reconcile: (pool, its adapters, workers' reported states) -> directives per worker + statuses.

No I/O and no clock: handlers gather the inputs, call ``reconcile_pool`` and act on the ``PoolPlan``.

Placement policy (stated, tested):
  * every admitted adapter is *registered* on every ready worker, so any worker can serve it on demand;
  * ``warm: N`` (``all`` = every worker) keeps it GPU-resident on N workers; ``pinned`` with ``warm: 0``
    still keeps one resident copy (a pinned adapter that lives nowhere pins nothing);
  * adapters are placed pinned first, then by priority, then largest first (better bin packing);
  * a worker that already holds it (reported GPU tier, or placed there by the last push) keeps it, so
    a reconcile never shuffles healthy placements; the rest go to the workers with the fewest
    assigned GPU bytes (ties by pod name), skipping a worker whose pool would overflow (its reported
    pool size, else the pool's spec.adapterMemory.gpuBytes); an adapter that fits on fewer workers than
    asked is Degraded with a message naming spec.warm.

Statuses come only from what workers report: an adapter is Ready when every worker that should hold
it GPU-resident reports its stable version at tier ``gpu`` without error, and every ready worker has
it registered; never because a directive was sent.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec
from lorafleet.worker.directives import (
    AdapterDirective,
    AdapterState,
    DesiredState,
    ReportedState,
    VersionRef,
)

UNKNOWN_BYTES = 1  # an adapter no worker has reported yet still counts, so placement spreads it


@dataclass(slots=True)
class WorkerReport:
    """One ready worker pod as seen this round."""

    pod: str
    reported: ReportedState | None  # None: its sidecar did not answer this round
    last_pushed: DesiredState | None = None  # operator memory; None after an operator restart


@dataclass(slots=True)
class PoolPlan:
    desired: dict[str, DesiredState] = field(default_factory=dict)  # pod -> full desired state
    pushes: dict[str, DesiredState] = field(default_factory=dict)  # pod -> what to push now
    placement: dict[str, list[str]] = field(default_factory=dict)  # adapter -> pods keeping it warm
    adapter_statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    unloading: dict[str, list[str]] = field(default_factory=dict)  # deleting adapter -> pods still holding it
    pool_status: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Index:
    """One live worker's report and last push, indexed once per pass (lookups stay O(1) per adapter)."""

    w: WorkerReport
    by_name: dict[str, list[AdapterState]]
    pushed: dict[str, AdapterDirective]

    @classmethod
    def of(cls, w: WorkerReport) -> _Index:
        by_name: dict[str, list[AdapterState]] = defaultdict(list)
        for st in w.reported.adapters:
            by_name[st.name].append(st)
        return cls(w, dict(by_name), w.last_pushed.by_name() if w.last_pushed else {})

    @property
    def pod(self) -> str:
        return self.w.pod

    def find(self, name: str, version: str) -> AdapterState | None:
        return next((st for st in self.by_name.get(name, ()) if st.version == version), None)


def reconcile_pool(pool: PoolSpec | None, adapters: list[AdapterSpec], workers: list[WorkerReport], *,
                   now: str, pool_name: str = "", generation_floor: int = 0,
                   pool_error: str | None = None, shared_pods: dict[str, str] | None = None) -> PoolPlan:
    """``now``: RFC 3339 time for condition transitions; ``generation_floor``: see ``_next_generation``;
    ``shared_pods``: pods this pool's selector matches but another pool owns (pod -> owner), left out."""
    plan = PoolPlan()
    live = [_Index.of(w) for w in workers if w.reported is not None]
    failures = validate_adapters(pool, adapters, pool_name=pool_name, pool_error=pool_error)
    admitted = [a for a in adapters if not a.deleting and a.name not in failures]
    deleting = [a for a in adapters if a.deleting]

    for a in deleting:
        plan.unloading[a.name] = [x.pod for x in live if x.by_name.get(a.name)]
    if pool is None:
        for a in adapters:
            if not a.deleting:
                plan.adapter_statuses[a.name] = _status(a, "Degraded", failures[a.name], now=now, validated=False)
        return plan

    plan.placement = place_warm(admitted, live, default_capacity=pool.gpu_bytes)
    warm_sets = {name: set(pods) for name, pods in plan.placement.items()}
    admitted.sort(key=lambda a: a.name)
    # Two variants per adapter, shared by every worker's desired state (read-only from here on).
    variants = {a.name: (_directive(a, pod_warm=False), _directive(a, pod_warm=True)) for a in admitted}
    for w in live:
        directives = [variants[a.name][w.pod in warm_sets[a.name]] for a in admitted]
        generation, push = _next_generation(w, directives, generation_floor)
        desired = DesiredState(generation, directives)
        plan.desired[w.pod] = desired
        if push:
            plan.pushes[w.pod] = desired

    for a in adapters:
        if a.deleting:
            continue
        if a.name in failures:
            plan.adapter_statuses[a.name] = _status(a, "Failed", failures[a.name], now=now, validated=False)
        else:
            plan.adapter_statuses[a.name] = adapter_status(a, live, plan.placement[a.name], now=now,
                                                           requested=warm_count(a, len(live)))
    plan.pool_status = _pool_status(pool, admitted, workers, now=now, shared_pods=shared_pods or {})
    return plan


def validate_adapters(pool: PoolSpec | None, adapters: list[AdapterSpec], *, pool_name: str = "",
                      pool_error: str | None = None) -> dict[str, str]:
    """Checks the API server cannot do. Returns adapter name -> message naming the field."""
    failures: dict[str, str] = {}
    for a in adapters:
        if a.deleting:
            continue
        if pool is None and pool_error:
            failures[a.name] = f"spec.pool: LoRAPool {a.pool!r} has an invalid spec ({pool_error})"
        elif pool is None:
            failures[a.name] = (f"spec.pool: LoRAPool {a.pool!r} does not exist in namespace {a.namespace!r} "
                                f"(deleted?); no worker serves this adapter until the pool exists again")
        elif a.base_model != pool.base_model:
            failures[a.name] = (f"spec.baseModel: {a.base_model!r} does not match LoRAPool {pool.name!r} "
                                f"spec.baseModel {pool.base_model!r}; an adapter only works on its own base")
        elif a.canary is not None and a.canary.source is None:
            failures[a.name] = "spec.canary.source: required when spec.canary is set (where the canary version lives)"
        elif a.canary is not None and a.canary.version == a.version:
            failures[a.name] = (f"spec.canary.version: equals spec.version {a.version!r}; to promote, set "
                                f"spec.version/source to the canary's and remove spec.canary")
    if pool is None:
        return failures
    by_tenant: dict[str, list[AdapterSpec]] = defaultdict(list)
    for a in adapters:
        if not a.deleting and a.name not in failures:
            by_tenant[a.tenant].append(a)
    for tenant, group in by_tenant.items():
        # First come, first served within a priority: a new adapter never evicts an admitted older one.
        group.sort(key=lambda a: (-a.priority, a.created, a.name))
        total = 0
        for i, a in enumerate(group):
            total += a.known_bytes
            if pool.max_adapters_per_tenant is not None and i >= pool.max_adapters_per_tenant:
                failures[a.name] = (f"spec.tenant: tenant {tenant!r} is over LoRAPool {pool.name!r} "
                                    f"spec.tenantQuota.maxAdapters ({pool.max_adapters_per_tenant}); delete "
                                    f"one of its adapters or raise the quota")
            elif pool.max_bytes_per_tenant is not None and total > pool.max_bytes_per_tenant:
                failures[a.name] = (f"spec.tenant: tenant {tenant!r} is over LoRAPool {pool.name!r} "
                                    f"spec.tenantQuota.maxBytes ({pool.max_bytes_per_tenant} bytes; "
                                    f"{total} with this adapter)")
                total -= a.known_bytes
    return failures


def warm_count(a: AdapterSpec, num_workers: int) -> int:
    n = num_workers if a.warm == "all" else min(int(a.warm), num_workers)
    return max(n, 1 if a.pinned and num_workers else 0)


def adapter_bytes(a: AdapterSpec, workers: list[_Index]) -> int:
    reported = [s.bytes for x in workers for s in x.by_name.get(a.name, ()) if s.version == a.version]
    return max([a.known_bytes, *reported]) or UNKNOWN_BYTES


def place_warm(adapters: list[AdapterSpec], workers: list[_Index], *, default_capacity: int = 0
               ) -> dict[str, list[str]]:
    """adapter name -> pods that keep it GPU-resident (see the module docstring for the policy)."""
    load = {w.pod: 0 for w in workers}
    # A worker's own report of its adapter pool size wins; else the pool's spec.adapterMemory.gpuBytes.
    capacity = {w.pod: w.w.reported.pool_bytes or default_capacity or None for w in workers}
    sizes = {a.name: adapter_bytes(a, workers) for a in adapters}
    order = sorted(adapters, key=lambda a: (not a.pinned, -a.priority, -sizes[a.name], a.name))
    placement: dict[str, list[str]] = {}
    for a in order:
        size, n = sizes[a.name], warm_count(a, len(workers))
        if n == 0:
            placement[a.name] = []
            continue

        def holds(w: _Index, a: AdapterSpec = a) -> bool:
            st = w.find(a.name, a.version)
            pushed = w.pushed.get(a.name)
            return (st is not None and st.tier == "gpu") or (pushed is not None and pushed.warm)

        def fits(w: _Index, size: int = size) -> bool:
            return capacity[w.pod] is None or load[w.pod] + size <= capacity[w.pod]

        candidates = sorted((w for w in workers if fits(w)), key=lambda w: (not holds(w), load[w.pod], w.pod))
        chosen = [w.pod for w in candidates[:n]]
        for pod in chosen:
            load[pod] += size
        placement[a.name] = sorted(chosen)
    return placement


def _directive(a: AdapterSpec, *, pod_warm: bool) -> AdapterDirective:
    canary = None
    if a.canary is not None and a.canary.source is not None:
        canary = VersionRef(a.canary.version, a.canary.source.uri, a.canary.source.sha256)
    return AdapterDirective(
        name=a.name, tenant=a.tenant, stable=VersionRef(a.version, a.source.uri, a.source.sha256),
        canary=canary, canary_weight=a.canary.weight if canary else 0,
        warm=pod_warm, pinned=pod_warm and a.pinned, priority=a.priority,
    )


def _next_generation(x: _Index, directives: list[AdapterDirective], floor: int) -> tuple[int, bool]:
    """(generation, push now?). A new generation on a content change or drift, never below ``floor``.

    The caller passes a clock in milliseconds as ``floor``: a receiver may have accepted pushes this
    process no longer remembers (an operator restart, a push that timed out after it landed), and a
    generation from the clock is above all of them, so no push is refused as stale.
    """
    applied = x.w.reported.generation_applied
    last = x.w.last_pushed
    if last is None or last.adapters != directives:
        return max((last.generation if last else 0) + 1, applied + 1, floor), True
    if applied < last.generation or drifted(x, directives):
        # Reported below what was accepted: the engine (or the pod) restarted. Receivers treat an equal
        # generation as a no-op, so the re-push needs a new one.
        return max(last.generation + 1, applied + 1, floor), True
    return last.generation, False


def drifted(x: _Index, directives: list[AdapterDirective]) -> bool:
    """The worker claims the push applied yet lost what it was told to hold (restart) or keeps a removed one."""
    for d in directives:
        st = x.find(d.name, d.stable.version)
        if st is None or (d.warm and st.tier == "none" and st.error is None):
            return True
    wanted = {d.name for d in directives}
    return any(name not in wanted for name in x.by_name)


def adapter_status(a: AdapterSpec, live: list[_Index], warm_pods: list[str], *, now: str,
                   requested: int | None = None) -> dict[str, Any]:
    instances, errors = [], []
    versions_seen: set[str] = set()
    registered = resident = canary_registered = 0
    size = 0
    warm_set = set(warm_pods)
    for w in live:
        for st in w.by_name.get(a.name, ()):
            if st.error:
                errors.append(f"{w.pod}: {st.name}@{st.version}: {st.error}")
                continue
            versions_seen.add(st.version)
            if st.tier != "none":
                instances.append({"pod": w.pod, "version": st.version, "tier": st.tier})
            if st.version == a.version:
                registered += 1
                size = max(size, st.bytes)
                resident += w.pod in warm_set and st.tier == "gpu"
            elif a.canary is not None and st.version == a.canary.version:
                canary_registered += 1
    instances.sort(key=lambda i: (i["pod"], i["version"]))
    canary_version = a.canary.version if a.canary and canary_registered else None
    canary_active = canary_version is not None and canary_registered == len(live) and a.canary.weight > 0
    stable_seen = sorted(versions_seen - ({a.canary.version} if a.canary else set()))
    stable_version = a.version if a.version in versions_seen else (
        a.status.get("stableVersion") if a.status.get("stableVersion") in stable_seen else
        (stable_seen[0] if stable_seen else None))
    target = len(warm_pods)
    if not live:
        phase, msg = "Pending", f"no ready worker matches LoRAPool {a.pool!r} spec.workerSelector"
    elif errors:
        phase, msg = "Degraded", "; ".join(errors)
    elif requested is not None and target < requested:
        phase = "Degraded"
        msg = (f"spec.warm: {a.warm} asks for {requested} GPU-resident copies but only {target} workers have room "
               f"for its {adapter_size_text(a, live)} in their GPU adapter pool; it is served on demand elsewhere")
    elif registered == len(live) and resident == target and (a.canary is None or canary_registered == len(live)):
        phase = "Ready"
        msg = (f"{a.version} GPU-resident on {resident}/{target} warm workers, registered on {registered}"
               if target else f"{a.version} on demand (warm: 0), registered on {registered} workers")
        if canary_version:
            msg += f"; canary {canary_version} at {a.canary.weight}%"
    else:
        phase = "Loading"
        msg = (f"{a.version}: registered on {registered}/{len(live)} workers, GPU-resident on "
               f"{resident}/{target} warm workers")
        if a.canary is not None:
            msg += f"; canary {a.canary.version} registered on {canary_registered}/{len(live)}"
        worker_errors = [f"{w.pod}: {w.w.reported.error}" for w in live if w.w.reported.error]
        if worker_errors:  # e.g. the sidecar cannot reach its engine: say why it is not loading
            msg += "; " + "; ".join(worker_errors)
    status = _status(a, phase, msg, now=now, validated=True, canary_active=canary_active)
    status.update({
        "stableVersion": stable_version,
        "canaryVersion": canary_version,
        "canaryWeight": a.canary.weight if canary_version else 0,
        "instances": instances,
        "warmWorkers": warm_pods,
        "ready": f"{resident}/{target}" if target else f"{registered}/{len(live)}",
        "bytes": size or a.known_bytes,
    })
    return status


def adapter_size_text(a: AdapterSpec, live: list[_Index]) -> str:
    size = adapter_bytes(a, live)
    return f"{size / (1 << 20):.1f} MiB" if size > UNKNOWN_BYTES else "unknown size"


def _condition(old: dict[str, Any], ctype: str, ok: bool, reason: str, message: str, now: str) -> dict[str, Any]:
    prev = next((c for c in old.get("conditions") or [] if c.get("type") == ctype), None)
    status = "True" if ok else "False"
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get(
        "lastTransitionTime") else now
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def _status(a: AdapterSpec, phase: str, message: str, *, now: str, validated: bool,
            canary_active: bool = False) -> dict[str, Any]:
    return {
        "phase": phase,
        "message": message,
        "observedGeneration": a.generation,
        "conditions": [
            _condition(a.status, "Ready", phase == "Ready", phase, message, now),
            _condition(a.status, "Validated", validated, "Valid" if validated else "Invalid",
                       "spec accepted" if validated else message, now),
            _condition(a.status, "CanaryActive", canary_active, "CanaryServing" if canary_active else "NoCanary",
                       f"canary {a.canary.version} at {a.canary.weight}%" if canary_active and a.canary else
                       "no canary is being served", now),
        ],
        **({} if validated else {"instances": [], "ready": "0/0"}),
    }


def _pool_status(pool: PoolSpec, admitted: list[AdapterSpec], workers: list[WorkerReport], *,
                 now: str, shared_pods: dict[str, str]) -> dict[str, Any]:
    live = [w for w in workers if w.reported is not None]
    kv = [w.reported.kv_usage for w in live]
    errors = [f"{w.pod}: {w.reported.error}" for w in live if w.reported.error]
    silent = [w.pod for w in workers if w.reported is None]
    msg = f"{len(live)} ready workers"
    if silent:
        msg += f"; no answer from the sidecar of {', '.join(silent)}"
    if errors:
        msg += "; " + "; ".join(errors)
    if shared_pods:  # two pools pushing whole adapter sets to one pod would undo each other
        msg += "; spec.workerSelector also matches " + ", ".join(
            f"{pod} (owned by LoRAPool {owner!r})" for pod, owner in sorted(shared_pods.items()))
    return {
        "readyWorkers": len(live),
        "adapters": len(admitted),
        "kvUsage": round(sum(kv) / len(kv), 4) if kv else 0.0,
        "observedGeneration": pool.generation,
        "conditions": [_condition(pool.status, "Ready", bool(live) and not errors and not shared_pods,
                                  "Workers" if live else "NoWorkers", msg, now)],
    }
