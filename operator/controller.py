"""One reconcile pass over a pool: gather (indexes + sidecar reports) -> reconcile_pool -> push.

Kopf-free glue between the thin handlers and the pure ``reconcile_pool``; one pass per pool at a
time (a lock per pool), and the last plan is kept so per-adapter timers do not each redo the pass.
A deleting pool is drained: its workers are told to hold nothing (its finalizer waits for that).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lorafleet.operator.crd_models import PoolSpec, SpecError, parse_adapter
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
        pool, pool_error, draining = None, None, None
        for body in pools:
            deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
            try:
                parsed = PoolSpec.parse(body)
            except SpecError as exc:
                if deleting:  # its selector is unknown: nothing can be drained
                    log.warning("LoRAPool %s/%s deleted with an invalid spec (%s); its workers are left as they are",
                                key[0], key[1], exc)
                else:
                    pool_error = str(exc)
                continue
            if deleting:
                draining = parsed
            else:
                pool = parsed
        specs = [parse_adapter(body) for body in adapters]  # an unparsable one is still unloaded by name
        # An invalid pool leaves its workers alone; a deleting one empties those no live pool took over.
        target = pool or draining
        pods, shared = _own_pods(key[1], target, pods, other_pools, draining=draining is not None)
        workers = discover_workers(pods, target.worker_selector, default_port=target.stager_port) if target else []
        reports = await self.client.fetch_states(workers)
        backoff, now = self._backoff[key], self.clock()
        views = [WorkerReport(w.pod, r, self.client.last_pushed.get(w.url), may_retry=backoff.may_retry(w.url, now))
                 for w, r in zip(workers, reports, strict=True)]
        plan = reconcile_pool(pool, specs, views, now=utc_now(), generation_floor=time.time_ns() // 1_000_000,
                              pool_error=pool_error, shared_pods=shared)
        by_pod = {w.pod: w for w in workers}
        pushed = await asyncio.gather(*(self.client.push(by_pod[pod], d) for pod, d in plan.pushes.items()))
        accepted = {pod for pod, ok in zip(plan.pushes, pushed, strict=True) if ok}
        for pod, desired in plan.pushes.items():
            if pod in accepted:
                log.info("pushed generation %d (%d adapters) to %s", desired.generation, len(desired.adapters), pod)
        backoff.retain({w.url for w in workers})
        for w, view in zip(workers, views, strict=True):
            if w.pod in plan.failing:
                backoff.failing(w.url, now, pushed=w.pod in accepted)
            elif view.reported is not None:
                backoff.clear(w.url)
        return plan

    def forget(self, key: PoolKey) -> None:
        self._results.pop(key, None)
        self._backoff.pop(key, None)


def ready_worker_pods(pool: PoolSpec, pods: Iterable[dict[str, Any]], other_pools: Iterable[dict[str, Any]]) -> list[str]:
    """Names of the pool's ready worker pods, as a reconcile pass finds them (sorted)."""
    own, _ = _own_pods(pool.name, pool, list(pods), list(other_pools))
    return [w.pod for w in discover_workers(own, pool.worker_selector, default_port=pool.stager_port)]


def _own_pods(name: str, pool: PoolSpec | None, pods: list[dict], other_pools: list[dict], *,
              draining: bool = False) -> tuple[list[dict], dict[str, str]]:
    """A pod matched by several pools belongs to the one whose name sorts first; the others leave it
    alone (each push is a pod's whole adapter set, so two owners would undo each other). A ``draining``
    (deleting) pool has handed every pod another live pool selects over to that pool."""
    if pool is None:
        return pods, {}
    earlier = []
    for body in other_pools:
        other = (body.get("metadata") or {}).get("name", "")
        if (other < name or draining) and not (body.get("metadata") or {}).get("deletionTimestamp"):
            with contextlib.suppress(SpecError):
                earlier.append((other, PoolSpec.parse(body).worker_selector))
    own, shared = [], {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if not selector_matches(pool.worker_selector, labels):
            continue
        owner = next((o for o, sel in earlier if selector_matches(sel, labels)), None)
        if owner is None:
            own.append(pod)
        else:
            shared[meta.get("name", "")] = owner
    return own, shared
