"""Kopf handlers for LoRAPool and LoRAAdapter: the only module with kopf decorators, kept thin.

``register(registry, config, deployments=None)`` attaches every handler to a registry (so tests and
``__main__`` choose intervals and the Kubernetes connection without module globals). Each handler calls
``PoolController.run`` (gather -> pure ``reconcile_pool`` -> push) and writes the status the plan
computed from workers' reports.

* indexes: worker pods and ReplicaSets by namespace, adapters and pools by (namespace, pool), adapters being
  deleted by namespace -- no extra API reads;
* a pool's passes see only the pods it may send the stager token to (``WorkerTrust``: those its worker
  Deployment made, where it names one), and the others apart: of those, the pods it pushed to before are
  emptied (controller.py);
* pool create/update/resume + a timer every ``interval`` s: directives pushed, drift caught;
* adapter create/update/resume + a timer: status refreshed from reports (an unparsable spec too: its
  pass keeps the last valid spec in force and reports Failed naming the field);
* adapter deletion: a finalizer that holds the object until no worker reports the adapter any more: those of
  its pool and of each other pool of its namespace whose pods may hold it (one it moved away from;
  ``PoolController.may_hold``), only those pools' passes run on each retry (every pool's pass unloads the
  namespace's deleting adapters; finalizers.py), a pod that cannot be told for ``unload_grace`` s aside;
* pool autoscale timer every ``scale_interval`` s (``PoolScaler``): a pool with ``spec.scaling`` gets its
  Deployment's replicas set from Prometheus' view of its workers; the Scaling condition says how it went;
* pool deletion: a finalizer that first tells the pool's workers to hold nothing and waits until they
  report nothing (with an invalid workerSelector: the pods it pushed to); its adapters turn Degraded (their
  timers see the pool gone from the index);
* every timer enters ``TimerTasks`` first and runs its pass through it, so that stopping the operator ends them
  all at once, passes in progress included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import kopf

from lorafleet.operator.controller import QUIET_GRACE_S, PassInputs, PoolController
from lorafleet.operator.crd_models import (
    ADAPTERS,
    GROUP,
    POOLS,
    VERSION,
    InvalidAdapter,
    PoolSpec,
    SpecError,
    parse_adapter,
    pool_selector,
)
from lorafleet.operator.deletion_cost import DELETION_COST, MARK, deletion_costs
from lorafleet.operator.deployments import DeploymentClient
from lorafleet.operator.finalizers import adapter_unload_wait, holders_text
from lorafleet.operator.observed_generations import ObservedGenerations, object_key
from lorafleet.operator.operator_config import OperatorConfig
from lorafleet.operator.ownership import invalid_pool_claim
from lorafleet.operator.pool_conditions import PoolConditions
from lorafleet.operator.prometheus import PrometheusClient
from lorafleet.operator.prometheus_allowlist import PrometheusAllowlist
from lorafleet.operator.push_record import pod_id
from lorafleet.operator.scaler import SCALING, PoolScaler
from lorafleet.operator.status_patches import merge_conditions, status_changes, utc_now
from lorafleet.operator.statuses import invalid_pool_status, with_ready_note
from lorafleet.operator.timer_tasks import TimerTasks
from lorafleet.operator.worker_trust import WorkerTrust, slim_replicaset, trusted_pods
from lorafleet.operator.workers import StagerClient

log = logging.getLogger(__name__)
FINALIZER = "lorafleet.dev/unload"
MAX_RETRY_DELAY = 300.0  # seconds: the cap of the backoff for re-pushing versions a worker failed to stage
STOPPING_TIMER_WAIT = 2.0  # seconds kopf waits for a stopping timer (its pass cut short) before leaving it


def _slim_pod(body: kopf.Body) -> dict[str, Any]:
    """What discovery needs of a pod; indexes hold this, not the whole pod."""
    return {
        "metadata": {"name": body.metadata.name, "uid": body.metadata.uid,
                     "labels": dict(body.metadata.labels),
                     # The deletion costs, the operator's and others' (deletion_cost.cost_changes tells them apart).
                     "annotations": {k: v for k, v in body.metadata.annotations.items() if k in (DELETION_COST, MARK)},
                     "deletionTimestamp": body.metadata.get("deletionTimestamp"),
                     "ownerReferences": [{k: ref.get(k) for k in ("kind", "name", "uid", "controller")}
                                         for ref in body.metadata.get("ownerReferences") or []]},
        "status": {"podIP": body.status.get("podIP"), "phase": body.status.get("phase"),
                   "conditions": [dict(c) for c in body.status.get("conditions") or []]},
        "spec": {"containers": [{"ports": [dict(p) for p in c.get("ports") or []]}
                                for c in body.spec.get("containers") or []]},
    }


class QuietTimers(logging.Filter):
    """Drops kopf's INFO "Timer '...' succeeded." records (every timer pass of every object: drift checks,
    adapter refreshes, autoscaler passes); kept when the logger is at DEBUG. What a pass did is logged by
    the pass, failures by kopf at ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.getMessage().startswith("Timer ")
                    and record.getMessage().endswith(" succeeded.")
                    and not logging.getLogger(record.name).isEnabledFor(logging.DEBUG))


