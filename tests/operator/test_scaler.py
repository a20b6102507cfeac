"""One autoscaler pass (PoolScaler) with scripted metrics and Deployment doubles and a test clock: what it
patches, what it writes in status, and what it leaves alone when something fails."""

from __future__ import annotations

import copy

import pytest

from lorafleet.operator.deployments import KubeError, TargetNotFound
from lorafleet.operator.pinned_need import NO_PINNED, PinnedNeed
from lorafleet.operator.prometheus import MetricsError
from lorafleet.operator.prometheus_allowlist import PrometheusAllowlist
from lorafleet.operator.scaler import MAX_READY_WAIT, PoolScaler
from lorafleet.operator.status_patches import merge_conditions

NOW = "2026-01-01T00:00:00Z"
PROM = "http://prometheus:9090"


class Metrics:
    def __init__(self) -> None:
        # (hit rate, KV usage) or (hit rate, KV usage, requests waiting per worker), or what to raise. With the two,
        # no request waits where the KV gauge is there (workers export both): a queue unknown holds scale-downs.
        self.signals: tuple[float | None, ...] | Exception = (None, None)
        self.asked: list[list[str]] = []
        self.windows: list[int] = []
        self.scraped_error: Exception | None = None  # what the query for pods' first series raises

    async def pool_signals(self, url: str, namespace: str, pods: list[str], *, rate_window_seconds: int):
        assert (url, namespace) == (PROM, "ns")
        self.asked.append(pods)
        self.windows.append(rate_window_seconds)
        if isinstance(self.signals, Exception):
            raise self.signals
        if len(self.signals) == 2:
            return (*self.signals, None if self.signals[1] is None else 0.0)
        return self.signals

    async def scraped_pods(self, url: str, namespace: str, pods: list[str]) -> set[str]:
        if self.scraped_error is not None:
            raise self.scraped_error
        return set(pods)

    async def close(self) -> None:
        pass


class Deployments:
    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.patches: list[int] = []
        self.get_error: Exception | None = None
        self.patch_error: Exception | None = None
        self.autoscalers: list[str] | None | Exception = []  # HPAs scaling the target (None: cannot tell)
        self.calls: list[tuple[str, int | None]] = []  # ("replicas", n) and (pod, deletion cost), in order
        self.cost_error: Exception | dict[str, Exception] | None = None  # a dict: pod -> its error

    async def get_replicas(self, namespace: str, name: str) -> int:
        assert (namespace, name) == ("ns", "workers")
        if self.get_error:
            raise self.get_error
        return self.replicas

    async def autoscalers_of(self, namespace: str, name: str) -> list[str] | None:
        assert (namespace, name) == ("ns", "workers")
        if isinstance(self.autoscalers, Exception):
            raise self.autoscalers
        return self.autoscalers

    async def set_replicas(self, namespace: str, name: str, replicas: int) -> None:
        if self.patch_error:
            raise self.patch_error
        self.patches.append(replicas)
        self.calls.append(("replicas", replicas))
        self.replicas = replicas

    async def set_deletion_cost(self, namespace: str, pod: str, cost: int | None) -> None:
        error = self.cost_error.get(pod) if isinstance(self.cost_error, dict) else self.cost_error
        if error:
            raise error
        self.calls.append((pod, cost))

    async def close(self) -> None:
        pass


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, ready: bool = True, since: str | None = None) -> dict:
    ready_condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": name, "labels": {"app": "w"}},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [ready_condition | ({"lastTransitionTime": since} if since else {})]}}


def pool(status: dict | None = None, **scaling) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "generation": 1},
            "spec": {"baseModel": "m", "workerSelector": {"matchLabels": {"app": "w"}},
                     "scaling": {"target": "workers", "prometheusURL": PROM, "maxReplicas": 6,
                                 "scaleDownStabilizationSeconds": 0, **scaling}},
            "status": status or {}}


@pytest.fixture()
def setup():
    metrics, deployments, clock = Metrics(), Deployments(2), Clock()
    scaler = PoolScaler(metrics, deployments, allowed=PrometheusAllowlist([PROM]), clock=clock)
    return scaler, metrics, deployments, clock


async def tick(scaler: PoolScaler, body: dict, pods: list[dict], replicasets: list[dict] = (),
               pinned: PinnedNeed | None = NO_PINNED, costs: dict[str, int | None] | None = None) -> dict:
    """One pass; the wanted keys are applied to ``body``'s status the way a merge patch would."""
    wanted = await scaler.run(copy.deepcopy(body), pods=pods, other_pools=[], replicasets=replicasets, pinned=pinned,
                              costs=costs, now=NOW)
    for key, value in wanted.items():
        if value is None:
            body["status"].pop(key, None)
        else:
            body["status"][key] = value
    return body["status"]


