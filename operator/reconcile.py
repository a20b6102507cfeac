"""Pure reconcile: (pool, its adapters, workers' reported states) -> directives per worker + statuses.

No I/O and no clock: handlers gather the inputs, call ``reconcile_pool`` and act on the ``PoolPlan``.

Admission (which spec of each adapter is in force, and why one is refused): admission.py. One adapter's
directive is built inside its own error boundary: a bad one fails alone.

Placement policy (stated, tested; placement.py):
  * every admitted adapter is *registered* on every ready worker, so any worker can serve it on demand (and
    on a starting one, before it is ready: ``reconcile_pool``'s ``starting``);
  * ``warm: N`` (``all`` = every worker) keeps it GPU-resident on N workers; ``pinned`` with ``warm: 0``
    still keeps one resident copy (a pinned adapter that lives nowhere pins nothing);
  * adapters are placed pinned first, then by priority, then largest first (better bin packing);
  * a worker that already holds it (reported GPU tier, or placed there by the last push) keeps it, so
    a reconcile never shuffles healthy placements (nor those of a pod whose sidecar missed answers for under
    a minute: its last answer stands in, and it gets no new copy): within a rank (pinned, priority) the copies
    held are kept before any new copy is placed, so a newcomer displaces only adapters of a lower rank, and every held
    stable copy of a rank before any canary's slot, the canaries a worker has on the GPU first; the rest go to
    the least full workers (the larger of their shares of bytes and of slots taken, each where every worker
    says it; else the fewest bytes; ties by pod name),
    skipping a worker whose pool
    would overflow (the smaller of its reported pool size and the pool's spec.adapterMemory.gpuBytes; a warm copy
    counts its canary's bytes too) or whose GPU adapter slots would (its reported --max-loras; a warm
    copy with a canary takes two; where only the stable version of a warm one fits, the copy is kept for
    it alone and its canary, prefetched into free room only, loads on demand there; a pinned one pins its
    canary too, so it is placed whole or not at all); an adapter that fits on fewer workers than asked is Degraded with a
    message naming spec.warm (spec.pinned for a pinned one with warm: 0).

Pool settings: each push to a pool's worker carries the pool's ``spec.eviction`` and
``spec.adapterMemory.cpuBytes`` (left out when 0: the worker keeps its own CPU tier budget); a change of
either is a content change, pushed under a new generation like an adapter change.

Statuses come only from what workers report (statuses.py); never because a directive was sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lorafleet.operator.admission import admit, fallback
from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter, PoolSpec, Source
from lorafleet.operator.pinned_need import PinnedNeed, pool_pinned_need
from lorafleet.operator.placement import Placement, canary_bytes, place_warm, warm_count
from lorafleet.operator.reports import WorkerIndex, WorkerReport
from lorafleet.operator.rollback import canary_cuts
from lorafleet.operator.statuses import adapter_status, pool_status, unserved_status
from lorafleet.operator.tenant_quota import SizeWait, refused_size, size_settled
from lorafleet.operator.tenant_sources import foreign_regions, own_folders
from lorafleet.worker.directives import AdapterDirective, DesiredState, DirectiveError, VersionRef


class PoolSettings(NamedTuple):
    """A pool's settings for every worker's adapter pool (``DesiredState.eviction``/``cpu_bytes``); None: the
    worker's own."""

    eviction: str | None = None
    cpu_bytes: int | None = None


