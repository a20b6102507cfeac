"""One autoscaler pass over a pool: Prometheus + the target Deployment -> pure policy -> replicas, status.

Kopf-free glue between the pool's autoscale timer and ``autoscaler`` (the policy). A pass:

1. parses the pool (a bad spec: Scaling False ``InvalidSpec``, naming the field);
2. stops where the operator may not ask the pool's Prometheus (``PrometheusURLNotAllowed``, naming the
   setting: prometheus_allowlist.py): no request goes to it, no replicas change; and where the target is not
   its spec.workerDeployment (``TargetNotWorkers``);
3. leaves a Deployment that another live pool, first by name, also targets to that pool
   (``AmbiguousTarget``): two pools would undo each other's replicas every pass; one that stops at 1. or 2.
   scales nothing, and leaves it to the next;
4. reads the target Deployment's ``spec.replicas`` (``TargetNotFound`` / ``FailedGetScale``), and leaves it
   alone while a HorizontalPodAutoscaler (KEDA's too) scales it (``ConflictingAutoscaler``);
5. a count outside [minReplicas, maxReplicas] is corrected at once, without metrics (as HPA does);
6. else asks Prometheus for the pool's ready worker pods' hit rate, KV usage and requests waiting
   (``MetricsUnavailable``),
   recommends, stabilizes, and holds a scale-up while earlier new replicas are not ready workers yet
   (their load is not in the metrics: scaling again would overshoot), for at most ``MAX_READY_WAIT``
   seconds per replica count (a replica that never becomes ready must not hold scale-ups forever, nor
   make each later one wait in full again); and, once they are ready, while Prometheus has no series of
   one yet (the means cover the earlier replicas alone, the count includes the new ones: scaling again
   would overshoot), for ``SCRAPE_GRACE`` seconds after it became ready at most (past that, a scrape
   that misses it is a scrape to fix: see ``MetricsMissing``); an operator that has not scaled since it
   started waits so for every pod ready for less (it cannot tell which replicas are new);
7. never goes below the workers the pool's pinned adapters need (the reconcile counts them: pinned_need.py),
   nor down at all while that is not known, within maxReplicas (``autoscaler.pinned_floor``); a count below
   them is raised even where 6. cannot read the metrics (``MetricsUnavailable``, ``MetricsMissing``);
8. patches ``spec.replicas`` when the result differs (``FailedUpdateScale``); before a scale-down, with
   ``--rank-pods``, sets the pods' deletion costs so that those holding pinned copies go last (deletion_cost.py).

It returns the status keys it writes: ``hitRate`` and ``kvUsage`` (removed when unknown; ``OWNED_KEYS`` leaves
``kvUsage`` out, as the reconcile writes it again once ``spec.scaling`` goes), ``desiredReplicas``,
``lastScaleTime`` (when it scaled) and the ``Scaling`` condition. A failed pass changes no replicas.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet.operator.autoscaler import ScalingSpec, Stabilizer, bound_correction, pinned_floor, recommend
from lorafleet.operator.controller import PoolKey
from lorafleet.operator.crd_models import PoolSpec, SpecError
from lorafleet.operator.deletion_cost import cost_changes
from lorafleet.operator.deployments import DeploymentClient, KubeError, TargetNotFound
from lorafleet.operator.ownership import pod_names, ready_worker_pods
from lorafleet.operator.pinned_need import NO_PINNED, PinnedNeed
from lorafleet.operator.prometheus import KV_USAGE, QUEUE_DEPTH, MetricsError, PoolSignals, PrometheusClient
from lorafleet.operator.prometheus_allowlist import PrometheusAllowlist
from lorafleet.operator.status_patches import merge_conditions
from lorafleet.operator.statuses import condition
from lorafleet.operator.worker_trust import made_elsewhere, replicaset_index
from lorafleet.operator.workers import ready_condition

log = logging.getLogger(__name__)
SCALING = "Scaling"
OWNED_KEYS = ("hitRate", "desiredReplicas", "lastScaleTime")  # kvUsage goes back to the reconcile
# Seconds a scale-up waits, at one replica count, for replicas that are not ready workers (the chart's
# startup probe gives a worker 10 minutes to load its model, and it turns ready once its adapters are staged too).
MAX_READY_WAIT = 900.0
# Seconds a worker has been ready before its missing series count as a scrape to fix (Prometheus scrapes every
# 15-60 s; a pod ready for less may not have been scraped yet).
SCRAPE_GRACE = 120.0


def _signals(spec: ScalingSpec, signals: PoolSignals) -> str:
    hit, kv, waiting, seats = ("unknown" if v is None else f"{v:.3g}" for v in signals)
    return (f"KV usage {kv} (kvLow {spec.kv_low:g}, kvHigh {spec.kv_high:g}), GPU hit rate {hit} "
            f"(targetHitRate {spec.target_hit_rate:g}), requests waiting per worker {waiting} "
            f"(waitingHigh {spec.waiting_high:g}), sequence seats in use {seats}")


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(slots=True)
class _PoolMemory:
    """What a pool's passes remember: HPA-like history, and since when replicas are missing."""

    target: str
    stabilizer: Stabilizer
    short: tuple[int, float] | None = None  # (replicas, since when fewer were ready workers at that count)
    # Its pods not ready workers after a whole wait: a later scale-up waits only for the others
    stuck: set[str] = field(default_factory=set)
    # The pods listed at its last scale-up (None: none since memory began): the others are its new replicas
    scaled_from: set[str] | None = None