def scaling_condition(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Scaling")


async def test_high_kv_scales_up_in_proportion_then_waits_for_the_new_workers(setup):
    scaler, metrics, deployments, _ = setup
    metrics.signals = (0.95, 0.95)
    body = pool(kvHigh=0.6)
    pods = [pod("w-1"), pod("w-0"), pod("w-2", ready=False)]
    st = await tick(scaler, body, pods)
    assert deployments.patches == [4] and metrics.asked == [["w-0", "w-1"]]  # ready pods only
    assert (st["desiredReplicas"], st["hitRate"], st["kvUsage"], st["lastScaleTime"]) == (4, 0.95, 0.95, NOW)
    cond = scaling_condition(st)
    assert (cond["status"], cond["reason"]) == ("True", "ScaledUp")
    assert cond["message"].startswith("2 -> 4 replicas: KV usage 0.95 > kvHigh 0.6; KV usage 0.95 (kvLow 0.3")
    # Two of four replicas are ready workers: the metrics do not show the new ones' share yet.
    st = await tick(scaler, body, pods)
    assert deployments.patches == [4] and st["desiredReplicas"] == 4
    cond = scaling_condition(st)
    assert cond["reason"] == "Steady" and "only 2 of 4 replicas are ready workers" in cond["message"]
    pods = [pod(f"w-{i}") for i in range(4)]
    st = await tick(scaler, body, pods)
    assert deployments.patches == [4, 6] and scaling_condition(st)["reason"] == "ScaledUp"
    assert metrics.windows == [120, 120, 120]  # the hit rate's default window


def made(name: str, rs: str, uid: str, ready: bool = True) -> dict:
    """A pod of ReplicaSet ``rs``."""
    p = pod(name, ready)
    p["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": rs, "uid": uid, "controller": True}]
    return p


async def test_a_pool_over_several_deployments_scales_its_target_by_what_the_whole_pool_needs(setup):
    """A pool naming no workerDeployment reaches the pods of every Deployment its selector matches (one per GPU
    type, say), and scales one. The others' 3 ready workers share the load: 5 workers at KV 0.95 need 8 at
    kvHigh 0.6, so the target goes 2 -> 5 (not 2 -> 4 as if it alone served); and its new replicas are waited
    for as its own (it does not count the others' ready pods as its replicas and scale again at once)."""
    scaler, metrics, deployments, _ = setup
    metrics.signals = (0.95, 0.95)
    body = pool(kvHigh=0.6, maxReplicas=12)
    replicasets = [{"name": "workers-1", "uid": "u1", "deployment": "workers"},
                   {"name": "a100-1", "uid": "u2", "deployment": "workers-a100"}]
    pods = [made("w-0", "workers-1", "u1"), made("w-1", "workers-1", "u1")]
    pods += [made(f"a-{i}", "a100-1", "u2") for i in range(3)]
    st = await tick(scaler, body, pods, replicasets)
    assert deployments.patches == [5]
    assert scaling_condition(st)["message"].startswith("2 -> 5 replicas: KV usage 0.95 > kvHigh 0.6; 3 ready workers")
    pods += [made(f"w-{i}", "workers-1", "u1", ready=False) for i in range(2, 5)]
    st = await tick(scaler, body, pods, replicasets)
    assert deployments.patches == [5]
    assert "only 2 of 5 replicas are ready workers" in scaling_condition(st)["message"]
    # Low load: one fewer target replica, with the others' workers still serving (5 -> 4), never below them.
    metrics.signals = (0.95, 0.1)
    pods = [made(f"w-{i}", "workers-1", "u1") for i in range(5)] + pods[2:5]
    await tick(scaler, body, pods, replicasets)
    assert deployments.patches == [5, 4]


async def test_a_target_at_zero_beside_other_deployments_wakes_only_when_they_need_more_workers(setup):
    """minReplicas 0, the target at 0, the pool's other Deployment serving: its light load (KV 0.02, hit rate 1)
    is no demand for the target, which stayed at 1 for good after any request (nothing scales it back to 0); a
    load its 3 workers cannot hold (KV 0.95 at kvHigh 0.6: 5 needed) wakes it with the 2 missing."""
    scaler, metrics, deployments, _ = setup
    body = pool(minReplicas=0, kvHigh=0.6)
    replicasets = [{"name": "a100-1", "uid": "u2", "deployment": "workers-a100"}]
    pods = [made(f"a-{i}", "a100-1", "u2") for i in range(3)]
    deployments.replicas = 0
    metrics.signals = (1.0, 0.02, 0.0)
    st = await tick(scaler, body, pods, replicasets)
    assert deployments.patches == [] and scaling_condition(st)["reason"] == "Steady"
    assert "the target stays at 0 until they need more" in scaling_condition(st)["message"]
    metrics.signals = (1.0, 0.95, 0.0)
    st = await tick(scaler, body, pods, replicasets)
    assert deployments.patches == [2] and scaling_condition(st)["reason"] == "ScaledUp"