@dataclass(slots=True)
class PoolPlan:
    desired: dict[str, DesiredState] = field(default_factory=dict)  # pod -> full desired state
    pushes: dict[str, DesiredState] = field(default_factory=dict)  # pod -> what to push now
    placement: Placement = field(default_factory=Placement)  # adapter -> pods keeping it warm
    adapter_statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    unloading: dict[str, list[str]] = field(default_factory=dict)  # deleting adapter -> pods still holding it
    pool_status: dict[str, Any] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)  # pods reporting an error for a desired version
    draining: list[str] | None = None  # no pool: pods still holding any adapter (None: the pool exists)
    releasing: list[str] = field(default_factory=list)  # released pods still holding any adapter
    unreachable: list[str] = field(default_factory=list)  # ``held`` pods holding a deleting adapter, not told
    silent: list[str] = field(default_factory=list)  # pods reached whose sidecar did not answer this pass
    not_ready: list[str] = field(default_factory=list)  # a deleting pool's pods, not ready, that may hold adapters
    workers_unknown: bool = False  # a deleting pool, its workerSelector invalid, naming no pod it pushed to
    overdue: list[str] = field(default_factory=list)  # silent or unreachable past the unload grace (controller.py)
    reported: list[str] = field(default_factory=list)  # adapters some pod reached reports (any tier, version)
    pinned: PinnedNeed | None = None  # with spec.scaling: the workers its pinned adapters need (None: not known)
    pinned_names: set[str] = field(default_factory=set)  # the pinned adapters of ``placement``


