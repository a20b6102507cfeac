"""The stager token goes only to pods the pool's worker Deployment made: which pods a pool may reach, the
log of those it may not (once each), and, in the running operator, a pod that only copies the workers'
labels (a sidecar double stands for it) being sent nothing."""

from __future__ import annotations

import copy
import logging

import pytest

from lorafleet.operator.controller import PoolController
from lorafleet.operator.crd_models import PoolSpec
from lorafleet.operator.ownership import invalid_pool_claim, own_pods, pool_claims, ready_worker_pods
from lorafleet.operator.worker_trust import WorkerTrust, slim_replicaset, trusted_pods, worker_deployment
from lorafleet.operator.workers import StagerClient

from .fake_stager import FakeStager
from .test_controller import with_uid
from .test_deployments import controlled_by, create_replicaset
from .test_handlers import (  # noqa: F401  (fixtures)
    NS,
    POOL,
    POOLS,
    TOKEN,
    adapter_body,
    cluster,
    create,
    delete,
    eventually,
    gone,
    holds,
    patch,
    pod_body,
    running_operator,
    status,
)

KEY = ("ns", "p")
LABELS = {"app": "w"}


def pool(**spec) -> dict:
    body = {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"baseModel": "m", "workerSelector": {"matchLabels": LABELS}},
    }
    body["spec"].update(spec)
    return body


def rs_ref(name: str, uid: str | None = None, kind: str = "ReplicaSet") -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": name,
        "uid": uid or f"uid-{name}",
        "controller": True,
    }


def pod(name: str, *refs: dict, labels: dict | None = None) -> dict:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": LABELS if labels is None else labels,
            "ownerReferences": list(refs),
        }
    }


def replicaset(name: str, deployment: str | None) -> dict:
    refs = (
        []
        if deployment is None
        else [{"kind": "Deployment", "name": deployment, "uid": "d", "controller": True}]
    )
    return slim_replicaset({"metadata": {"name": name, "uid": f"uid-{name}", "ownerReferences": refs}})


REPLICASETS = [
    replicaset("workers-1", "workers"),
    replicaset("workers-2", "workers"),
    replicaset("other-1", "other"),
    replicaset("bare-1", None),
]


def test_the_worker_deployment_is_only_the_one_named():
    assert worker_deployment(pool(workerDeployment="workers")) == "workers"
    assert worker_deployment(pool(scaling={"target": "scaled"})) is None  # the scaled one is not all workers
    assert worker_deployment(pool(workerDeployment="workers", scaling={"target": "scaled"})) == "workers"
    assert worker_deployment(pool()) is None
    assert worker_deployment(pool(scaling="bad")) is None
    assert worker_deployment(pool(workerDeployment=7)) == ""  # an invalid pool's: matches nothing


def test_only_pods_a_replicaset_of_the_deployment_made_are_reached():
    pods = [
        pod("w-1", rs_ref("workers-1")),
        pod("w-2", rs_ref("workers-2")),  # another revision of the same Deployment
        pod("w-moved", rs_ref("workers-1"), labels={"app": "moved"}),  # released: still its workers'
        pod("rogue"),  # only the labels
        pod("forged", rs_ref("workers-1", uid="made-up")),
        pod("other", rs_ref("other-1")),
        pod("bare", rs_ref("bare-1")),
        pod("job", rs_ref("backup", kind="Job")),
        pod("unrelated", labels={"app": "x"}),  # not selected: not reached, and nothing to say about it
    ]
    trusted, skipped = trusted_pods(pool(workerDeployment="workers"), pods, REPLICASETS)
    assert [p["metadata"]["name"] for p in trusted] == ["w-1", "w-2", "w-moved"]
    assert skipped == {
        "rogue": "none",
        "forged": "ReplicaSet 'workers-1', not known under uid 'made-up'",
        "other": "ReplicaSet 'other-1' of Deployment 'other'",
        "bare": "ReplicaSet 'bare-1', of no Deployment",
        "job": "Job 'backup'",
    }
    assert trusted_pods(pool(), pods, REPLICASETS) == (pods, {})  # names no Deployment: every pod, as before


