"""A deleting pool's drain, one PoolController pass at a time against fake sidecars: its own workers, the pods it
released, those not ready, and (its workerSelector invalid) the pods its push record or status.pushedPods names."""

from __future__ import annotations

import copy

import pytest

from lorafleet.operator.controller import PoolController
from lorafleet.operator.finalizers import adapter_unload_wait
from lorafleet.operator.workers import StagerClient

from .fake_stager import FakeStager
from .test_controller import KEY, Clock, pods_and_zeta, with_uid
from .test_handlers import POOL, TOKEN, adapter_body, holds, pod_body

DELETED = {"deletionTimestamp": "2026-01-01T00:00:00Z"}
LOST = {"workerSelector": {"matchLabels": {}}}  # invalid: which pods it selects is unknown


def deleting(pool: dict, **spec) -> dict:
    return {**pool, "metadata": {**pool["metadata"], **DELETED}, "spec": {**pool["spec"], **spec}}


def not_ready(pod: dict) -> dict:
    pod = copy.deepcopy(pod)
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    return pod


def controller_for(**kwargs) -> PoolController:
    return PoolController(StagerClient(token=TOKEN, timeout=2.0), **kwargs)


@pytest.fixture()
async def stager():
    async with FakeStager(TOKEN) as s:
        yield s


async def test_a_deleting_pool_drains_its_own_workers_only(stager):
    other = FakeStager(TOKEN)
    await other.start()
    controller = controller_for()
    pods, zeta = pods_and_zeta(stager, other)
    adapters = [adapter_body("sql", pinned=True, warm="all")]
    try:
        plan = await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods, other_pools=[zeta])
        assert plan.draining is None and all(s.applied.adapters for s in (stager, other))
        # "zeta" (live) selects worker-1: the deleting pool hands it over and empties only worker-0.
        plan = await controller.run(KEY, pools=[deleting(POOL)], adapters=adapters, pods=pods, other_pools=[zeta])
        assert set(plan.pushes) == {"worker-0"} and stager.applied.adapters == []
        assert plan.draining == ["worker-0"]  # as reported before that push
        plan = await controller.run(KEY, pools=[deleting(POOL)], adapters=adapters, pods=pods, other_pools=[zeta])
        assert plan.draining == [] and plan.adapter_statuses["sql"]["phase"] == "Degraded"
        assert [d.name for d in other.applied.adapters] == ["sql"]
    finally:
        await controller.client.close()
        await other.stop()


@pytest.mark.parametrize("bad_spec", [{"eviction": "fifo"}, {"baseModel": ""}, {"stagerPort": 0}])
async def test_a_deleting_pool_with_an_invalid_spec_is_drained_by_its_selector(stager, bad_spec):
    controller = controller_for()
    inputs = {"adapters": [adapter_body("sql", pinned=True)], "pods": [pod_body("worker-0", stager.port)]}
    try:
        await controller.run(KEY, pools=[POOL], **inputs)
        assert stager.applied.adapters
        plan = await controller.run(KEY, pools=[deleting(POOL, **bad_spec)], **inputs)
        assert set(plan.pushes) == {"worker-0"} and plan.draining == ["worker-0"]
        assert stager.applied.adapters == []
        assert (await controller.run(KEY, pools=[deleting(POOL, **bad_spec)], **inputs)).draining == []
    finally:
        await controller.client.close()


async def test_a_deleting_pool_with_an_invalid_selector_empties_the_pods_it_pushed_to(stager):
    """Which pods it selects is unknown, but those it pushed to are its push record's: each is emptied (pinned
    adapters included) as a pod it released, unless another live pool takes it over ("zeta", valid, selects
    worker-1), and the finalizer waits until it reports nothing. A pod it never pushed to is not reached."""
    other = FakeStager(TOKEN)
    await other.start()
    pods, zeta = pods_and_zeta(stager, other)
    pods = [with_uid(p, f"a{i}") for i, p in enumerate(pods)]
    stranger = with_uid(pod_body("worker-9", stager.port), "a9")
    adapters = [adapter_body("sql", pinned=True, warm="all")]
    inputs = {"pools": [deleting(POOL, **LOST)], "adapters": adapters, "pods": [*pods, stranger],
              "other_pools": [zeta]}
    controller = controller_for()
    try:
        await controller.run(KEY, pools=[POOL], adapters=adapters, pods=pods, other_pools=[zeta])
        assert holds(stager, "sql") == {"v1"} and holds(other, "sql") == {"v1"}
        plan = await controller.run(KEY, **inputs)
        assert set(plan.pushes) == {"worker-0"} and plan.pushes["worker-0"].adapters == []
        assert plan.draining == ["worker-0"] and stager.applied.adapters == []  # as reported before that push
        assert holds(other, "sql") == {"v1"} and not plan.workers_unknown
        plan = await controller.run(KEY, **inputs)
        assert plan.draining == [] and plan.pushes == {}
    finally:
        await controller.client.close()
        await other.stop()