async def test_the_hit_rate_window_is_the_pools(setup):
    scaler, metrics, _, _ = setup
    metrics.signals = (0.95, 0.5)
    await tick(scaler, pool(rateWindowSeconds=600), [pod("w-0"), pod("w-1")])
    assert metrics.windows == [600]


async def test_scale_down_waits_for_the_window_and_an_unknown_hit_rate_holds(setup):
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 3
    body, pods = pool(scaleDownStabilizationSeconds=60), [pod("w-0"), pod("w-1"), pod("w-2")]
    metrics.signals = (None, 0.2)  # no traffic yet: no hit rate
    st = await tick(scaler, body, pods)
    assert deployments.patches == [] and st["desiredReplicas"] == 3 and "hitRate" not in st
    assert scaling_condition(st)["reason"] == "Steady"
    metrics.signals = (0.99, 0.1)
    clock.now += 30
    st = await tick(scaler, body, pods)
    assert deployments.patches == [] and "held at 3 by the 60 s scale-down" in scaling_condition(st)["message"]
    clock.now += 30  # a whole window watched since the first pass
    st = await tick(scaler, body, pods)
    assert deployments.patches == [2] and scaling_condition(st)["reason"] == "ScaledDown"
    assert st["kvUsage"] == 0.1 and st["hitRate"] == 0.99


async def test_out_of_bounds_is_corrected_without_asking_prometheus(setup):
    scaler, metrics, deployments, _ = setup
    deployments.replicas = 9
    metrics.signals = MetricsError("down")
    st = await tick(scaler, pool(), [pod("w-0")])
    assert deployments.patches == [6] and metrics.asked == []
    assert scaling_condition(st)["message"] == "9 -> 6 replicas: 9 replicas is above maxReplicas 6"
    deployments.replicas = 0  # scaled to zero by hand: left alone, as HPA does
    st = await tick(scaler, pool(), [pod("w-0")])
    assert deployments.patches == [6] and scaling_condition(st)["reason"] == "Steady"


@pytest.mark.parametrize(("fail", "reason", "message"), [
    ("metrics", "MetricsUnavailable", "spec.scaling.prometheusURL: down; replicas stay at 2"),
    ("get", "FailedGetScale", "spec.scaling.target: HTTP 403: forbidden"),
    ("missing", "TargetNotFound", "spec.scaling.target: Deployment 'workers' not found in namespace 'ns'"),
    ("patch", "FailedUpdateScale", "spec.scaling.target: HTTP 409: conflict; replicas stay at 2"),
])
async def test_failures_are_a_false_condition_and_change_nothing(setup, fail, reason, message):
    scaler, metrics, deployments, _ = setup
    metrics.signals = MetricsError("down") if fail == "metrics" else (0.95, 0.99)
    deployments.get_error = {"get": KubeError("HTTP 403: forbidden", 403),
                             "missing": TargetNotFound("Deployment 'workers' not found in namespace 'ns'", 404)
                             }.get(fail)
    if fail == "patch":
        deployments.patch_error = KubeError("HTTP 409: conflict", 409)
    before = {"hitRate": 0.5, "kvUsage": 0.4, "desiredReplicas": 2, "lastScaleTime": "2025-12-31T00:00:00Z"}
    st = await tick(scaler, pool(status=dict(before)), [pod("w-0"), pod("w-1")])
    cond = scaling_condition(st)
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", reason, message)
    assert deployments.replicas == 2 and deployments.patches == []
    assert {k: st[k] for k in before} == before  # the last known values stay


async def test_an_invalid_spec_is_named_and_removing_scaling_clears_its_status(setup):
    scaler, _, deployments, _ = setup
    ready = {"type": "Ready", "status": "True", "reason": "Workers", "message": "2 ready workers",
             "lastTransitionTime": NOW}
    body = pool(status={"conditions": [ready], "kvUsage": 0.3}, kvLow=0.9)
    st = await tick(scaler, body, [])
    assert st["conditions"][0] == ready  # the reconcile's condition is kept as it is
    cond = scaling_condition(st)
    assert (cond["status"], cond["reason"]) == ("False", "InvalidSpec")
    assert cond["message"].startswith("spec.scaling.kvLow: 0.9 must be below spec.scaling.kvHigh")
    body["spec"]["scaling"]["kvLow"] = 0.3
    st = await tick(scaler, body, [])
    assert st["desiredReplicas"] == 2 and [c["type"] for c in st["conditions"]] == ["Ready", "Scaling"]
    assert "kvUsage" not in st  # no workers: unknown
    del body["spec"]["scaling"]
    body["status"]["kvUsage"] = 0.3  # the reconcile's, once spec.scaling is gone
    st = await tick(scaler, body, [])
    assert st == {"conditions": [ready], "kvUsage": 0.3}  # kvUsage: the reconcile's again
    assert deployments.patches == []


