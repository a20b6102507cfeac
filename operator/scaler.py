"""One autoscaler pass over a pool: Prometheus + the target Deployment -> pure policy -> replicas, status.

Kopf-free glue between the pool's autoscale timer and ``autoscaler`` (the policy). A pass:

1. parses the pool (a bad spec: Scaling False ``InvalidSpec``, naming the field);
2. reads the target Deployment's ``spec.replicas`` (``TargetNotFound`` / ``FailedGetScale``);
3. a count outside [minReplicas, maxReplicas] is corrected at once, without metrics (as HPA does);
4. else asks Prometheus for the pool's ready worker pods' hit rate and KV usage (``MetricsUnavailable``),
   recommends, stabilizes, and holds a scale-up while earlier new replicas are not ready workers yet
   (their load is not in the metrics: scaling again would overshoot);
5. patches ``spec.replicas`` when the result differs (``FailedUpdateScale``).

It returns the status keys it owns: ``hitRate`` and ``kvUsage`` (when known), ``desiredReplicas``,
``lastScaleTime`` (when it scaled) and the ``Scaling`` condition. A failed pass changes no replicas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from lorafleet.operator.autoscaler import ScalingSpec, Stabilizer, bound_correction, recommend
from lorafleet.operator.controller import PoolKey, merge_conditions, ready_worker_pods
from lorafleet.operator.crd_models import PoolSpec, SpecError
from lorafleet.operator.deployments import DeploymentClient, KubeError, TargetNotFound
from lorafleet.operator.prometheus import MetricsError, PrometheusClient
from lorafleet.operator.statuses import condition

log = logging.getLogger(__name__)
SCALING = "Scaling"
OWNED_KEYS = ("hitRate", "desiredReplicas", "lastScaleTime")  # kvUsage goes back to the reconcile


def _signals(spec: ScalingSpec, hit_rate: float | None, kv_usage: float | None) -> str:
    kv = "unknown" if kv_usage is None else f"{kv_usage:.3g}"
    hit = "unknown" if hit_rate is None else f"{hit_rate:.3g}"
    return (f"KV usage {kv} (kvLow {spec.kv_low:g}, kvHigh {spec.kv_high:g}), GPU hit rate {hit} "
            f"(targetHitRate {spec.target_hit_rate:g})")


class PoolScaler:
    def __init__(self, metrics: PrometheusClient, deployments: DeploymentClient, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.deployments = deployments
        self.clock = clock
        self._stabilizers: dict[PoolKey, tuple[str, Stabilizer]] = {}  # per pool, for its current target

    async def close(self) -> None:
        await self.metrics.close()
        await self.deployments.close()

    def forget(self, key: PoolKey) -> None:
        self._stabilizers.pop(key, None)

    def _stabilizer(self, key: PoolKey, target: str) -> Stabilizer:
        known = self._stabilizers.get(key)
        if known is None or known[0] != target:  # another Deployment: earlier recommendations do not apply
            known = self._stabilizers[key] = (target, Stabilizer())
        return known[1]

    async def run(self, body: dict[str, Any], *, pods: Iterable[dict[str, Any]],
                  other_pools: Iterable[dict[str, Any]], now: str) -> dict[str, Any]:
        """The status keys this pass owns, as they should be (``conditions``: the pool's current ones with
        Scaling replaced); a pool without ``spec.scaling`` gets them removed."""
        status = dict(body.get("status") or {})
        if (body.get("spec") or {}).get("scaling") is None:
            meta = body.get("metadata") or {}
            self.forget((meta.get("namespace", ""), meta.get("name", "")))
            return merge_conditions(status, {k: None for k in OWNED_KEYS}, drop=[SCALING])
        return merge_conditions(status, await self._run(body, status, pods, other_pools, now))

    async def _run(self, body: dict[str, Any], status: dict[str, Any], pods: Iterable[dict[str, Any]],
                   other_pools: Iterable[dict[str, Any]], now: str) -> dict[str, Any]:
        def scaling(ok: bool, reason: str, message: str) -> dict[str, Any]:
            return {"conditions": [condition(status, SCALING, ok, reason, message, now)]}

        try:
            pool = PoolSpec.parse(body)
        except SpecError as exc:
            return scaling(False, "InvalidSpec", str(exc))
        spec, namespace, key = pool.scaling, pool.namespace, (pool.namespace, pool.name)
        assert spec is not None  # spec.scaling is set
        try:
            current = await self.deployments.get_replicas(namespace, spec.target)
        except TargetNotFound as exc:
            return scaling(False, "TargetNotFound", f"spec.scaling.target: {exc}")
        except KubeError as exc:
            return scaling(False, "FailedGetScale", f"spec.scaling.target: {exc}")

        hit_rate = kv_usage = None
        corrected = bound_correction(spec, current)
        if corrected is not None:
            wanted, why = corrected
            note = ""
        else:
            worker_pods = ready_worker_pods(pool, pods, other_pools)
            try:
                hit_rate, kv_usage = await self.metrics.pool_signals(spec.prometheus_url, namespace, worker_pods)
            except MetricsError as exc:
                return scaling(False, "MetricsUnavailable", f"spec.scaling.prometheusURL: {exc}; replicas stay "
                                                            f"at {current}")
            recommended, why = recommend(spec, hit_rate, kv_usage, current)
            wanted = self._stabilizer(key, spec.target).stabilize(
                recommended, current, now=self.clock(), up_seconds=spec.scale_up_seconds,
                down_seconds=spec.scale_down_seconds)
            note = self._note(spec, recommended, wanted, current)
            if wanted > current and len(worker_pods) < current:
                note = (f"; recommended {wanted}, but only {len(worker_pods)} of {current} replicas are ready "
                        f"workers: waiting for them before scaling up again")
                wanted = current

        result: dict[str, Any] = {"desiredReplicas": wanted}
        if hit_rate is not None:
            result["hitRate"] = round(hit_rate, 4)
        if kv_usage is not None:
            result["kvUsage"] = round(kv_usage, 4)
        signals = "" if corrected is not None else f"; {_signals(spec, hit_rate, kv_usage)}"
        if wanted == current:
            return {**result, **scaling(True, "Steady", f"{current} replicas: {why}{note}{signals}")}
        try:
            await self.deployments.set_replicas(namespace, spec.target, wanted)
        except KubeError as exc:
            return scaling(False, "FailedUpdateScale", f"spec.scaling.target: {exc}; replicas stay at {current}")
        log.info("LoRAPool %s/%s: Deployment %s scaled %d -> %d (%s)", *key, spec.target, current, wanted, why)
        reason = "ScaledUp" if wanted > current else "ScaledDown"
        return {**result, "lastScaleTime": now,
                **scaling(True, reason, f"{current} -> {wanted} replicas: {why}{note}{signals}")}

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