class PoolScaler:
    """The autoscaler of every pool (one pass: ``run``), with each pool's memory (``forget`` / ``retain``)."""

    def __init__(self, metrics: PrometheusClient, deployments: DeploymentClient, *, allowed: PrometheusAllowlist,
                 clock: Callable[[], float] = time.monotonic, rank_pods: bool = False) -> None:
        self.metrics = metrics
        self.rank_pods = rank_pods  # set pod deletion costs before a scale-down (deletion_cost.py)
        self.allowed = allowed  # the Prometheus servers it may ask
        self.deployments = deployments
        self.clock = clock
        self._memory: dict[PoolKey, _PoolMemory] = {}  # per pool, for its current target

    async def close(self) -> None:
        """Close both clients; a pass still running afterwards fails instead of reconnecting."""
        await self.metrics.close()
        await self.deployments.close()

    def forget(self, key: PoolKey) -> None:
        """Drop a pool's memory (it was deleted, or no longer has ``spec.scaling``)."""
        self._memory.pop(key, None)

    def retain(self, keys: set[PoolKey]) -> None:
        """Keep the memory of these pools only (the live ones): a pool deleted while this replica stood by,
        or whose last pass ended after its finalizer's ``forget``, leaves nothing behind."""
        for key in set(self._memory) - keys:
            del self._memory[key]

    def known_pools(self) -> list[PoolKey]:
        """The pools this scaler holds memory for."""
        return list(self._memory)

    def _pool_memory(self, key: PoolKey, target: str) -> _PoolMemory:
        known = self._memory.get(key)
        if known is None or known.target != target:  # another Deployment: earlier recommendations do not apply
            known = self._memory[key] = _PoolMemory(target, Stabilizer())
        return known

    async def run(self, body: dict[str, Any], *, status: Mapping[str, Any] | None = None,
                  pods: Iterable[dict[str, Any]], other_pools: Iterable[dict[str, Any]],
                  replicasets: Iterable[dict[str, Any]] = (), pinned: PinnedNeed | None = NO_PINNED,
                  costs: Mapping[str, int | None] | None = None, now: str) -> dict[str, Any]:
        """The status keys this pass owns, as they should be (``conditions``: the pool's current ones with
        Scaling replaced); a pool without ``spec.scaling`` gets them removed. ``status``: the pool's status
        as it is when the pass ends (kopf's live view; default: the body's), read after the pass's I/O so
        that a condition another writer set meanwhile is kept. ``replicasets``: the namespace's
        (worker_trust.slim_replicaset), which say which pods the other pools may reach. ``pinned``: the workers
        the pool's pinned adapters need (the reconcile's count; None: not known), below which it never scales.
        ``costs``: pod -> its deletion cost (deletion_cost.deletion_costs), written before a scale-down (None: no
        plan yet, the costs set before stand)."""
        if (body.get("spec") or {}).get("scaling") is None:
            meta = body.get("metadata") or {}
            self.forget((meta.get("namespace", ""), meta.get("name", "")))
            return merge_conditions(dict((body.get("status") if status is None else status) or {}),
                                    {k: None for k in OWNED_KEYS}, drop=[SCALING])
        own, (ok, reason, message) = await self._run(body, pods, other_pools, replicasets, pinned, costs, now)
        live = dict((body.get("status") if status is None else status) or {})  # read after the pass's I/O
        return merge_conditions(live, {**own, "conditions": [condition(live, SCALING, ok, reason, message, now)]})

    async def _run(self, body: dict[str, Any], pods: Iterable[dict[str, Any]], other_pools: Iterable[dict[str, Any]],
                   replicasets: Iterable[dict[str, Any]], pinned: PinnedNeed | None,
                   costs: Mapping[str, int | None] | None, now: str) -> tuple[dict[str, Any], tuple[bool, str, str]]:
        """(the status keys it owns but conditions, the Scaling condition's (ok, reason, message))."""
        pods = list(pods)
        def scaling(ok: bool, reason: str, message: str) -> tuple[dict[str, Any], tuple[bool, str, str]]:
            return {}, (ok, reason, message)

        try:
            pool = PoolSpec.parse(body)
        except SpecError as exc:
            return scaling(False, "InvalidSpec", str(exc))
        spec, namespace, key = pool.scaling, pool.namespace, (pool.namespace, pool.name)
        assert spec is not None  # spec.scaling is set
        refusal = self._refusal(body, spec)
        if refusal is not None:
            self.forget(key)
            return scaling(False, *refusal)
        rival = self._rival(pool.name, spec.target, other_pools)
        if rival is not None:
            self.forget(key)
            return scaling(False, "AmbiguousTarget", f"spec.scaling.target: Deployment {spec.target!r} is also the "
                                                     f"target of LoRAPool {rival!r}, which scales it (the first by "
                                                     f"name); give each pool its own Deployment")
        workers = (body.get("spec") or {}).get("workerDeployment")
        memory = self._pool_memory(key, spec.target)
        try:
            current = await self.deployments.get_replicas(namespace, spec.target)
        except TargetNotFound as exc:
            return scaling(False, "TargetNotFound", f"spec.scaling.target: {exc}")
        except KubeError as exc:
            return scaling(False, "FailedGetScale", f"spec.scaling.target: {exc}")
        try:
            rivals = await self.deployments.autoscalers_of(namespace, spec.target)
        except KubeError as exc:  # cannot tell: this pass goes on, the next one asks again
            log.warning("LoRAPool %s/%s: listing HorizontalPodAutoscalers failed: %s", *key, exc)
            rivals = None
        if rivals:
            return scaling(False, "ConflictingAutoscaler", (
                f"spec.scaling.target: Deployment {spec.target!r} is also scaled by HorizontalPodAutoscaler "
                f"{', '.join(rivals)} (a KEDA ScaledObject makes one): two autoscalers undo each other's replicas; "
                f"delete it or remove spec.scaling from this pool; replicas stay at {current}"))

        signals, unseen, beside = PoolSignals(None, None, None, None), False, 0
        corrected = bound_correction(spec, current)
        if corrected is None:
            replicasets = list(replicasets)  # read twice
            worker_pods, others, unready = ready_worker_pods(pool, pods, other_pools, replicasets)
            # A pool naming no workerDeployment may span several Deployments (one per GPU type), scaling one:
            # the others' workers share the load the metrics show, and are no replicas of the target.
            elsewhere = _made_elsewhere(pods, spec.target, replicasets) if workers is None else set()
            beside = sum(pod in elsewhere for pod in worker_pods)
            try:
                signals = PoolSignals(*await self.metrics.pool_signals(
                    spec.prometheus_url, namespace, worker_pods, rate_window_seconds=spec.rate_window_seconds))
            except MetricsError as exc:
                unavailable = f"spec.scaling.prometheusURL: {exc}"
                if not self._below_pinned(spec, current, pinned, beside):
                    return scaling(False, "MetricsUnavailable", f"{unavailable}; replicas stay at {current}")
                corrected = current, f"metrics unavailable ({unavailable})"  # raised to the pinned floor below
        if corrected is not None:
            wanted, why = corrected
            note = ""
        else:
            recommended, why = recommend(spec, signals.hit_rate, signals.kv_usage, current, signals.waiting, beside,
                                         seats=signals.seats)
            # Every worker exports its KV and queue gauges from its first scrape: none for pods ready a while
            # (SCRAPE_GRACE) is a scrape that does not reach them, or labels the queries do not find, not "no
            # traffic"; for pods just ready, a scrape that has not come yet.
            ready = set(worker_pods)
            unseen = (signals.kv_usage is None and signals.waiting is None
                      and _ready_a_while([p for p, n in zip(pods, pod_names(pods), strict=True) if n in ready], now))
            clock = self.clock()
            wanted = memory.stabilizer.stabilize(recommended, current, now=clock, up_seconds=spec.scale_up_seconds,
                                                 down_seconds=spec.scale_down_seconds)
            note = self._note(spec, recommended, wanted, current)
            num_ready = len(worker_pods) - beside
            # Ready pods another pool owns never become this pool's workers: no scale-up waits for them. Nor
            # for pods already waited for in full (stuck: unschedulable, crash-looping): only for the others.
            missing = max(0, current - num_ready - len(others.keys() - elsewhere))
            unready -= elsewhere
            memory.stuck &= unready  # those ready since, or gone, count no more (a replacement is waited for)
            if missing <= len(memory.stuck):
                memory.short = None
            elif memory.short is None or memory.short[0] != current:  # a new count: its replicas get a wait
                memory.short = (current, clock)
            if wanted > current and memory.short is not None:
                if clock - memory.short[1] < MAX_READY_WAIT:
                    note = (f"; recommended {wanted}, but only {num_ready} of {current} replicas are ready "
                            f"workers: waiting for them before scaling up again")
                    wanted = current
                else:
                    memory.stuck, memory.short = set(unready), None
            if wanted > current:
                # Ready, yet maybe not scraped: a further scale-up waits for the new replicas' first series. After
                # a restart (no scale-up remembered: a new operator, a standby now leader) every pod ready for
                # less than SCRAPE_GRACE may be one, so each is waited for.
                before = memory.scaled_from or set()
                fresh = [n for p, n in zip(pods, pod_names(pods), strict=True) if n in ready and n not in elsewhere
                         and n not in before and not _ready_a_while([p], now)]
                try:
                    unscraped = sorted(set(fresh) - await self.metrics.scraped_pods(spec.prometheus_url, namespace,
                                                                                    fresh)) if fresh else []
                except MetricsError as exc:
                    if not self._below_pinned(spec, current, pinned, beside):
                        return scaling(False, "MetricsUnavailable", f"spec.scaling.prometheusURL: {exc}; replicas "
                                                                    f"stay at {current}")
                    unscraped, wanted = [], current  # raised to the pinned floor below, no further
                    note = f"; metrics unavailable (spec.scaling.prometheusURL: {exc})"
                if unscraped:
                    note = (f"; recommended {wanted}, but Prometheus has no series of the new workers "
                            f"{', '.join(unscraped)} yet, so their share of the load is not in the metrics: "
                            f"waiting for their first scrape (at most {SCRAPE_GRACE:g} s after they became ready) "
                            f"before scaling up again")
                    wanted = current
            if memory.stuck and wanted > current:
                note += (f"; {len(memory.stuck)} of {current} replicas not ready workers for over "
                         f"{MAX_READY_WAIT:g} s ({', '.join(sorted(memory.stuck))}): not waiting for them")
            if beside:
                note += (f"; {beside} ready workers of the pool run in other Deployments than {spec.target!r}: "
                         f"they share its load, and {spec.target!r} is scaled by what the whole pool needs")
            if others:
                owners = ", ".join(sorted(set(others.values())))
                note += (f"; {len(others)} ready pods spec.workerSelector matches belong to LoRAPool {owners} "
                         f"(an earlier pool by name, or the first valid one): they do not serve this pool")

        wanted, held = pinned_floor(spec, wanted, current, pinned, beside)
        note += held
        # Unknown (or not asked, correcting the bounds): an earlier pass's figures are removed, not kept.
        result: dict[str, Any] = {"desiredReplicas": wanted, "hitRate": _rounded(signals.hit_rate),
                                  "kvUsage": _rounded(signals.kv_usage)}
        observed = "" if corrected is not None else f"; {_signals(spec, signals)}"
        if corrected is None and unseen:
            missing = (f"Prometheus at spec.scaling.prometheusURL has no "
                       f"{KV_USAGE} or {QUEUE_DEPTH} series with labels namespace={namespace!r} and pod in "
                       f"{', '.join(worker_pods)}; scrape the workers' /metrics (the chart's pod annotations, or its "
                       f"PodMonitor: --set metrics.serviceMonitor.enabled=true and the labels your Prometheus "
                       f"selects by, metrics.serviceMonitor.labels) keeping those two labels")
            if not self._below_pinned(spec, current, pinned, beside):
                return {**result, "desiredReplicas": current}, (False, "MetricsMissing",
                                                                f"{current} replicas, left as they are: {missing}")
            wanted, held = pinned_floor(spec, current, current, pinned, beside)  # the floor alone, not the metrics
            result["desiredReplicas"], why, note, observed = wanted, f"metrics missing ({missing})", held, ""
        if wanted == current:
            return result, (True, "Steady", f"{current} replicas: {why}{note}{observed}")
        if wanted < current and self.rank_pods:
            note += await self._rank_pods(namespace, pods, costs)
        try:
            await self.deployments.set_replicas(namespace, spec.target, wanted)
        except KubeError as exc:
            return scaling(False, "FailedUpdateScale", f"spec.scaling.target: {exc}; replicas stay at {current}")
        if wanted > current:
            memory.scaled_from = set(pod_names(pods))
        log.info("LoRAPool %s/%s: Deployment %s scaled %d -> %d (%s)", *key, spec.target, current, wanted, why)
        reason = "ScaledUp" if wanted > current else "ScaledDown"
        return {**result, "lastScaleTime": now}, (True, reason, f"{current} -> {wanted} replicas: {why}{note}{observed}")

    def _refusal(self, body: dict[str, Any], spec: ScalingSpec) -> tuple[str, str] | None:
        """Why a pool may not scale its target at all, as (reason, message): the operator may not ask its
        Prometheus (prometheus_allowlist.py), or the target is not its spec.workerDeployment; None where it may."""
        refused = self.allowed.problem(spec.prometheus_url)
        if refused is not None:
            return "PrometheusURLNotAllowed", f"spec.scaling.prometheusURL: {refused}; replicas are left as they are"
        workers = (body.get("spec") or {}).get("workerDeployment")
        if workers is not None and workers != spec.target:
            return "TargetNotWorkers", (f"spec.scaling.target: Deployment {spec.target!r} is not the pool's "
                                        f"spec.workerDeployment {workers!r}, the only one whose pods it reaches; "
                                        f"replicas are left as they are")
        return None

    def _rival(self, name: str, target: str, other_pools: Iterable[dict[str, Any]]) -> str | None:
        """The first by name of the live pools that sort before ``name`` and scale ``target`` too. A pool that
        scales nothing is none: its spec does not parse, or its own pass stops at ``_refusal``; else the target
        would be left as it is by both."""
        rivals = []
        for body in other_pools:
            meta = body.get("metadata") or {}
            if meta.get("name", "") >= name or meta.get("deletionTimestamp"):
                continue
            with contextlib.suppress(SpecError):
                scaling = PoolSpec.parse(body).scaling
                if scaling is not None and scaling.target == target and self._refusal(body, scaling) is None:
                    rivals.append(meta.get("name", ""))
        return min(rivals, default=None)

    @staticmethod
    def _below_pinned(spec: ScalingSpec, current: int, pinned: PinnedNeed | None, beside: int) -> bool:
        """Whether `current` replicas are fewer than the pool's pinned adapters need: raised to them even while
        the metrics cannot be read (a pinned adapter must not stay off the GPU until Prometheus answers)."""
        return pinned_floor(spec, current, current, pinned, beside)[0] > current

    async def _rank_pods(self, namespace: str, pods: list[dict[str, Any]], costs: Mapping[str, int | None] | None
                         ) -> str:
        """Before a scale-down: the pods' deletion costs from the pool's last plan (deletion_cost.py), so the
        ReplicaSet removes those holding no pinned copy first. Empty, or a note when the API server refused
        (the scale-down goes on: the floor keeps enough workers, a pinned copy lost is placed again). No plan yet
        (``costs`` None): the costs set before stay as they are."""
        if costs is None:
            return ("; the pods were not ranked again for the scale-down (no reconcile pass since the operator "
                    "started): the costs set before stand")
        for pod, cost in cost_changes(pods, costs).items():
            try:
                await self.deployments.set_deletion_cost(namespace, pod, cost)
            except KubeError as exc:
                if exc.status == 404:  # gone since the index was read: nothing to rank, the others still are
                    continue
                log.warning("pod %s/%s: its deletion cost was not set: %s", namespace, pod, exc)
                return (f"; the pods were not ranked for the scale-down ({exc}; grant the operator patch on "
                        f"pods): the ReplicaSet may remove one holding a pinned copy, placed again after")
        return ""

    @staticmethod
    def _note(spec: ScalingSpec, recommended: int, wanted: int, current: int) -> str:
        """Why the stabilized count is not the recommendation (empty when it is)."""
        if wanted == recommended:
            return ""
        if recommended < current:
            return (f"; recommended {recommended}, held at {wanted} by the {spec.scale_down_seconds} s scale-down "
                    f"stabilization window")
        return (f"; recommended {recommended}, limited to {wanted} by the {spec.scale_up_seconds} s scale-up "
                f"stabilization window")


def _ready_a_while(pods: list[dict[str, Any]], now: str) -> bool:
    """Whether one of the ready `pods` has been ready SCRAPE_GRACE seconds at `now` (a pod whose Ready
    condition has no time counts as ready a while)."""
    at = datetime.datetime.fromisoformat(now)
    for ready in filter(None, map(ready_condition, pods)):
        since = ready.get("lastTransitionTime")
        try:
            if not since or (at - datetime.datetime.fromisoformat(since)).total_seconds() >= SCRAPE_GRACE:
                return True
        except (TypeError, ValueError):
            return True
    return False


def _made_elsewhere(pods: list[dict[str, Any]], target: str, replicasets: Iterable[dict[str, Any]]) -> set[str]:
    """Names of the ``pods`` that another controller than Deployment ``target`` made (worker_trust.made_elsewhere)."""
    made = replicaset_index(replicasets)
    return {name for pod, name in zip(pods, pod_names(pods), strict=True) if made_elsewhere(pod, target, made)}