def test_merge_conditions_keeps_the_other_writers_types():
    ready, scaling = {"type": "Ready", "status": "True"}, {"type": "Scaling", "status": "True"}
    new_ready = {"type": "Ready", "status": "False"}
    assert merge_conditions({"conditions": [ready, scaling]}, {"conditions": [new_ready], "adapters": 1}) == {
        "conditions": [new_ready, scaling], "adapters": 1}
    assert merge_conditions({"conditions": [scaling]}, {"conditions": [new_ready]}) == {
        "conditions": [scaling, new_ready]}
    assert merge_conditions({"conditions": [ready, scaling]}, {}, drop=["Scaling"]) == {"conditions": [ready]}
    assert merge_conditions(None, {"readyWorkers": 1}) == {"readyWorkers": 1}
    # Nothing to drop: the list is not written at all (a new pool without spec.scaling).
    assert merge_conditions({}, {"hitRate": None}, drop=["Scaling"]) == {"hitRate": None}
    assert merge_conditions({"conditions": [ready]}, {}, drop=["Scaling"]) == {}


async def test_replicas_that_never_become_ready_hold_a_scale_up_for_a_bounded_time(setup):
    """A replica stuck unready (unschedulable, crash-looping) must not hold every scale-up forever."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 3
    metrics.signals = (0.95, 0.99)
    body, pods = pool(), [pod("w-0"), pod("w-1"), pod("w-2", ready=False)]
    st = await tick(scaler, body, pods)
    assert deployments.patches == [] and "only 2 of 3 replicas are ready workers" in scaling_condition(st)["message"]
    clock.now += MAX_READY_WAIT - 1
    await tick(scaler, body, pods)
    assert deployments.patches == []
    clock.now += 1
    st = await tick(scaler, body, pods)
    assert deployments.patches == [4]  # ceil(3 * 0.99 / 0.85)
    assert f"1 of 3 replicas not ready workers for over {MAX_READY_WAIT:g} s (w-2): not waiting for them" in scaling_condition(st)["message"]
    # The new replica gets its own wait (it is not ready yet either).
    clock.now += 30
    st = await tick(scaler, body, pods)
    assert deployments.patches == [4] and "only 2 of 4 replicas are ready workers" in scaling_condition(st)["message"]
    clock.now += MAX_READY_WAIT
    await tick(scaler, body, pods)
    assert deployments.patches == [4, 5]
    # Ready again: a later shortfall waits afresh.
    await tick(scaler, body, [pod(f"w-{i}") for i in range(5)])
    assert deployments.patches == [4, 5, 6]
    await tick(scaler, body, [pod(f"w-{i}") for i in range(5)])
    assert deployments.patches == [4, 5, 6]


async def test_a_replica_stuck_unready_makes_later_scale_ups_wait_only_for_their_own_replicas(setup):
    """Waited for in full once, a stuck replica does not restart the wait at every later count: a load spike
    would otherwise take one step per ten minutes while one pod is unschedulable."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 3
    metrics.signals = (0.95, 0.99)
    body, stuck = pool(), pod("w-2", ready=False)
    await tick(scaler, body, [pod("w-0"), pod("w-1"), stuck])
    clock.now += MAX_READY_WAIT
    await tick(scaler, body, [pod("w-0"), pod("w-1"), stuck])
    assert deployments.patches == [4]
    clock.now += 60  # the new replica is ready; the stuck one still is not
    st = await tick(scaler, body, [pod("w-0"), pod("w-1"), stuck, pod("w-3")])
    assert deployments.patches == [4, 5]  # ceil(4 * 0.99 / 0.85)
    assert f"1 of 4 replicas not ready workers for over {MAX_READY_WAIT:g} s" in scaling_condition(st)["message"]
    # Its newest replica is not ready yet: that one is waited for, also once the stuck one recovers, and so is
    # a pod that replaces the stuck one.
    clock.now += 60
    st = await tick(scaler, body, [pod("w-0"), pod("w-1"), stuck, pod("w-3"), pod("w-4", ready=False)])
    assert deployments.patches == [4, 5] and "only 3 of 5 replicas are ready workers" in scaling_condition(st)["message"]
    clock.now += 60
    await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2"), pod("w-3"), pod("w-4", ready=False)])
    assert deployments.patches == [4, 5]
    clock.now += MAX_READY_WAIT
    await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2"), pod("w-3"), pod("w-4")])
    assert deployments.patches == [4, 5, 6]



