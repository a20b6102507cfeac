"""One reconcile pass over a pool: gather (indexes + sidecar reports) -> reconcile_pool -> push.

Kopf-free glue between the thin handlers and the pure ``reconcile_pool``; one pass per pool at a
time (a lock per pool), and the last plan is kept so per-adapter timers do not each redo the pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lorafleet.operator.crd_models import AdapterSpec, PoolSpec, SpecError
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


class PoolController:
    def __init__(self, client: StagerClient) -> None:
        self.client = client
        self._locks: dict[PoolKey, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._results: dict[PoolKey, PassResult] = {}

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
        pool, pool_error = None, None
        live_pools = [b for b in pools if not (b.get("metadata") or {}).get("deletionTimestamp")]
        if live_pools:
            try:
                pool = PoolSpec.parse(live_pools[0])
            except SpecError as exc:
                pool_error = str(exc)
        specs = []
        for body in adapters:
            try:
                specs.append(AdapterSpec.parse(body))
            except SpecError:
                continue  # its own handler reports the bad spec
        pods, shared = _own_pods(key[1], pool, pods, other_pools)
        workers = discover_workers(pods, pool.worker_selector, default_port=pool.stager_port) if pool else []
        reports = await self.client.fetch_states(workers)
        views = [WorkerReport(w.pod, r, self.client.last_pushed.get(w.url)) for w, r in zip(workers, reports,
                                                                                              strict=True)]
        plan = reconcile_pool(pool, specs, views, now=utc_now(), pool_name=key[1],
                              generation_floor=time.time_ns() // 1_000_000, pool_error=pool_error,
                              shared_pods=shared)
        by_pod = {w.pod: w for w in workers}
        pushed = await asyncio.gather(*(self.client.push(by_pod[pod], d) for pod, d in plan.pushes.items()))
        for (pod, desired), ok in zip(plan.pushes.items(), pushed, strict=True):
            if ok:
                log.info("pushed generation %d (%d adapters) to %s", desired.generation, len(desired.adapters), pod)
        return plan

    def forget(self, key: PoolKey) -> None:
        self._results.pop(key, None)


def _own_pods(name: str, pool: PoolSpec | None, pods: list[dict], other_pools: list[dict]
              ) -> tuple[list[dict], dict[str, str]]:
    """A pod matched by several pools belongs to the one whose name sorts first; the others leave it
    alone (each push is a pod's whole adapter set, so two owners would undo each other)."""
    if pool is None:
        return pods, {}
    earlier = []
    for body in other_pools:
        other = (body.get("metadata") or {}).get("name", "")
        if other < name and not (body.get("metadata") or {}).get("deletionTimestamp"):
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
