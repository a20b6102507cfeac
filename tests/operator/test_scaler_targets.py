"""Which Deployment a pool's autoscaler scales: only its workers' (spec.workerDeployment), and one that two pools
target only by the first by name that can scale it."""

from __future__ import annotations

import copy

import pytest

from .test_scaler import NOW, pod, pool, scaling_condition, setup, tick  # noqa: F401  (fixtures)


async def test_a_deployment_two_pools_scale_is_scaled_by_the_first_by_name(setup):  # noqa: F811
    """Two pools with one target would undo each other's replicas every pass (e.g. different bounds)."""
    scaler, metrics, deployments, _ = setup
    deployments.replicas = 9
    body, other = pool(), pool(maxReplicas=9)
    other["metadata"]["name"] = "a-first"
    wanted = await scaler.run(copy.deepcopy(body), pods=[pod("w-0")], other_pools=[other], now=NOW)
    cond = scaling_condition(wanted)
    assert (cond["status"], cond["reason"]) == ("False", "AmbiguousTarget")
    assert cond["message"] == ("spec.scaling.target: Deployment 'workers' is also the target of LoRAPool 'a-first', "
                               "which scales it (the first by name); give each pool its own Deployment")
    assert deployments.patches == [] and metrics.asked == []
    # Another target, a deleting pool, a pool after this one by name, or one that scales nothing (its spec
    # does not parse): no conflict.
    for rival in [{**other, "spec": {**other["spec"], "scaling": {**other["spec"]["scaling"], "target": "others"}}},
                  {**other, "metadata": {**other["metadata"], "deletionTimestamp": NOW}},
                  {**other, "metadata": {**other["metadata"], "name": "z-last"}},
                  {**other, "spec": {**other["spec"], "scaling": {**other["spec"]["scaling"], "kvLow": 0.9}}}]:
        wanted = await scaler.run(copy.deepcopy(body), pods=[pod("w-0")], other_pools=[rival], now=NOW)
        assert scaling_condition(wanted)["reason"] != "AmbiguousTarget"


async def test_a_pool_scales_only_the_deployment_of_its_workers(setup):  # noqa: F811
    """spec.scaling.target may name any Deployment of the namespace: a pool that names its workers' Deployment
    (spec.workerDeployment, the only one whose pods it reaches) scales that one only, so that whoever may edit
    a pool cannot use the operator's scale permission on the namespace's other Deployments."""
    scaler, metrics, deployments, _ = setup
    deployments.replicas = 9  # out of bounds: corrected at once, without metrics, were it the target
    body = pool()
    body["spec"]["workerDeployment"] = "lorafleet-worker"
    st = await tick(scaler, body, [pod("w-0")])
    cond = scaling_condition(st)
    assert (cond["status"], cond["reason"]) == ("False", "TargetNotWorkers") and deployments.patches == []
    assert "'workers' is not the pool's spec.workerDeployment 'lorafleet-worker'" in cond["message"]
    body["spec"]["workerDeployment"] = "workers"
    st = await tick(scaler, body, [pod("w-0")])
    assert deployments.patches == [6]


@pytest.mark.parametrize("broken", ["invalid-spec", "prometheus-not-allowed", "target-not-its-workers"])
async def test_a_first_pool_that_cannot_scale_the_shared_target_does_not_hold_it(setup, broken):  # noqa: F811
    """The first pool by name that targets the Deployment too but scales nothing (its spec does not parse, the
    operator may not ask its Prometheus, or the target is not its workerDeployment) is no rival: the second
    pool scales the target (here corrects its out-of-bounds count), where both would leave it as it is."""
    scaler, _, deployments, _ = setup
    deployments.replicas = 9  # above maxReplicas 6: corrected at once
    body = pool()
    first = {"invalid-spec": pool(kvLow=0.9),  # kvLow above kvHigh
             "prometheus-not-allowed": pool(prometheusURL="http://elsewhere:9090"),
             "target-not-its-workers": pool()}[broken]
    if broken == "target-not-its-workers":
        first["spec"]["workerDeployment"] = "other-workers"
    first["metadata"]["name"] = "a-first"
    own = scaling_condition(await scaler.run(copy.deepcopy(first), pods=[pod("w-0")], other_pools=[body], now=NOW))
    assert own["reason"] in ("InvalidSpec", "PrometheusURLNotAllowed", "TargetNotWorkers")
    assert deployments.patches == []
    cond = scaling_condition(await scaler.run(copy.deepcopy(body), pods=[pod("w-0")], other_pools=[first], now=NOW))
    assert deployments.patches == [6], cond