async def test_a_pod_replacing_a_stuck_one_is_waited_for(setup):
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 3
    metrics.signals = (0.95, 0.99)
    body = pool()
    await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2", ready=False)])
    clock.now += MAX_READY_WAIT
    await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2", ready=False)])
    assert deployments.patches == [4]
    clock.now += 60  # w-2 deleted; its replacement starts, and the replica added is ready
    st = await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-3"), pod("w-5", ready=False)])
    assert deployments.patches == [4] and "only 3 of 4 replicas are ready workers" in scaling_condition(st)["message"]


async def test_pods_that_are_no_replicas_are_never_taken_for_stuck_ones(setup):
    """An evicted pod (Failed until deleted) or one terminating is no replica: remembered as stuck, it let a
    new replica go unwaited for."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 3
    metrics.signals = (0.95, 0.99)
    evicted, leaving = pod("w-old", ready=False), pod("w-gone", ready=False)
    evicted["status"]["phase"] = "Failed"
    leaving["metadata"]["deletionTimestamp"] = NOW
    body, others = pool(), [evicted, leaving]
    await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2", ready=False), *others])
    clock.now += MAX_READY_WAIT
    st = await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2", ready=False), *others])
    assert deployments.patches == [4] and "(w-2): not waiting" in scaling_condition(st)["message"]
    clock.now += 60  # w-2 recovers; the replica added is starting
    await tick(scaler, body, [pod("w-0"), pod("w-1"), pod("w-2"), pod("w-3", ready=False), *others])
    assert deployments.patches == [4]


async def test_signals_that_turn_unknown_leave_the_status_without_the_old_figures(setup):
    """The Scaling condition says "unknown": the status columns must not show the figures of an hour ago."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 2
    body, pods = pool(), [pod("w-0"), pod("w-1")]
    metrics.signals = (0.42, 0.5)
    st = await tick(scaler, body, pods)
    assert (st["hitRate"], st["kvUsage"]) == (0.42, 0.5)
    metrics.signals = (None, None)
    clock.now += 3600
    st = await tick(scaler, body, pods)
    assert "hitRate" not in st and "kvUsage" not in st and scaling_condition(st)["reason"] == "MetricsMissing"


async def test_ready_workers_without_series_are_a_scrape_to_fix_not_a_steady_pool(setup):
    """Workers export their KV and queue gauges from their first scrape: ready workers Prometheus has neither
    of are not scraped (a Prometheus Operator ignores the pods' annotations), or not under the labels the
    queries select by. The pool said Steady while overloaded workers were never scaled."""
    scaler, metrics, deployments, _ = setup
    deployments.replicas = 2
    metrics.signals = (None, None, None)
    st = await tick(scaler, pool(), [pod("w-0"), pod("w-1")])
    cond = scaling_condition(st)
    assert (cond["status"], cond["reason"]) == ("False", "MetricsMissing") and deployments.patches == []
    assert "lorafleet_kv_cache_usage_ratio" in cond["message"] and "namespace='ns'" in cond["message"]
    assert "w-0, w-1" in cond["message"] and "metrics.serviceMonitor.enabled=true" in cond["message"]
    assert st["desiredReplicas"] == 2 and "kvUsage" not in st
    metrics.signals = (None, None, None)  # no ready worker: nothing to scrape yet, nothing missing
    st = await tick(scaler, pool(), [pod("w-0", ready=False)])
    assert scaling_condition(st)["reason"] == "Steady"
    metrics.signals = (None, None, 0.0)  # the queue gauge alone is enough to know the scrape works
    st = await tick(scaler, pool(), [pod("w-0"), pod("w-1")])
    assert scaling_condition(st)["reason"] == "Steady"


async def test_workers_just_ready_are_not_yet_a_scrape_to_fix(setup):
    """A worker ready for seconds may not have been scraped yet (Prometheus scrapes every 15-60 s): every new
    pool, and every pool whose workers all restarted, said MetricsMissing for its first passes."""
    scaler, metrics, deployments, _ = setup
    deployments.replicas = 2
    metrics.signals = (None, None, None)
    st = await tick(scaler, pool(), [pod("w-0", since="2025-12-31T23:59:30Z"), pod("w-1", since=NOW)])
    assert scaling_condition(st)["reason"] == "Steady" and deployments.patches == []
    st = await tick(scaler, pool(), [pod("w-0", since="2025-12-31T23:57:00Z"), pod("w-1", since=NOW)])
    assert scaling_condition(st)["reason"] == "MetricsMissing"