def reconcile_pool(pool: PoolSpec | None, adapters: Sequence[AdapterSpec | InvalidAdapter],
                   workers: list[WorkerReport], *, now: str, generation_floor: int = 0,
                   pool_error: str | None = None, shared_pods: dict[str, str] | None = None,
                   released: Sequence[WorkerReport] = (), held: Sequence[WorkerReport] = (),
                   starting: Sequence[WorkerReport] = ()) -> PoolPlan:
    """``now``: RFC 3339 time for condition transitions; ``generation_floor``: see ``_next_generation``;
    ``shared_pods``: pods this pool's selector matches but another pool owns (pod -> owner), left out;
    ``released``: pods this pool pushed to that it no longer owns and no other pool took over (controller.py).

    ``pool`` None: nothing is served. The workers passed (a deleting pool's: see controller.py) are
    each told to hold nothing, and ``plan.draining`` lists those still reporting an adapter. Released pods
    are drained the same way, pool or not: ``plan.releasing`` lists those still reporting an adapter, and
    they count in ``plan.unloading``, but never in a status.

    ``held``: pods that cannot be pushed the pool's set, given while an adapter is being deleted (those of an
    invalid pool: always): those an invalid pool holds (``pool`` None, ``pool_error`` set), and a pool's running
    pods that are not ready (a pod briefly not ready still serves what it holds). They are otherwise left as
    they are, but a deleted adapter must not stay served because of a typo in the pool or a failing readiness
    probe: each that holds one, or was last told one, is told what it last accepted less the adapters being
    deleted (and, the pool valid, less those its checks now refuse with no earlier spec to keep: another
    tenant's folders, the quota), and they count in ``plan.unloading``. Nor must a canary being rolled back
    stay served at its weight: an invalid pool's pods are told what they last accepted with its adapters'
    canary cuts (weight lowered, or canary removed: rollback.py), and nothing else of their specs. One whose
    last push is not known (an operator restart) cannot be told without guessing the rest of its set:
    ``plan.unreachable`` lists it until it is ready (its pool's spec fixed).

    ``starting``: a valid pool's running pods, not ready, whose sidecar says no push has reached its engine yet
    (``awaiting_push``: a new pod, its model loading; its readiness waits for that push). Each is told every
    admitted adapter, none warm, so it stages them while it starts and enters the Service with them registered,
    instead of answering their requests 404 until a pass after it is ready; it counts in no status nor
    placement until it is ready. One whose last accepted push gave it warm copies was ready before (its
    containers restarted): those stay warm (and pinned) in its set while the ready pods hold fewer copies than
    the spec asks, so a copy is not dropped for a restart; placement counts ready pods only. While an adapter
    is being deleted, it counts in ``plan.unloading`` while its sidecar reports it (the push it stages lists
    it: its engine would serve it once up); a push without it replaces that one at once, as a starting engine's
    sidecar answers a push before staging it.

    A pod whose sidecar did not answer this pass may still serve what it was given: it counts in
    ``plan.unloading``, ``plan.draining`` and ``plan.releasing`` (``plan.silent`` lists it) unless the last
    push it accepted left that adapter (for the last two: every adapter) out. Else a finalizer would go
    while the pod is unreachable, and a deleted adapter (or a deleted pool's, whose pods no pass reaches
    any more) would stay served.
    """
    plan = PoolPlan()
    live = [WorkerIndex.of(w) for w in workers if w.reported is not None]
    coming = [WorkerIndex.of(w) for w in starting if w.reported is not None]
    emptied = [WorkerIndex.of(w) for w in released if w.reported is not None]
    kept = [WorkerIndex.of(w) for w in held if w.reported is not None]
    deleting = {x.name for x in adapters if x.deleting}
    silent = [w for w in (*workers, *released, *held) if w.reported is None]
    plan.silent = [w.pod for w in silent]
    plan.reported = sorted({name for w in live + emptied + kept for name in w.by_name})
    for x in adapters:
        if x.deleting:  # unloaded by name, parsable or not; the finalizer waits for []
            plan.unloading[x.name] = ([w.pod for w in live + emptied + kept if w.by_name.get(x.name)]
                                      + [w.pod for w in silent if _may_hold(w, x.name)]
                                      + [w.pod for w in coming if w.by_name.get(x.name)])
    served, failures = admit(pool, [x for x in adapters if not x.deleting], pool_error=pool_error, workers=live)
    # A valid pool's checks refused these, with no earlier spec to keep serving (another tenant's folders, the
    # quota): gone from its pods not ready too. An invalid pool refuses nothing of what its pods hold.
    gone = deleting | ({n for n in failures if n not in served} if pool is not None else set())
    # An invalid pool's pods take its adapters' canary cuts (rollback.py), never anything that grows their set.
    cuts = {x.name: x for x in adapters if not x.deleting} if pool is None else {}
    for w in kept:
        last = w.w.last_pushed
        told = None if last is None else canary_cuts([d for d in last.adapters if d.name not in gone], cuts)
        if not gone & {*w.by_name, *w.pushed} and (told is None or told == last.adapters):
            continue  # holds none of them, and no canary it serves is cut: left as it is
        if told is not None:
            _desire(plan, w, told, generation_floor, PoolSettings(last.eviction, last.cpu_bytes))
        elif deleting & set(w.by_name):  # (a refused one it holds stays until it is ready)
            plan.unreachable.append(w.pod)
    variants: dict[str, tuple[AdapterDirective, AdapterDirective]] = {}  # name -> (not warm, warm) here
    for name, a in sorted(served.items()):
        try:
            variants[name] = (_directive(pool, a, pod_warm=False), _directive(pool, a, pod_warm=True))
        except DirectiveError as exc:  # parsing checks the same fields: a second line, for this adapter only
            failures.setdefault(name, f"spec: no worker directive can be built from it ({exc})")
            held = fallback(pool, a)  # a refused edit never takes down what is serving
            if held is not None:
                try:
                    variants[name] = (_directive(pool, held, pod_warm=False), _directive(pool, held, pod_warm=True))
                    served[name] = held
                except DirectiveError:
                    pass
    served = {name: a for name, a in served.items() if name in variants}

    quiet = [WorkerIndex.of(dataclasses.replace(w, reported=w.last_answer)) for w in workers
             if w.reported is None and w.last_answer is not None]
    plan.placement = place_warm(list(served.values()), live, default_capacity=pool.gpu_bytes if pool else 0,
                                quiet=quiet)
    plan.pinned = pool_pinned_need(pool, list(served.values()), live + quiet)  # the autoscaler's floor
    plan.pinned_names = {name for name, a in served.items() if a.pinned}
    warm_sets = {name: set(pods) for name, pods in plan.placement.items()}
    settings = pool_settings(pool)
    for w in live:
        _desire(plan, w, [variants[name][w.pod in warm_sets[name]] for name in sorted(served)], generation_floor,
                settings)
    for w in coming:  # registered, none warm: placed once ready; or warm where its last push said (it was ready)
        was_warm = {d.name for d in w.w.last_pushed.adapters if d.warm} if w.w.last_pushed is not None else set()
        # ...while the live pods hold fewer copies than the spec asks: placement moved the others to them
        keep = {n for n in was_warm & served.keys() if len(warm_sets[n]) < warm_count(served[n], len(live) + 1)}
        _desire(plan, w, [variants[name][name in keep] for name in sorted(served)], generation_floor, settings,
                starting=True)
    for w in emptied:  # told to hold nothing, pinned adapters included, like a deleting pool's workers
        if w.by_name or w.w.last_pushed is not None:  # one found holding nothing, never told here, is let go
            _desire(plan, w, [], generation_floor, PoolSettings())
    plan.releasing = [w.pod for w in emptied if w.by_name] + [w.pod for w in released if _may_hold(w)]

    for x in adapters:
        if x.deleting:
            continue
        a = served.get(x.name)
        if a is None:  # a pool-level reason (the pool is missing or invalid) degrades; a bad spec fails
            phase = "Degraded" if pool is None and isinstance(x, AdapterSpec) else \
                "Pending" if isinstance(failures[x.name], SizeWait) else "Failed"
            if pool is None and pool_error is not None and isinstance(x, AdapterSpec):
                # An invalid pool leaves its pods as they are: say what they still serve, and that this
                # spec, which parsed, could not be checked against the pool (not that it was refused).
                message = f"{failures[x.name]}; its pods keep what they were last told"
                plan.adapter_statuses[x.name] = unserved_status(x, phase, message, kept, now=now, validated=None)
                continue
            plan.adapter_statuses[x.name] = refused_size(x, unserved_status(x, phase, failures[x.name], live, now=now),
                                                   live)
            continue
        failure = failures.get(x.name)
        # A pod whose last answer stands in counts as it last said (its copies stay placed on it; it gets no new
        # one, so it is asked for none).
        kept_quiet = len(set(plan.placement[x.name]) & {w.pod for w in quiet})
        status = adapter_status(a, live + quiet, plan.placement[x.name], now=now,
                                requested=min(warm_count(a, len(live + quiet)), len(live) + kept_quiet),
                                silent=[w.pod for w in workers if w.reported is None],
                                canary_pods=plan.placement.canary_pods.get(x.name),
                                failure=failure)
        if failure is None and size_settled(pool, a, live):
            status["lastValidSpec"] = a.spec_json
        # The canary's size is remembered: once workers dropped a canary over the quota, none reports it.
        wanted = x if isinstance(x, AdapterSpec) and x.canary is not None else a
        if wanted.canary is not None and (size := canary_bytes(wanted, live)):
            status["canaryBytes"] = {"version": wanted.canary.version, "bytes": size}
        elif isinstance(x, AdapterSpec) and wanted.canary is None:  # promoted or removed: removed with it
            status["canaryBytes"] = None
        plan.adapter_statuses[x.name] = refused_size(x, status, live) if failure is not None else status
    if pool is None:
        plan.draining = [w.pod for w in live if w.by_name] + [w.pod for w in workers if _may_hold(w)] + plan.releasing
    else:
        plan.pool_status = pool_status(pool, len(served), workers, now=now, shared_pods=shared_pods or {})
    return plan