async def test_after_a_restart_a_deleting_pool_with_an_invalid_selector_empties_the_pods_its_status_names(stager):
    """A new operator knows nothing it pushed: the pool's status.pushedPods names the pods (name and uid), each
    waited for while not ready, and emptied once ready; one re-created under its name since (a new uid) is not
    the pod pushed to. Where nothing names a pod (no status) its workers are unknown and left as they are, and
    the plan says so."""
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    adapters = [adapter_body("sql", pinned=True)]
    first, restarted, recreated, blind = (controller_for() for _ in range(4))
    try:
        plan = await first.run(KEY, pools=[POOL], adapters=adapters, pods=pods)
        pool = deleting({**POOL, "status": plan.pool_status}, **LOST)
        plan = await restarted.run(KEY, pools=[pool], adapters=adapters, pods=[not_ready(pods[0])])
        assert plan.draining == ["worker-0"] and plan.not_ready == ["worker-0"] and plan.pushes == {}
        assert not plan.workers_unknown
        plan = await restarted.run(KEY, pools=[pool], adapters=adapters, pods=pods)  # ready again: emptied
        assert set(plan.pushes) == {"worker-0"} and stager.applied.adapters == []
        plan = await restarted.run(KEY, pools=[pool], adapters=adapters, pods=pods)
        assert plan.draining == [] and plan.not_ready == [] and not plan.workers_unknown

        await first.run(KEY, pools=[POOL], adapters=adapters, pods=pods)  # refilled
        plan = await recreated.run(KEY, pools=[pool], adapters=adapters, pods=[with_uid(pods[0], "b0")])
        assert plan.draining == [] and plan.pushes == {} and not plan.workers_unknown
        plan = await blind.run(KEY, pools=[deleting(POOL, **LOST)], adapters=adapters, pods=pods)
        assert plan.draining == [] and plan.pushes == {} and holds(stager, "sql") == {"v1"}
        assert plan.workers_unknown
    finally:
        for controller in (first, restarted, recreated, blind):
            await controller.client.close()


async def test_a_silent_pod_holds_up_a_deleting_pool_with_an_invalid_selector_until_deleted(stager):
    """As for a valid deleting pool: a pod it pushed to whose sidecar does not answer is waited for by the pool's
    finalizer however long; an adapter's finalizer stops waiting for it after the unload grace (the pool's
    finalizer tells it); deleting the pod ends the wait."""
    clock = Clock()
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    gone_chat = {**chat, "metadata": {**chat["metadata"], **DELETED}}
    inputs = {"pools": [deleting(POOL, **LOST)], "adapters": [sql, gone_chat]}
    controller = controller_for(clock=clock, unload_grace=60)
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        stager.mute = True
        plan = await controller.run(KEY, pods=pods, **inputs)
        assert plan.draining == ["worker-0"] and plan.silent == ["worker-0"] and plan.overdue == []
        clock.now += 60
        plan = await controller.run(KEY, pods=pods, **inputs)
        assert plan.draining == ["worker-0"] and plan.overdue == ["worker-0"]
        assert adapter_unload_wait("chat", [plan]).given_up == ["worker-0"]
        plan = await controller.run(KEY, pods=[], **inputs)
        assert plan.draining == [] and not plan.workers_unknown
    finally:
        await controller.client.close()


async def test_a_deleting_pool_waits_for_the_pods_it_released(stager):
    """A pool deleted right after its selector stopped matching a pod: its finalizer waits for that pod too."""
    controller = controller_for()
    pods = [pod_body("worker-0", stager.port)]
    inputs = {"pools": [deleting(POOL, workerSelector={"matchLabels": {"gpu": "h200"}})],
              "adapters": [adapter_body("sql")], "pods": pods}
    try:
        await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
        plan = await controller.run(KEY, **inputs)
        assert plan.draining == ["worker-0"] and stager.applied.adapters == []
        assert (await controller.run(KEY, **inputs)).draining == []
    finally:
        await controller.client.close()


async def test_a_deleting_pool_waits_for_its_pods_that_are_not_ready(stager):
    """A pool deleted while a pod it gave adapters to is not ready: that pod cannot be told now, and once the
    pool is gone no pass would reach it when it is ready again, so the finalizer waits for it. A pod it
    never pushed to is not waited for."""
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    stranger = not_ready(with_uid(pod_body("worker-9", stager.port), "a9"))
    inputs = {"adapters": [adapter_body("sql", pinned=True)]}
    controller = controller_for()
    try:
        await controller.run(KEY, pools=[POOL], pods=pods, **inputs)
        plan = await controller.run(KEY, pools=[deleting(POOL)], pods=[not_ready(pods[0]), stranger], **inputs)
        assert plan.draining == ["worker-0"] and plan.not_ready == ["worker-0"] and plan.pushes == {}
        plan = await controller.run(KEY, pools=[deleting(POOL)], pods=pods, **inputs)  # ready again: emptied
        assert set(plan.pushes) == {"worker-0"} and stager.applied.adapters == []
        plan = await controller.run(KEY, pools=[deleting(POOL)], pods=pods, **inputs)
        assert plan.draining == [] and plan.not_ready == []
    finally:
        await controller.client.close()