async def test_the_scaling_condition_goes_into_the_status_as_it_is_after_the_pass(setup):
    """The reconcile writes Ready while a pass waits for Prometheus: the pass must not put the Ready it read
    at its start back (a merge patch replaces the conditions list whole)."""
    scaler, metrics, _, _ = setup
    old_ready = {"type": "Ready", "status": "True", "reason": "Workers", "message": "2 ready workers",
                 "lastTransitionTime": NOW}
    new_ready = {**old_ready, "status": "False", "reason": "NoWorkers", "message": "0 ready workers"}
    body = pool(status={"conditions": [old_ready]})
    live = copy.deepcopy(body["status"])

    async def reconcile_writes(url: str, namespace: str, pods: list[str], **_):
        live["conditions"] = [new_ready]
        return 0.95, 0.5

    metrics.pool_signals = reconcile_writes
    wanted = await scaler.run(copy.deepcopy(body), status=live, pods=[pod("w-0"), pod("w-1")], other_pools=[],
                              now=NOW)
    assert [c for c in wanted["conditions"] if c["type"] == "Ready"] == [new_ready]
    assert scaling_condition(wanted)["reason"] == "Steady"


async def test_memory_of_pools_that_are_gone_is_dropped(setup):
    """Pools deleted while this replica stood by (or whose pass ended after the finalizer) leave nothing."""
    scaler, metrics, _, _ = setup
    metrics.signals = (0.95, 0.5)
    for name in ("p", "q"):
        body = pool()
        body["metadata"]["name"] = name
        await scaler.run(body, pods=[pod("w-0")], other_pools=[], now=NOW)
    assert set(scaler.known_pools()) == {("ns", "p"), ("ns", "q")}
    scaler.retain({("ns", "q")})
    assert set(scaler.known_pools()) == {("ns", "q")}


async def test_ready_pods_another_pool_owns_do_not_hold_a_scale_up(setup):
    """An earlier pool (here one whose spec is invalid: it keeps the pods it selects) owns one of the two
    replicas: that pod will never be this pool's worker, so a scale-up does not wait for it to become one,
    and the condition says where it went."""
    scaler, metrics, deployments, _ = setup
    metrics.signals = (0.95, 0.99)
    earlier = pool()
    earlier["metadata"]["name"] = "a-earlier"
    earlier["spec"] = {**earlier["spec"], "workerSelector": {"matchLabels": {"gpu": "h200"}}, "eviction": "fifo"}
    taken = pod("w-1")
    taken["metadata"]["labels"]["gpu"] = "h200"
    wanted = await scaler.run(pool(), pods=[pod("w-0"), taken], other_pools=[earlier], now=NOW)
    assert deployments.patches == [3] and metrics.asked == [["w-0"]]  # ceil(2 * 0.99 / 0.85); its own pod only
    message = scaling_condition(wanted)["message"]
    assert "1 ready pods spec.workerSelector matches belong to LoRAPool a-earlier" in message, message