def test_a_pool_scaling_one_of_its_deployments_still_reaches_the_others():
    """Workers in two Deployments with the same labels (one per GPU type), one of them autoscaled: without
    spec.workerDeployment every selected pod is reached, as before the trust rule."""
    pods = [pod("h100-0", rs_ref("workers-h100-x")), pod("a100-0", rs_ref("workers-a100-y"))]
    replicasets = [replicaset("workers-h100-x", "workers-h100"), replicaset("workers-a100-y", "workers-a100")]
    scaling = {"target": "workers-h100", "prometheusURL": "http://prom:9090", "maxReplicas": 4}
    assert trusted_pods(pool(scaling=scaling), pods, replicasets) == (pods, {})
    trusted, skipped = trusted_pods(pool(scaling=scaling, workerDeployment="workers-h100"), pods, replicasets)
    assert [p["metadata"]["name"] for p in trusted] == ["h100-0"] and list(skipped) == ["a100-0"]


def test_a_pod_is_owned_only_by_a_pool_that_may_reach_it():
    """Two pools with overlapping selectors, each naming its own Deployment: the first by name does not take
    the other's pods (it would never push to them, and neither would their own pool)."""
    ready = {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    pods = [{**pod("a-0", rs_ref("a-x")), "status": ready}, {**pod("b-0", rs_ref("b-y")), "status": ready}]
    replicasets = [replicaset("a-x", "a-workers"), replicaset("b-y", "b-workers")]
    pools = {}
    for name, deployment in (("alpha", "a-workers"), ("beta", "b-workers")):
        pools[name] = pool(workerDeployment=deployment)
        pools[name]["metadata"]["name"] = name
    for name, mine in (("alpha", "a-0"), ("beta", "b-0")):
        body, others = pools[name], [b for n, b in pools.items() if n != name]
        reach = trusted_pods(body, pods, replicasets)[0]
        own, shared = own_pods(name, body["spec"]["workerSelector"], reach, pool_claims(others, replicasets))
        assert ([p["metadata"]["name"] for p in own], shared) == ([mine], {})
        assert ready_worker_pods(PoolSpec.parse(body), reach, others, replicasets)[:2] == ([mine], {})
        assert invalid_pool_claim(body, reach, others, replicasets) == ([mine], {})
    # A first pool that names no Deployment may reach every pod it selects: it still owns them.
    open_alpha = {**pools["alpha"], "spec": {k: v for k, v in pools["alpha"]["spec"].items()
                                             if k != "workerDeployment"}}
    reach = trusted_pods(pools["beta"], pods, replicasets)[0]
    own, shared = own_pods("beta", pools["beta"]["spec"]["workerSelector"], reach,
                           pool_claims([open_alpha], replicasets))
    assert (own, shared) == ([], {"b-0": "alpha"})


def test_each_pod_left_out_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="lorafleet.operator.worker_trust")
    trust, body = WorkerTrust(), pool(workerDeployment="workers")
    pods = [pod("w-1", rs_ref("workers-1")), pod("rogue")]
    for _ in range(3):
        assert [p["metadata"]["name"] for p in trust.admit(KEY, [body], pods, REPLICASETS)] == ["w-1"]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "LoRAPool ns/p: pod rogue matches spec.workerSelector, but its controller (none) is no "
        "ReplicaSet of Deployment 'workers' (spec.workerDeployment): it is "
        "sent nothing, the stager token included (but for an empty adapter set, where the pool pushed to this pod "
        "before)"
    ]
    # Another pod under that name (a new uid) is told of again; so is one after its pool's memory went.
    renewed = copy.deepcopy(pods)
    renewed[1]["metadata"]["uid"] = "uid-rogue-2"
    trust.admit(KEY, [body], renewed, REPLICASETS)
    trust.retain(set())
    trust.admit(KEY, [body], renewed, REPLICASETS)
    assert len(caplog.records) == 3
    assert trust.admit(KEY, [], pods, REPLICASETS) == []  # no pool, no pod to reach


def test_the_pods_left_out_are_named_for_the_pool_status_with_a_hint_when_no_replicaset_is_seen():
    trust, body = WorkerTrust(), pool(workerDeployment="workers")
    trust.admit(KEY, [body], [pod("w-1", rs_ref("workers-1")), pod("rogue")], REPLICASETS)
    assert trust.left_out(KEY) == ("spec.workerSelector also matches pods that are no ReplicaSet's of Deployment "
                                   "'workers' (spec.workerDeployment), sent nothing: rogue (none)")
    # An operator whose role may not list ReplicaSets (an upgrade without the chart's new rule) sees none.
    assert trust.admit(KEY, [body], [pod("w-1", rs_ref("workers-1"))], []) == []
    assert trust.left_out(KEY).endswith("w-1 (ReplicaSet 'workers-1', not known under uid 'uid-workers-1'); the "
                                        "operator sees no ReplicaSet in this namespace: its role needs get, list "
                                        "and watch on apps/replicasets")
    trust.admit(KEY, [body], [pod("w-1", rs_ref("workers-1"))], REPLICASETS)
    assert trust.left_out(KEY) is None
    trust.admit(KEY, [body], [pod("rogue")], REPLICASETS)
    trust.retain(set())
    assert trust.left_out(KEY) is None