def _directive(pool: PoolSpec | None, a: AdapterSpec, *, pod_warm: bool) -> AdapterDirective:
    canary = None
    if a.canary is not None and a.canary.source is not None:
        canary = _version(pool, a, a.canary.version, a.canary.source)
    return AdapterDirective(
        name=a.name, tenant=a.tenant, stable=_version(pool, a, a.version, a.source),
        canary=canary, canary_weight=a.canary.weight if canary else 0,
        warm=pod_warm, pinned=pod_warm and a.pinned, priority=a.priority,
    )


def _version(pool: PoolSpec | None, a: AdapterSpec, version: str, source: Source) -> VersionRef:
    within = own_folders(pool, a, source.uri)  # a local source's tenant folders (operator/tenant_sources.py)
    return VersionRef(version, source.uri, source.sha256, within, foreign_regions(pool, within))


def _may_hold(w: WorkerReport, name: str | None = None) -> bool:
    """``w``'s sidecar did not answer, and for all the operator knows it still holds adapter ``name`` (None:
    any adapter): no push it accepted is known, or the last one listed it."""
    if w.reported is not None:
        return False
    return w.last_pushed is None or (bool(w.last_pushed.adapters) if name is None else name in w.last_pushed.by_name())


def pool_settings(pool: PoolSpec | None) -> PoolSettings:
    """What a pool's workers are told besides adapters: ``spec.eviction``, and ``spec.adapterMemory.cpuBytes``
    unless 0 (not set: each worker keeps its own CPU tier budget). No pool: the workers' own settings."""
    if pool is None:
        return PoolSettings()
    return PoolSettings(pool.eviction, pool.cpu_bytes or None)


