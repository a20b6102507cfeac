"""One reconcile pass over a pool: gather (indexes + sidecar reports) -> reconcile_pool -> push.

Kopf-free glue between the thin handlers and the pure ``reconcile_pool``; one pass per pool at a
time (a lock per pool), and the last plan is kept so per-adapter timers do not each redo the pass.
A deleting pool is drained: its workers are told to hold nothing (its finalizer waits for that).
Which pool owns a pod that several select: ``_own_pods``. A pod a live pool pushed to and no longer owns
(its labels or the pool's workerSelector changed) is drained the same way unless another pool takes it
over: ``_released_pods``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lorafleet.operator.crd_models import PoolSpec, SpecError, drain_spec, parse_adapter, pool_selector
from lorafleet.operator.push_record import PushRecord
from lorafleet.operator.reconcile import PoolPlan, WorkerReport, reconcile_pool
from lorafleet.operator.workers import StagerClient, discover_workers, selector_matches

log = logging.getLogger(__name__)
PoolKey = tuple[str, str]  # (namespace, pool name)


@dataclass(slots=True)
class PassResult:
    plan: PoolPlan
    started: float  # time.monotonic() when its inputs were read


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def status_changes(current: dict[str, Any] | None, wanted: dict[str, Any]) -> dict[str, Any]:
    """Only the status keys whose value differs: an unchanged status is not re-written every tick."""
    current = current or {}
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def merge_conditions(current: dict[str, Any] | None, wanted: dict[str, Any], *,
                     drop: Iterable[str] = ()) -> dict[str, Any]:
    """``wanted`` with its conditions merged into the current ones. A pool's status has two writers, the
    reconcile (Ready) and the autoscaler (Scaling), and a merge patch replaces a list whole: each writes
    the list with its own types replaced (in place, or appended) and the other's kept as they are;
    ``drop``: types to remove."""
    current_conditions = (current or {}).get("conditions") or []
    gone = set(drop)
    if "conditions" not in wanted and not gone & {c.get("type") for c in current_conditions}:
        return wanted
    own = {c["type"]: c for c in wanted.get("conditions") or []}
    merged = [own.pop(c.get("type"), c) for c in current_conditions if c.get("type") not in gone]
    return {**wanted, "conditions": merged + list(own.values())}


class RetryBackoff:
    """When a worker that reported a failed version may have it re-pushed: first ``base`` seconds after the
    failure is seen, then ``2*base``, ``4*base``, ... up to ``cap``; cleared once it reports no failure."""

    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap = base, cap
        self._state: dict[str, tuple[int, float]] = {}  # worker url -> (num_retries, not before)

    def may_retry(self, url: str, now: float) -> bool:
        state = self._state.get(url)
        return state is not None and now >= state[1]

    def failing(self, url: str, now: float, *, pushed: bool) -> None:
        """It reported a failed version this pass; ``pushed``: it was just given a new generation."""
        if url not in self._state or pushed:
            num_retries = self._state.get(url, (0, 0.0))[0] + pushed
            self._state[url] = (num_retries, now + min(self.cap, self.base * 2**num_retries))

    def clear(self, url: str) -> None:
        self._state.pop(url, None)

    def retain(self, urls: set[str]) -> None:
        for url in set(self._state) - urls:
            del self._state[url]


class PoolController:
    def __init__(self, client: StagerClient, *, retry_base: float = 10.0, retry_cap: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self._locks: dict[PoolKey, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._results: dict[PoolKey, PassResult] = {}
        self._backoff: dict[PoolKey, RetryBackoff] = defaultdict(lambda: RetryBackoff(retry_base, retry_cap))
        self.push_records: dict[PoolKey, PushRecord] = {}  # what each pool's pods accepted

    async def run(self, key: PoolKey, *, pools: Iterable[dict[str, Any]], adapters: Iterable[dict[str, Any]],
                  pods: Iterable[dict[str, Any]], other_pools: Iterable[dict[str, Any]] = (),
                  max_age: float = 0.0) -> PoolPlan:
        """A fresh plan (or the last one when younger than ``max_age`` seconds) for pool ``key``."""
        started = time.monotonic()
        async with self._locks[key]:
            last = self._results.get(key)
            # A pass that read its inputs after this call began is as fresh as a new one.
            if last is not None and (last.started >= started or time.monotonic() - last.started < max_age):
                return last.plan
            began = time.monotonic()
            plan = await self._run(key, list(pools), list(adapters), list(pods), list(other_pools))
            self._results[key] = PassResult(plan, began)
            return plan

    async def _run(self, key: PoolKey, pools: list[dict], adapters: list[dict], pods: list[dict],
                   other_pools: list[dict]) -> PoolPlan:
        pool, pool_error, draining, invalid = None, None, None, None
        for body in pools:
            deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
            try:
                parsed = PoolSpec.parse(body)
            except SpecError as exc:
                if not deleting:
                    pool_error = str(exc)
                    invalid = drain_spec(body)  # which pods it holds (None: its selector is invalid too)
                    continue
                parsed = drain_spec(body)  # its selector still says which workers hold its adapters
                if parsed is None:  # its selector is invalid: which pods it meant is unknown
                    log.warning("LoRAPool %s/%s deleted with an invalid spec.workerSelector (%s); its workers are "
                                "left as they are", key[0], key[1], exc)
                    continue
            if deleting:
                draining = parsed
            else:
                pool = parsed
        specs = [parse_adapter(body) for body in adapters]  # an unparsable one is still unloaded by name
        # An invalid pool leaves its workers alone; a deleting one (its spec invalid too, where its
        # selector is valid) empties those no live pool took over; a valid or deleting one empties the
        # pods it pushed to and released.
        target = pool or draining
        claims = _claims(other_pools)
        own, shared = _own_pods(key[1], target.worker_selector if target else None, pods, claims,
                                draining=draining is not None)
        record = self.push_records.setdefault(key, PushRecord())
        record.merge_status(_status_of(pools))  # pods another operator (or leader) pushed to
        released = _released_pods(key[1], record.pod_ids(), pods, {*_names(own), *shared}, claims) if target else []
        record.retain(own + released)  # pods gone (or re-created under their name) lose what was pushed to them
        workers = discover_workers(own, target.worker_selector, default_port=target.stager_port) if target else []
        # Released pods no longer match the selector: {} (Kubernetes' empty selector) matches every pod.
        emptied = discover_workers(released, {}, default_port=target.stager_port) if target else []
        held = []  # an invalid pool's pods, reached only to unload adapters being deleted
        if target is None and invalid is not None and any(s.deleting for s in specs):
            held = discover_workers(_own_pods(key[1], invalid.worker_selector, pods, claims)[0],
                                    invalid.worker_selector, default_port=invalid.stager_port)
        reached = workers + emptied + held
        reports = await self.client.fetch_states(reached)
        backoff, now = self._backoff[key], self.clock()
        views = [WorkerReport(w.pod, r, record.last(w), may_retry=backoff.may_retry(w.url, now))
                 for w, r in zip(reached, reports, strict=True)]
        num_emptied = len(workers) + len(emptied)
        views, released_views, held_views = views[:len(workers)], views[len(workers):num_emptied], views[num_emptied:]
        plan = reconcile_pool(pool, specs, views, now=utc_now(), generation_floor=time.time_ns() // 1_000_000,
                              pool_error=pool_error, shared_pods=shared, released=released_views, held=held_views)
        by_pod = {w.pod: w for w in reached}
        held_pods = {w.pod for w in held}
        for pod, desired in plan.pushes.items():
            if pod in held_pods:
                # What it last accepted less the deleting adapters: what it is to hold whether or not this push
                # lands (one that did not reports a lower generation and is told again). Forgotten, its set would
                # be unknown and the deleted adapter left on it until the pool's spec is fixed.
                record.record(by_pod[pod], desired)
            else:  # unknown until answered: a pass cut short (cancelled) must not keep the old record
                record.forget(by_pod[pod])
        outcomes = await asyncio.gather(*(self.client.push(by_pod[pod], d) for pod, d in plan.pushes.items()))
        accepted = {pod for pod, ok in zip(plan.pushes, outcomes, strict=True) if ok}
        for (pod, desired), ok in zip(plan.pushes.items(), outcomes, strict=True):
            if ok:  # else refused, or no answer (it may have landed): it stays forgotten, pushed again next pass
                record.record(by_pod[pod], desired)
                log.info("pushed generation %d (%d adapters) to %s", desired.generation, len(desired.adapters), pod)
        for w, view in zip(emptied, released_views, strict=True):
            last = record.last(w)
            if view.reported is not None and not view.reported.adapters and (last is None or not last.adapters):
                record.drop(w)  # holds nothing (told so, or found so): released for good
        backoff.retain({w.url for w in workers})
        for w, view in zip(workers, views, strict=True):
            if w.pod in plan.failing:
                backoff.failing(w.url, now, pushed=w.pod in accepted)
            elif view.reported is not None:
                backoff.clear(w.url)
        if draining is not None:
            # Pods it gave adapters to that are not ready cannot be told now; once the pool is gone no pass would
            # reach them when they are ready again, so its finalizer waits for them too (or for their deletion).
            reached_pods = {w.pod for w in workers + emptied}
            plan.not_ready = sorted(m.get("name", "") for m in (p.get("metadata") or {} for p in own + released)
                                    if m.get("name", "") not in reached_pods
                                    and record.may_hold(m.get("name", ""), m.get("uid") or ""))
            plan.draining = (plan.draining or []) + plan.not_ready
        if pool is not None:  # written with the status, read back after a restart
            plan.pool_status["pushedPods"] = record.to_status()
        if target is None:  # no pool to push for (gone, or invalid): nothing to retry
            self._backoff.pop(key, None)
            if pool_error is None:  # gone: nothing to remember; an invalid pool pushes nothing meanwhile, and
                self.push_records.pop(key, None)  # keeps the pods it pushed to for when it is fixed
        return plan

    def forget(self, key: PoolKey) -> None:
        self._results.pop(key, None)
        self._backoff.pop(key, None)
        self.push_records.pop(key, None)

    def retain(self, keys: set[PoolKey]) -> None:
        """Keep the memory of these pools only (the live ones): a pool deleted while this replica stood by
        leaves nothing behind."""
        for key in self.known_pools():
            if key in keys:
                continue
            self.forget(key)
            lock = self._locks.get(key)
            if lock is not None and not lock.locked():  # a pass in flight keeps its lock
                del self._locks[key]

    def known_pools(self) -> list[PoolKey]:
        """The pools this controller holds memory for."""
        return sorted(set(self._results) | set(self._backoff) | set(self.push_records) | set(self._locks))


def ready_worker_pods(pool: PoolSpec, pods: Iterable[dict[str, Any]],
                      other_pools: Iterable[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """(names of the pool's ready worker pods, as a reconcile pass finds them (sorted); the ready pods its
    selector matches that another pool owns -> that pool)."""
    pods = list(pods)
    own, shared = _own_pods(pool.name, pool.worker_selector, pods, _claims(other_pools))
    ready = discover_workers(own + [p for p in pods if (p.get("metadata") or {}).get("name", "") in shared],
                             pool.worker_selector, default_port=pool.stager_port)
    return [w.pod for w in ready if w.pod not in shared], {w.pod: shared[w.pod] for w in ready if w.pod in shared}


_Claim = tuple[str, dict[str, Any], bool]  # another pool's (name, workerSelector, spec is valid)


def invalid_pool_claim(body: dict[str, Any], pods: Iterable[dict[str, Any]],
                       other_pools: Iterable[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """(names of the pods a pool whose spec is invalid holds, pod -> the earlier pool that owns each other pod
    it selects), by the rule of ``_own_pods``; nothing when its spec.workerSelector is invalid too."""
    selector = pool_selector(body)
    if selector is None:
        return [], {}
    name = (body.get("metadata") or {}).get("name", "")
    own, shared = _own_pods(name, selector, list(pods), _claims(other_pools))
    return sorted(_names(own)), shared


def _own_pods(name: str, selector: dict[str, Any] | None, pods: list[dict], claims: list[_Claim], *,
              draining: bool = False) -> tuple[list[dict], dict[str, str]]:
    """(the pods pool ``name`` owns among those its ``selector`` matches, pod -> owner of each of the others).

    A pod matched by several live pools belongs to the one whose name sorts first; the others leave it
    alone and report it (each push is a pod's whole adapter set, so two owners would undo each other).
    A pool whose spec is invalid keeps its place in that order: it pushes nothing, so the pods it owns
    stay as they are, but no pool after it takes them over (a typo in one pool's spec must not hand its
    workers to another pool that happens to match them); its status names the pods it holds. If its
    spec.workerSelector is invalid too, it holds nothing: which pods it meant is unknown.

    A ``draining`` (deleting) pool hands each pod over to the live pool that owns it next when that pool
    pushes its own set (a valid spec) or held the pod already (an invalid spec, before this one by name);
    it empties the rest, so no adapter of a deleted pool is left behind on a pod nobody pushes to.
    ``selector`` None (no pool to act for): every pod, as given.
    """
    if selector is None:
        return pods, {}
    own, shared = [], {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not selector_matches(selector, labels):
            continue
        owner = _taken_by(name, labels, claims, draining=draining)
        if owner is not None:
            shared[meta.get("name", "")] = owner
        else:
            own.append(pod)
    return own, shared


def _released_pods(name: str, remembered: set[tuple[str, str]], pods: list[dict], kept: set[str],
                   claims: list[_Claim]) -> list[dict]:
    """The pods pool ``name`` pushed to (``remembered``: (name, uid)) that still exist and that neither it nor
    another pool holds now (``kept``: the names of those its selector still matches, owned or shared).

    A pod that left the pool is handed over as a deleting pool hands its pods over (``_own_pods``): to the
    first live pool by name that selects it, if that pool's spec is valid or it sorts before ``name``. The
    rest are emptied, so none keeps adapters that no pool pushes to. A pod that is gone is simply not here.
    """
    released = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        pod_name = meta.get("name", "")
        if (pod_name, meta.get("uid") or "") not in remembered or pod_name in kept:
            continue
        if _taken_by(name, meta.get("labels") or {}, claims, draining=True) is None:
            released.append(pod)
    return released


def _claims(other_pools: Iterable[dict[str, Any]]) -> list[_Claim]:
    """(name, selector, spec is valid) of the live pools whose selector parses, by name: parsed once a pass."""
    claims = []
    for body in other_pools:
        meta = body.get("metadata") or {}
        other_selector = pool_selector(body)
        if other_selector is None or meta.get("deletionTimestamp"):
            continue
        try:
            PoolSpec.parse(body)
            is_valid = True
        except SpecError:
            is_valid = False
        claims.append((meta.get("name", ""), other_selector, is_valid))
    return sorted(claims, key=lambda c: c[0])


def _taken_by(name: str, labels: dict[str, str], claims: list[_Claim], *,
              draining: bool) -> str | None:
    """The other pool that owns a pod with ``labels`` rather than pool ``name`` (see ``_own_pods``), or None."""
    first = next(((other, ok) for other, sel, ok in claims if selector_matches(sel, labels)), None)
    if first is not None and (first[0] < name or (draining and first[1])):
        return first[0]
    return None


def _status_of(pools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The status of the pool's object (live or deleting), if any."""
    return next((body.get("status") for body in pools if body.get("status")), None)


def _names(pods: Iterable[dict[str, Any]]) -> list[str]:
    return [(p.get("metadata") or {}).get("name", "") for p in pods]