async def test_a_saturated_pool_with_little_kv_in_use_scales_up(setup):
    """Workers at max_num_seqs with a large KV pool: requests queue (and get 429 queue_full) while KV usage
    stays under kvLow. The queue scales the pool up; it is never taken for an idle pool."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 4
    metrics.signals = (0.95, 0.121, 3.0)
    body = pool(maxReplicas=8)
    st = await tick(scaler, body, [pod(f"w-{i}") for i in range(4)])
    assert deployments.patches == [6]  # ceil(4 * 3 / waitingHigh 2)
    message = scaling_condition(st)["message"]
    assert message.startswith("4 -> 6 replicas: 3 requests waiting per worker > waitingHigh 2"), message
    assert "requests waiting per worker 3 (waitingHigh 2)" in message
    metrics.signals = (0.95, 0.121, 1.2)  # the new workers drain the queue, some requests still wait
    for _ in range(3):
        clock.now += 30
        st = await tick(scaler, body, [pod(f"w-{i}") for i in range(6)])
    assert deployments.patches == [6] and "no scale-down while requests wait" in scaling_condition(st)["message"]


async def test_a_low_hit_rate_on_an_idle_pool_does_not_pin_max_replicas(setup):
    """Sparse long-tail traffic: GPU hit rate 0.5 with KV usage 0.05. More replicas hold no more adapters
    each, so the pool is not scaled up for the hit rate, and kvLow scales it down."""
    scaler, metrics, deployments, clock = setup
    metrics.signals = (0.5, 0.05)
    body = pool(minReplicas=1, scaleDownStabilizationSeconds=300)
    for _ in range(20):
        st = await tick(scaler, body, [pod(f"w-{i}") for i in range(deployments.replicas)])
        clock.now += 30
    assert deployments.patches == [1] and deployments.replicas == 1
    message = scaling_condition(st)["message"]
    assert "GPU hit rate 0.5 < targetHitRate 0.9, but no load pressure" in message, message


async def test_an_idle_pool_keeps_the_workers_its_pinned_adapters_need(setup):
    """Idle, the pool goes down to minReplicas, one replica a pass: not below the workers whose GPU adapter slots
    hold its pinned adapters (the reconcile's count), nor down at all while that count is not known."""
    scaler, metrics, deployments, _ = setup
    deployments.replicas = 4
    metrics.signals = (0.99, 0.05)
    body = pool(minReplicas=1)

    async def settle(pinned: PinnedNeed | None) -> dict:
        for _ in range(4):
            st = await tick(scaler, body, [pod(f"w-{i}") for i in range(deployments.replicas)], pinned=pinned)
        return scaling_condition(st)

    cond = await settle(None)
    assert deployments.patches == [] and cond["reason"] == "Steady"
    assert "; held at 4: the workers the pool's pinned adapters need are not counted yet" in cond["message"]
    cond = await settle(PinnedNeed(3, 2))
    assert deployments.patches == [3, 2] and cond["reason"] == "Steady"
    assert cond["message"].startswith("2 replicas: KV usage 0.05 < kvLow 0.3; held at 2: 3 pinned adapters need 2 "
                                      "workers; KV usage 0.05"), cond["message"]
    await settle(PinnedNeed(1, 1))  # one pinned adapter left
    assert deployments.patches == [3, 2, 1]
    # Pins that need more workers than maxReplicas: raised to maxReplicas, and no further.
    cond = await settle(PinnedNeed(9, None))
    assert deployments.patches == [3, 2, 1, 6] and cond["reason"] == "Steady"
    assert "held at maxReplicas 6: 9 pinned adapters need more than 6 workers, more than maxReplicas allows" \
        in cond["message"], cond["message"]


async def test_a_deployment_another_autoscaler_scales_is_left_to_it(setup):
    """An HPA (or KEDA's, made for a ScaledObject) scaling the pool's target: each pass set the replicas back
    and the HPA undid them, so the count flapped between the two. The pool says so and leaves them; a list it
    may not make, or one that fails, scales as before."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 2
    metrics.signals = (0.5, 0.95)  # KV pressure: a scale-up
    deployments.autoscalers = ["keda-hpa-workers"]
    st = await tick(scaler, pool(), [pod("w-0"), pod("w-1")])
    cond = scaling_condition(st)
    assert (cond["status"], cond["reason"]) == ("False", "ConflictingAutoscaler") and deployments.patches == []
    assert "keda-hpa-workers" in cond["message"] and "replicas stay at 2" in cond["message"]
    for cannot_tell in (None, KubeError("list horizontalpodautoscalers: HTTP 500: boom", 500)):
        deployments.autoscalers = cannot_tell
        clock.now += 600
        st = await tick(scaler, pool(), [pod("w-0"), pod("w-1")])
        assert scaling_condition(st)["reason"] != "ConflictingAutoscaler"
    assert deployments.patches, "scaled once nothing else scales it"


@pytest.mark.parametrize("rank_pods", [True, False])
async def test_a_scale_down_first_ranks_the_pods_holding_pinned_copies_to_go_last(rank_pods):
    """Lowering spec.replicas leaves the choice of pods to the ReplicaSet: the newest ready ones, here w-2, which
    holds the only copy of a pinned adapter. With --rank-pods the pods' deletion costs are set first from the
    last plan (w-2's pinned copy, w-1's warm one); a cost someone else set (w-0's, unmarked) is left as it is,
    and one the operator set on a pod that now holds nothing would be removed."""
    from lorafleet.operator.deletion_cost import DELETION_COST, MARK

    metrics, deployments = Metrics(), Deployments(3)
    scaler = PoolScaler(metrics, deployments, allowed=PrometheusAllowlist([PROM]), clock=Clock(), rank_pods=rank_pods)
    metrics.signals = (0.99, 0.1, 0.0)
    pods = [pod("w-0", since="2025-12-01T00:00:00Z"), pod("w-1", since="2025-12-01T00:00:00Z"),
            pod("w-2", since="2025-12-31T23:00:00Z"), pod("w-3", ready=False)]
    pods[0]["metadata"]["annotations"] = {DELETION_COST: "-5"}
    pods[3]["metadata"]["annotations"] = {DELETION_COST: "1", MARK: "1"}
    # b-0: a pod of another pool (one naming no workerDeployment sees the namespace's), ranked by that one's plan.
    pods.append({"metadata": {"name": "b-0", "labels": {"app": "b"}, "annotations": {DELETION_COST: "1000",
                                                                                      MARK: "1000"}}})
    status = await tick(scaler, pool(), pods, pinned=PinnedNeed(1, 1),
                        costs={"w-0": 1, "w-1": 1, "w-2": 1000, "w-3": None})
    assert deployments.patches == [2]
    if rank_pods:
        assert deployments.calls == [("w-1", 1), ("w-2", 1000), ("w-3", None), ("replicas", 2)]
    else:
        assert deployments.calls == [("replicas", 2)]
    assert status["conditions"][0]["reason"] == "ScaledDown"


async def test_a_scale_down_before_the_first_plan_leaves_the_costs_as_they_are():
    """A new operator corrects a count above maxReplicas at once, before its first reconcile pass: with no plan,
    no pod is known to hold nothing, and the costs set before (the pinned holder's) stay for the ReplicaSet."""
    from lorafleet.operator.deletion_cost import DELETION_COST, MARK, deletion_costs

    deployments = Deployments(8)
    scaler = PoolScaler(Metrics(), deployments, allowed=PrometheusAllowlist([PROM]), clock=Clock(), rank_pods=True)
    pods = [pod(f"w-{i}") for i in range(8)]
    pods[3]["metadata"]["annotations"] = {DELETION_COST: "1000", MARK: "1000"}
    status = await tick(scaler, pool(), pods, pinned=None, costs=deletion_costs(None))
    assert deployments.calls == [("replicas", 6)]
    assert "not ranked again for the scale-down" in status["conditions"][0]["message"]


async def test_pods_the_api_server_will_not_rank_still_scale_down_with_a_note():
    metrics, deployments = Metrics(), Deployments(3)
    scaler = PoolScaler(metrics, deployments, allowed=PrometheusAllowlist([PROM]), clock=Clock(), rank_pods=True)
    metrics.signals = (0.99, 0.1, 0.0)
    deployments.cost_error = KubeError("PATCH pods/w-2 in namespace ns: HTTP 403: forbidden", 403)
    status = await tick(scaler, pool(), [pod(f"w-{i}") for i in range(3)], costs={"w-2": 1000})
    cond = status["conditions"][0]
    assert deployments.patches == [2] and cond["reason"] == "ScaledDown"
    assert "the pods were not ranked for the scale-down" in cond["message"] and "HTTP 403" in cond["message"]


async def test_a_pod_gone_since_the_index_was_read_leaves_the_others_ranked():
    metrics, deployments = Metrics(), Deployments(3)
    scaler = PoolScaler(metrics, deployments, allowed=PrometheusAllowlist([PROM]), clock=Clock(), rank_pods=True)
    metrics.signals = (0.99, 0.1, 0.0)
    deployments.cost_error = {"w-0": KubeError("PATCH pods/w-0 in namespace ns: HTTP 404: not found", 404)}
    status = await tick(scaler, pool(), [pod(f"w-{i}") for i in range(3)], costs={"w-0": 1, "w-1": 1, "w-2": 1000})
    cond = status["conditions"][0]
    assert deployments.calls == [("w-1", 1), ("w-2", 1000), ("replicas", 2)] and cond["reason"] == "ScaledDown"
    assert "not ranked" not in cond["message"]


@pytest.mark.parametrize("signals", [MetricsError("http://prometheus:9090/api/v1/query: no answer within 5 s"),
                                     (None, None)], ids=["prometheus-down", "series-missing"])
async def test_fewer_workers_than_the_pinned_adapters_need_are_raised_without_metrics(setup, signals):
    """The pinned floor, like the bounds, does not wait for Prometheus: a pool whose pinned adapters need two
    workers, at one, is raised to two while the metrics cannot be read (and only to the floor: no recommendation
    is made from metrics it does not have); at the floor, the pass changes nothing and says why."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 1
    metrics.signals = signals
    st = await tick(scaler, pool(), [pod("w-0")], pinned=PinnedNeed(2, 2))
    cond = scaling_condition(st)
    assert deployments.patches == [2] and cond["reason"] == "ScaledUp", cond
    assert "raised to 2: 2 pinned adapters need 2 workers" in cond["message"]
    assert "metrics unavailable" in cond["message"] or "metrics missing" in cond["message"]
    clock.now += 600
    st = await tick(scaler, pool(), [pod("w-0"), pod("w-1")], pinned=PinnedNeed(2, 2))
    cond = scaling_condition(st)
    assert deployments.patches == [2] and cond["status"] == "False"
    assert cond["reason"] in ("MetricsUnavailable", "MetricsMissing")


async def test_a_failed_scrape_query_still_raises_a_pool_to_its_pinned_floor(setup):
    """The pool's signals read, but the query for the new pods' first series fails: the pass still raises a pool
    below its pinned adapters' need to it (and no further), as when the signals cannot be read."""
    scaler, metrics, deployments, clock = setup
    deployments.replicas = 1
    metrics.signals = (0.5, 0.95)  # KV pressure: a scale-up is recommended
    metrics.scraped_error = MetricsError("http://prometheus:9090/api/v1/query: no answer within 5 s")
    fresh = pod("w-0", since=NOW)  # ready just now: the scale-up asks whether it was scraped
    st = await tick(scaler, pool(), [fresh], pinned=PinnedNeed(3, 3))
    cond = scaling_condition(st)
    assert deployments.patches == [3] and cond["reason"] == "ScaledUp", cond
    assert "metrics unavailable" in cond["message"] and "raised to 3" in cond["message"]