def _desire(plan: PoolPlan, w: WorkerIndex, directives: list[AdapterDirective], floor: int,
            settings: PoolSettings, *, starting: bool = False) -> None:
    """``w``'s desired state in ``plan``, pushed when ``_next_generation`` says so; for a ``starting`` pod only
    when the set it accepted differs or its sidecar no longer holds that push (restarted): its engine applies
    nothing until it is up, and a push every pass would only replace the one staging."""
    if starting:
        last = w.w.last_pushed
        pushed = w.w.reported.pushed_generation  # None: a sidecar that does not say (older): it lists the versions
        holds = pushed == last.generation if pushed is not None and last is not None else \
            all(w.find(d.name, v) is not None for d in directives for v in d.versions)
        held = last is not None and last.adapters == directives and holds \
            and PoolSettings(last.eviction, last.cpu_bytes) == settings
        generation = last.generation if held else max((last.generation if last else 0) + 1,
                                                      w.w.reported.generation_applied + 1, floor)
        push = not held
    else:
        generation, push = _next_generation(w, directives, settings, floor)
    desired = DesiredState(generation, directives, eviction=settings.eviction, cpu_bytes=settings.cpu_bytes)
    plan.desired[w.pod] = desired
    if push:
        plan.pushes[w.pod] = desired
    if w.failed_versions(directives):
        plan.failing.append(w.pod)


def _next_generation(x: WorkerIndex, directives: list[AdapterDirective], settings: PoolSettings,
                     floor: int) -> tuple[int, bool]:
    """(generation, push now?). A new generation on a content change (adapters or pool settings) or drift,
    never below ``floor``.

    The caller passes a clock in milliseconds as ``floor``: a receiver may have accepted pushes this
    process no longer remembers (an operator restart, a push that timed out after it landed), and a
    generation from the clock is above all of them, so no push is refused as stale.
    """
    applied = x.w.reported.generation_applied
    last = x.w.last_pushed
    if last is None or last.adapters != directives or PoolSettings(last.eviction, last.cpu_bytes) != settings:
        return max((last.generation if last else 0) + 1, applied + 1, floor), True
    if applied != last.generation or drifted(x, directives):
        # Reported below what was accepted: the engine (or the pod) restarted; above it: another operator
        # pushed since (a replica leading again after standing by remembers the pushes from before), and
        # what the pod holds need not be what was accepted here. Receivers treat an equal generation as a
        # no-op, so the re-push needs a new one.
        return max(last.generation + 1, applied + 1, floor), True
    return last.generation, False


def drifted(x: WorkerIndex, directives: list[AdapterDirective]) -> bool:
    """The worker claims the push applied yet lost what it was told to hold (restart), its stable version or
    its canary, splits a name's users otherwise than told (`WorkerIndex.split_drifted`), keeps a removed one
    (other than for its requests in flight), or failed to stage a version
    and its retry backoff has elapsed (a new generation makes the stager try again;
    ``WorkerReport.may_retry`` bounds how often). A version its stager is still staging (a download in
    progress, a retry included) is on its way, not lost."""
    for d in directives:
        for version in d.versions:
            st = x.find(d.name, version)
            if st is None or (d.warm and st.tier == "none" and st.error is None and not st.staging):
                return True
        if x.split_drifted(d):
            return True
    if x.w.may_retry and x.failed_versions(directives, retrying=False):
        return True
    wanted = {d.name for d in directives}
    # A removed adapter the engine still reports only for the requests in flight on it (held, no traffic
    # share) is on its way out, not drift: a push could not drop it sooner.
    return any(name not in wanted and not all(st.refcount > 0 and st.traffic_percent == 0 for st in states)
               for name, states in x.by_name.items())