def test_a_pool_naming_no_deployment_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="lorafleet.operator.worker_trust")
    trust, pods = WorkerTrust(), [pod("rogue")]
    assert trust.admit(KEY, [pool()], pods, []) == pods
    assert trust.admit(KEY, [pool()], pods, []) == pods
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith(
        "LoRAPool ns/p names no worker Deployment: every pod"
    )
    assert "set spec.workerDeployment" in messages[0] and "spec.scaling.target does not count" in messages[0]
    scaled = pool(scaling={"target": "workers", "prometheusURL": "http://prom:9090", "maxReplicas": 2})
    assert WorkerTrust().admit(("ns", "q"), [scaled], pods, []) == pods
    assert len(caplog.records) == 2
    assert caplog.records[1].getMessage().startswith("LoRAPool ns/q names no worker")


@pytest.mark.parametrize("forged", [False, True])
async def test_a_pod_with_the_workers_labels_only_is_sent_nothing(cluster, caplog, forged):  # noqa: F811
    """A pod anyone may create with the workers' labels (or a controller reference to their ReplicaSet under a
    made-up uid) gets no request, and the token with none; the Deployment's own pod is served as ever."""
    emulator, url = cluster
    caplog.set_level(logging.WARNING, logger="lorafleet.operator.worker_trust")
    body = copy.deepcopy(POOL)
    body["spec"]["workerDeployment"] = "workers"
    async with FakeStager(TOKEN) as worker, FakeStager(TOKEN) as rogue, running_operator(url):
        owner = await create_replicaset(emulator, "workers", "workers-5d8f7c")
        await create(emulator, "pods", controlled_by(pod_body("worker-0", worker.port), owner))
        impostor = pod_body("rogue", rogue.port)
        await create(
            emulator, "pods", controlled_by(impostor, {**owner, "uid": "made-up"}) if forged else impostor
        )
        await create(emulator, "lorapools", body)
        await create(emulator, "loraadapters", adapter_body("sql"))
        await _sql_served_by_worker_0(emulator)
        await eventually(lambda: worker.reads >= 5, "several passes of the pool")
    assert rogue.reads == 0 and rogue.pushes == [] and rogue.tokens == []
    ready = next(c for c in emulator.objects[POOLS, NS, "main"]["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and "sent nothing: rogue (" in ready["message"], ready
    skipped = [r.getMessage() for r in caplog.records if "pod rogue" in r.getMessage()]
    assert len(skipped) == 1 and "no ReplicaSet of Deployment 'workers'" in skipped[0]


async def test_a_pod_an_earlier_pool_may_not_reach_is_served_by_its_own(cluster):  # noqa: F811
    """An earlier pool by name whose selector matches the same labels, naming another Deployment, does not
    take this pool's pod over: the pod is still pushed this pool's adapters, and the earlier pool sends it
    nothing."""
    emulator, url = cluster
    body, alpha = copy.deepcopy(POOL), copy.deepcopy(POOL)
    body["spec"]["workerDeployment"] = "workers"
    alpha["metadata"]["name"], alpha["spec"]["workerDeployment"] = "alpha", "alpha-workers"
    async with FakeStager(TOKEN) as worker, running_operator(url):
        owner = await create_replicaset(emulator, "workers", "workers-5d8f7c")
        await create(emulator, "pods", controlled_by(pod_body("worker-0", worker.port), owner))
        await create(emulator, "lorapools", alpha)
        await create(emulator, "lorapools", body)
        await create(emulator, "loraadapters", adapter_body("sql"))
        await _sql_served_by_worker_0(emulator)


async def test_a_pass_empties_the_pods_it_pushed_to_among_those_it_may_no_longer_reach():
    """Of the pods a pool may no longer reach (``former``: its spec.workerDeployment changed), those its push
    record names by (name, uid) are emptied as pods it released, and an adapter's finalizer counts them while
    they hold it; a pod it never pushed to, or one re-created under such a name (another uid), is never read."""
    async with FakeStager(TOKEN) as old, FakeStager(TOKEN) as new, FakeStager(TOKEN) as stranger:
        controller = PoolController(StagerClient(token=TOKEN, timeout=5.0))
        key, sql = (NS, "main"), adapter_body("sql")
        w0, w1 = with_uid(pod_body("worker-0", old.port), "u0"), with_uid(pod_body("worker-1", new.port), "u1")
        dying = {**sql, "metadata": {**sql["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
        others = [with_uid(pod_body("worker-2", stranger.port), "u2")]
        try:
            await controller.run(key, pools=[POOL], adapters=[sql], pods=[w0, w1])
            assert holds(old, "sql") == holds(new, "sql") == {"v1"}
            plan = await controller.run(key, pools=[POOL], adapters=[dying], pods=[w1], former=[w0, *others])
            assert sorted(plan.unloading["sql"]) == ["worker-0", "worker-1"]
            assert holds(old, "sql") == holds(new, "sql") == set()
            plan = await controller.run(key, pools=[POOL], adapters=[dying], pods=[w1], former=[w0, *others])
            assert plan.unloading["sql"] == [] and plan.pool_status["pushedPods"] == [{"name": "worker-1",
                                                                                      "uid": "u1"}]
            reads = old.reads
            await controller.run(key, pools=[POOL], adapters=[sql], pods=[w1], former=[with_uid(w0, "u0b"), *others])
            assert old.reads == reads and stranger.reads == 0 and stranger.tokens == []
        finally:
            await controller.client.close()


@pytest.mark.parametrize("before", ["workers-a", None])
async def test_pods_the_pool_pushed_to_under_its_earlier_worker_deployment_are_emptied(cluster, before):  # noqa: F811
    """The pool's spec.workerDeployment moves from workers-a to workers-b (or is set where none was): worker-0,
    of workers-a, pushed sql before, is no longer the pool's, yet holds it. It is emptied as a pod the pool
    released (it had the token already), so deleting sql waits for it and status.pushedPods names it meanwhile;
    a pod of workers-a the pool never pushed to is still sent nothing."""
    emulator, url = cluster
    body = copy.deepcopy(POOL)
    if before is not None:
        body["spec"]["workerDeployment"] = before
    async with (FakeStager(TOKEN) as old, FakeStager(TOKEN) as new, FakeStager(TOKEN) as later,
                running_operator(url)):
        old_rs = await create_replicaset(emulator, "workers-a", "workers-a-1")
        new_rs = await create_replicaset(emulator, "workers-b", "workers-b-1")
        await create(emulator, "pods", controlled_by(pod_body("worker-0", old.port), old_rs))
        await create(emulator, "pods", controlled_by(pod_body("worker-1", new.port), new_rs))
        await create(emulator, "lorapools", body)
        await create(emulator, "loraadapters", adapter_body("sql"))
        await eventually(lambda: holds(old, "sql") == {"v1"}, "worker-0 (workers-a) serves sql")
        assert (new.pushes == []) is (before is not None)

        await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2},
                                                    "spec": {"workerDeployment": "workers-b"}})
        await eventually(lambda: holds(new, "sql") == {"v1"} and holds(old, "sql") == set(),
                         "worker-1 (workers-b) serves sql, worker-0 emptied")
        await create(emulator, "pods", controlled_by(pod_body("worker-2", later.port), old_rs))
        reads = new.reads
        await eventually(lambda: new.reads >= reads + 3, "a few passes of the pool with worker-2")
        await delete(emulator, "loraadapters", "sql")
        await eventually(lambda: gone(emulator, "sql"), "sql deleted")
        await eventually(lambda: [p["name"] for p in emulator.objects[POOLS, NS, "main"]["status"]["pushedPods"]]
                         == ["worker-1"], "worker-0 forgotten once empty")
    assert holds(old, "sql") == set() and old.applied.adapters == []
    assert later.reads == 0 and later.pushes == [] and later.tokens == []


async def _sql_served_by_worker_0(emulator) -> None:
    await eventually(
        lambda: status(emulator, "sql")["instances"] == [{"pod": "worker-0", "version": "v1", "tier": "gpu"}],
        "sql served by worker-0",
    )