@dataclass(slots=True)
class Controllers:
    """What the handlers share: closed when the operator stops."""

    pools: PoolController
    scaler: PoolScaler

    async def close(self) -> None:
        await self.pools.flights.close()  # its pushes in flight, and the sidecar client
        await self.scaler.close()


def configure_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Kopf's settings for this operator (the startup handler's whole work)."""
    settings.persistence.finalizer = FINALIZER
    # Handler progress in annotations: the CRDs' status schemas are strict and would prune status.kopf.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="lorafleet.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="lorafleet.dev", key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    objects_log = logging.getLogger("kopf.objects")
    if not any(isinstance(f, QuietTimers) for f in objects_log.filters):
        objects_log.addFilter(QuietTimers())
    settings.watching.server_timeout = 60
    # A stopping timer ends its pass at once (TimerTasks.run); kopf's default wait for that is ten loop cycles,
    # fewer than cancelling a pass's HTTP request takes, after which it logs the timer orphaned.
    settings.background.instant_exit_timeout = STOPPING_TIMER_WAIT
    if config.peering:
        settings.peering.name = config.peering
        settings.peering.standalone = False
        settings.peering.clusterwide = config.namespace is None
    else:
        settings.peering.standalone = True
    # The resources it serves are known at startup (kopf lists them once): the chart's Role and ClusterRole grant
    # no watch of CRDs (nor, for one namespace, of namespaces), which kopf's scan would log warnings about at
    # every start. CRDs installed after the operator are served from its next start.
    settings.scanning.disabled = True


def register(registry: kopf.OperatorRegistry, config: OperatorConfig,
             deployments: DeploymentClient | None = None) -> Controllers:
    """Attach all handlers to ``registry``. ``deployments``: the autoscaler's Kubernetes client (default:
    one that logs in as kopf does without a client library: service account, else kubeconfig)."""
    controller = PoolController(StagerClient(token=config.stager_token, timeout=config.request_timeout,
                                               push_timeout=config.push_timeout),
                                retry_base=config.interval, retry_cap=max(config.interval, MAX_RETRY_DELAY),
                                unload_grace=config.unload_grace, quiet_grace=max(QUIET_GRACE_S, 3 * config.interval))
    scaler = PoolScaler(PrometheusClient(timeout=config.request_timeout),
                        deployments or DeploymentClient(timeout=config.request_timeout),
                        allowed=PrometheusAllowlist(config.prometheus_urls), rank_pods=config.rank_pods)
    controllers = Controllers(controller, scaler)
    trust = WorkerTrust()  # which pods each pool may reach (worker_trust.py)
    timers = TimerTasks()  # stopped at once when the operator stops (timer_tasks.py)
    observed = ObservedGenerations()  # no status write lowers observedGeneration (observed_generations.py)
    conditions = PoolConditions()  # what each writer of a pool's conditions last wrote (pool_conditions.py)
    res_pools, res_adapters = (GROUP, VERSION, POOLS), (GROUP, VERSION, ADAPTERS)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings, config)

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        timers.stop()  # the watches are over: no timer is spawned after this
        await controllers.close()

    @kopf.index("pods", id="worker_pods", registry=registry)
    def worker_pods(namespace: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
        return {namespace: _slim_pod(body)}

    @kopf.index("apps", "v1", "replicasets", id="worker_replicasets", registry=registry)
    def worker_replicasets(namespace: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
        return {namespace: slim_replicaset(dict(body))}

    def pool_pods(namespace: str, body: dict[str, Any], indexes: dict[str, kopf.Index]) -> list[dict[str, Any]]:
        """The pods pool ``body`` may reach (nothing logged: its passes' ``trust.admit`` logs those it may not)."""
        return trusted_pods(body, indexes["worker_pods"].get(namespace, []),
                            indexes["worker_replicasets"].get(namespace, []))[0]

    @kopf.index(*res_pools, id="pools_by_name", registry=registry)
    def pools_by_name(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, name): dict(body)}

    @kopf.index(*res_adapters, id="adapters_by_pool", registry=registry)
    def adapters_by_pool(namespace: str, body: kopf.Body, spec: kopf.Spec, **_: Any) -> dict[Any, Any]:
        return {(namespace, spec.get("pool", "")): dict(body)}

    @kopf.index(*res_adapters, id="deleting_adapters", registry=registry)
    def deleting_adapters(namespace: str, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
        return {namespace: dict(body)} if body.metadata.get("deletionTimestamp") else None

    def other_pools(namespace: str, pool: str, indexes: dict[str, kopf.Index]) -> list[dict[str, Any]]:
        pools = indexes["pools_by_name"]
        return [body for k in list(pools) if k[0] == namespace and k[1] != pool for body in pools.get(k, [])]

    async def run_pass(namespace: str, pool: str, indexes: dict[str, kopf.Index], *, max_age: float = 0.0):
        key = (namespace, pool)

        def read() -> PassInputs:  # kopf's indexes are live: read once the pass is due, for every call queued
            bodies = list(indexes["pools_by_name"].get(key, []))
            # Another pool's adapter being deleted too: it may have moved here from this pool, whose pods hold it.
            moved = [body for body in indexes["deleting_adapters"].get(namespace, [])
                     if (body.get("spec") or {}).get("pool", "") != pool]
            replicasets = list(indexes["worker_replicasets"].get(namespace, []))
            every = list(indexes["worker_pods"].get(namespace, []))
            pods = trust.admit(key, bodies, every, replicasets)
            # The others: those it pushed to under an earlier spec.workerDeployment (or none) are emptied.
            reached = {pod_id(p) for p in pods}
            return PassInputs(bodies, [*indexes["adapters_by_pool"].get(key, []), *moved], pods,
                              other_pools(namespace, pool, indexes), replicasets,
                              [p for p in every if pod_id(p) not in reached])

        return await controller.run_reading(key, read, max_age=max_age)

    # --- LoRAPool --------------------------------------------------------------------------------

    async def reconcile_pool_handler(namespace: str, name: str, body: kopf.Body, status: kopf.Status,
                                     patch: kopf.Patch, max_age: float, **kwargs: Any) -> None:
        try:
            PoolSpec.parse(dict(body))
        except SpecError as exc:
            # It keeps its claim on the pods it selects (see ownership.own_pods), and says so.
            held, shared = invalid_pool_claim(dict(body), pool_pods(namespace, dict(body), kwargs),
                                              other_pools(namespace, name, kwargs),
                                              kwargs["worker_replicasets"].get(namespace, []))
            wanted = invalid_pool_status(dict(status), int(body.metadata.get("generation") or 0), str(exc),
                                         now=utc_now(), held=held, shared_pods=shared)
            # No pass runs, but pushes made before the edit may still be in flight: said as they are now.
            wanted["pushing"] = controller.flights.in_flight((namespace, name))
            wanted = observed.admit(object_key(POOLS, body), wanted, status)
            wanted = conditions.settle((namespace, name), merge_conditions(dict(status), wanted),
                                       lambda t: t != SCALING)
            patch.status.update(status_changes(dict(status), wanted))
            raise kopf.PermanentError(str(exc)) from None
        plan = await run_pass(namespace, name, kwargs, max_age=max_age)
        wanted = with_ready_note(plan.pool_status, trust.left_out((namespace, name)))
        wanted = observed.admit(object_key(POOLS, body), wanted, status)  # the pass read the spec when it began
        # Merged into the live conditions: the plan's pool body may predate the autoscaler's last write.
        wanted = conditions.settle((namespace, name), merge_conditions(dict(status), wanted), lambda t: t != SCALING)
        patch.status.update(status_changes(dict(status), wanted))

    def fresh_within(reason: Any) -> float:
        """On start, a pass of the pool begun since (kopf runs handlers once its indexes are whole) serves every
        resume of an unchanged resource, not one full pass each asking every pod in turn; a change (an object
        edited while the operator was down comes as one, its resume merged in) needs a pass that reads it."""
        return config.interval / 2 if reason == kopf.Reason.RESUME else 0.0

    @kopf.on.create(*res_pools, registry=registry)
    @kopf.on.update(*res_pools, field="spec", registry=registry)
    @kopf.on.resume(*res_pools, registry=registry)
    async def pool_changed(**kwargs: Any) -> None:
        await reconcile_pool_handler(max_age=fresh_within(kwargs.get("reason")), **kwargs)

    @kopf.timer(*res_pools, interval=config.interval, registry=registry)
    async def pool_drift(stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
        if not timers.enter(stopped):
            return
        controller.retain(set(kwargs["pools_by_name"]))  # memory of pools deleted while this replica stood by
        trust.retain(set(kwargs["pools_by_name"]))
        with contextlib.suppress(kopf.PermanentError):  # a bad spec is already reported in status
            await timers.run(stopped, reconcile_pool_handler(max_age=config.interval / 2, **kwargs))

    @kopf.timer(*res_pools, interval=config.scale_interval, registry=registry)
    async def pool_autoscale(namespace: str, name: str, body: kopf.Body, status: kopf.Status, patch: kopf.Patch,
                             stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
        if not timers.enter(stopped):
            return
        scaler.retain(set(kwargs["pools_by_name"]))  # memory of pools deleted while this replica stood by
        conditions.retain(set(kwargs["pools_by_name"]))
        if body.metadata.get("deletionTimestamp"):
            return
        # ``status`` is kopf's live view: the pass merges its condition into the status as it is at its end.
        plan = controller.last_plan((namespace, name))
        wanted = await timers.run(stopped, scaler.run(
            dict(body), status=status, pods=pool_pods(namespace, dict(body), kwargs),
            other_pools=other_pools(namespace, name, kwargs),
            replicasets=kwargs["worker_replicasets"].get(namespace, []),
            pinned=None if plan is None else plan.pinned, costs=deletion_costs(plan) if scaler.rank_pods else None,
            now=utc_now()))
        if wanted is None:  # cut short by the operator's stop
            return
        wanted = conditions.settle((namespace, name), wanted, lambda t: t == SCALING)
        patch.status.update(status_changes(dict(status), wanted))

    @kopf.on.delete(*res_pools, registry=registry)
    async def pool_deleted(namespace: str, name: str, body: kopf.Body, logger: kopf.Logger, **kwargs: Any) -> None:
        """The finalizer: the pool goes only once its workers report no adapter (pinned ones included); with an
        invalid workerSelector, its workers are the pods it pushed to (controller.py)."""
        plan = await run_pass(namespace, name, kwargs)
        if plan.draining is None:  # that pass did not see the deletion yet
            raise kopf.TemporaryError("waiting for a reconcile that sees the deletion", delay=config.retry_delay)
        if plan.draining:
            lost = (" (its spec.workerSelector is invalid: from the pods it pushed to)"
                    if pool_selector(dict(body)) is None else "")
            raise kopf.TemporaryError(f"unloading every adapter first{lost}; "
                                      f"{holders_text(plan.draining, plan.silent, plan.not_ready)}",
                                      delay=config.retry_delay)
        if plan.workers_unknown:
            logger.warning("deleted with an invalid spec.workerSelector, and no pod it pushed to is known (neither "
                           "the operator's memory nor its status.pushedPods names one): its workers, if "
                           "any, are left as they are, holding its adapters; delete those pods to unload them")
        controller.forget((namespace, name))
        scaler.forget((namespace, name))
        trust.forget((namespace, name))
        conditions.forget((namespace, name))
        observed.forget(object_key(POOLS, body))
        log.warning("LoRAPool %s/%s deleted; its adapters turn Degraded until it exists again", namespace, name)

    # --- LoRAAdapter -----------------------------------------------------------------------------

    async def write_adapter_status(namespace: str, name: str, body: kopf.Body, status: kopf.Status,
                                   patch: kopf.Patch, max_age: float, **kwargs: Any) -> None:
        # The pass runs for an unparsable spec too: it keeps the last valid spec in force and computes the status.
        plan = await run_pass(namespace, (body.get("spec") or {}).get("pool", ""), kwargs, max_age=max_age)
        wanted = plan.adapter_statuses.get(name)
        if wanted is not None:
            wanted = observed.admit(object_key(ADAPTERS, body), wanted, status)
            patch.status.update(status_changes(dict(status), wanted))
        parsed = parse_adapter(dict(body))
        if isinstance(parsed, InvalidAdapter):
            raise kopf.PermanentError(parsed.error)

    @kopf.on.create(*res_adapters, registry=registry)
    @kopf.on.update(*res_adapters, field="spec", registry=registry)
    @kopf.on.resume(*res_adapters, registry=registry)
    async def adapter_changed(**kwargs: Any) -> None:
        await write_adapter_status(max_age=fresh_within(kwargs.get("reason")), **kwargs)

    @kopf.timer(*res_adapters, interval=config.interval, registry=registry)
    async def adapter_refresh(stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
        if not timers.enter(stopped):
            return
        with contextlib.suppress(kopf.PermanentError):  # a bad spec is already reported in status
            await timers.run(stopped, write_adapter_status(max_age=config.interval / 2, **kwargs))

    @kopf.on.delete(*res_adapters, registry=registry)
    async def adapter_deleted(namespace: str, name: str, body: kopf.Body, spec: kopf.Spec, logger: kopf.Logger,
                              **kwargs: Any) -> None:
        """The finalizer: the object goes only when no worker of the pools that may hold it reports the adapter
        any more (finalizers.py says which pods it waits for, and which it stops waiting for)."""
        # Its own pool, and the others whose pods may hold it (one it moved away from; controller.may_hold).
        by_name = kwargs["pools_by_name"]
        pools = {spec.get("pool", ""), *(k[1] for k in list(by_name)
                                         if k[0] == namespace and controller.may_hold(k, name, by_name.get(k, [])))}
        plans = await asyncio.gather(*(run_pass(namespace, pool, kwargs) for pool in sorted(pools)))
        wait = adapter_unload_wait(name, plans)
        if wait is None:  # a pass did not see the deletion yet
            raise kopf.TemporaryError("waiting for a reconcile that sees the deletion", delay=config.retry_delay)
        if wait.waiting:
            raise kopf.TemporaryError(f"unloading; {wait.message}", delay=config.retry_delay)
        observed.forget(object_key(ADAPTERS, body))
        if wait.given_up:
            logger.warning("deleted while %s could not be told to unload it for %s s or more (--unload-grace: its "
                           "sidecar did not answer, or it was not ready and what it accepted was not known); each is "
                           "told its pool's adapters, which leave this one out, once it can be",
                           ", ".join(wait.given_up), config.unload_grace)

    return controllers
