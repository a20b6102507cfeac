"""What an adapter's finalizer waits for: pods not ready, pods whose sidecar does not answer (bounded by the
unload grace), pods of the invalid pool an adapter moved away from, and a pod an earlier invalid pool took."""

from __future__ import annotations

import asyncio
import copy

import pytest

from lorafleet.operator.controller import PoolController
from lorafleet.operator.finalizers import adapter_unload_wait
from lorafleet.operator.reconcile import PoolPlan
from lorafleet.operator.workers import StagerClient

from .fake_stager import FakeStager
from .test_controller import KEY, Clock, pods_and_zeta, with_uid
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
    operator,
    patch,
    pod_body,
    running_operator,
    sidecars,
    status,
)

DELETED = {"deletionTimestamp": "2026-01-01T00:00:00Z"}
INVALID = {"eviction": "fifo"}  # past an older CRD


def deleting(body: dict) -> dict:
    return {**body, "metadata": {**body["metadata"], **DELETED}}


def not_ready(pod: dict) -> dict:
    pod = copy.deepcopy(pod)
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    return pod


@pytest.fixture()
async def stager():
    async with FakeStager(TOKEN) as s:
        yield s


def controller_for(**kwargs) -> PoolController:
    return PoolController(StagerClient(token=TOKEN, timeout=2.0), **kwargs)


async def test_an_adapter_deletion_reaches_a_running_pod_that_is_not_ready(stager):
    """A running pod that is briefly not ready still serves what it holds, and would serve it once ready:
    it is told what it last accepted less the deleted adapter, and the finalizer waits for it."""
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    controller = controller_for()
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        inputs = {"pools": [POOL], "adapters": [sql, deleting(chat)], "pods": [not_ready(pods[0])]}
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": ["worker-0"]} and set(plan.pushes) == {"worker-0"}
        assert [d.name for d in stager.applied.adapters] == ["sql"] and stager.applied.by_name()["sql"].warm
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": []} and plan.pushes == {}  # nothing else changes while not ready
        assert plan.adapter_statuses["sql"]["phase"] == "Pending"  # statuses count ready pods only
        # Ready again: it gets the pool's set as any ready pod does, with no needless push.
        assert (await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods)).pushes == {}
    finally:
        await controller.client.close()


async def test_a_pod_not_ready_whose_last_push_is_not_known_holds_up_the_deletion(stager):
    """After a restart what it accepted is not known: it cannot be told without guessing the rest of its set,
    so the finalizer waits (it is told once ready). A pod with no IP (never started) is not waited for."""
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    pending = with_uid(pod_body("worker-1", stager.port), "a1")
    pending["status"] = {"phase": "Pending"}
    first, restarted = controller_for(), controller_for()
    try:
        await first.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        plan = await restarted.run(KEY, pools=[POOL], adapters=[sql, deleting(chat)],
                                   pods=[not_ready(pods[0]), pending])
        assert plan.pushes == {} and plan.unloading == {"chat": ["worker-0"]} and plan.unreachable == ["worker-0"]
        wait = adapter_unload_wait("chat", [plan])
        assert wait.waiting == ["worker-0"] and "worker-0 last accepted is not known" in wait.message
        plan = await restarted.run(KEY, pools=[POOL], adapters=[sql, deleting(chat)], pods=pods)
        assert set(plan.pushes) == {"worker-0"} and holds(stager, "chat") == set()
    finally:
        await first.client.close()
        await restarted.client.close()


async def test_a_silent_pod_stops_holding_up_a_deletion_after_the_unload_grace(stager):
    """A ready pod whose sidecar does not answer is waited for, but only for ``unload_grace`` seconds of
    silence (an answer starts the count again): after that the finalizer goes and names it. That is safe
    because the adapter is then in no desired state: once the sidecar answers again, it is told its set."""
    clock = Clock()
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    controller = controller_for(clock=clock, unload_grace=60)
    inputs = {"pools": [POOL], "adapters": [sql, deleting(chat)], "pods": pods}
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        stager.mute = True
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": ["worker-0"]} and plan.silent == ["worker-0"] and plan.overdue == []
        clock.now += 30
        stager.mute = False
        assert (await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)).silent == []
        stager.mute = True
        clock.now += 59
        plan = await controller.run(KEY, **inputs)
        assert plan.overdue == [] and adapter_unload_wait("chat", [plan]).waiting == ["worker-0"]
        clock.now += 1
        plan = await controller.run(KEY, **inputs)
        assert plan.overdue == ["worker-0"] and plan.unloading == {"chat": ["worker-0"]}
        wait = adapter_unload_wait("chat", [plan])
        assert wait.waiting == [] and wait.given_up == ["worker-0"]
        # The object is gone; the sidecar answers again: it is told the pool's set, which lacks the adapter.
        stager.mute = False
        plan = await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods)
        assert set(plan.pushes) == {"worker-0"} and holds(stager, "chat") == set() and plan.overdue == []
    finally:
        await controller.client.close()


async def test_a_silent_pod_of_an_invalid_pool_is_waited_for_past_the_grace(stager):
    """An invalid pool pushes nothing once no adapter is being deleted: a pod of it that went silent would
    never be told, so it keeps holding up the deletion (until it answers, or the spec is fixed)."""
    clock = Clock()
    pods = [pod_body("worker-0", stager.port)]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    invalid = {**POOL, "spec": {**POOL["spec"], **INVALID}}
    controller = controller_for(clock=clock, unload_grace=60)
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        stager.mute = True
        await controller.run(KEY, pools=[invalid], adapters=[sql, deleting(chat)], pods=pods)
        clock.now += 600
        plan = await controller.run(KEY, pools=[invalid], adapters=[sql, deleting(chat)], pods=pods)
        assert plan.silent == ["worker-0"] and plan.overdue == []
        assert adapter_unload_wait("chat", [plan]).waiting == ["worker-0"]
    finally:
        await controller.client.close()


async def test_a_pod_an_earlier_invalid_pool_takes_is_emptied_first(stager):
    """"zeta" pushed to worker-1; then "alpha" (invalid, sorting first) comes to select it. By the by-name rule
    alpha owns it, but pushes nothing: zeta empties it rather than leave it serving zeta's adapters that
    zeta no longer updates. A pod alpha pushed to before its spec went bad (its status.pushedPods) is alpha's
    as it is, and left alone."""
    other = FakeStager(TOKEN)
    await other.start()
    pods, zeta = pods_and_zeta(stager, other)
    pods = [with_uid(p, f"a{i}") for i, p in enumerate(pods)]
    zeta_key = (NS, "zeta")
    alpha = {**zeta, "metadata": {**zeta["metadata"], "name": "alpha"}, "spec": {**zeta["spec"], **INVALID}}
    adapters = [adapter_body("sql", pool="zeta", warm="all")]
    controller = controller_for()
    try:
        await controller.run(zeta_key, pools=[zeta], adapters=adapters, pods=pods)
        assert holds(other, "sql") == {"v1"}
        plan = await controller.run(zeta_key, pools=[zeta], adapters=adapters, pods=pods, other_pools=[alpha])
        assert set(plan.pushes) == {"worker-1"} and other.applied.adapters == [] and plan.releasing == ["worker-1"]
        assert "worker-1 (owned by LoRAPool 'alpha')" in plan.pool_status["conditions"][0]["message"]
        plan = await controller.run(zeta_key, pools=[zeta], adapters=adapters, pods=pods, other_pools=[alpha])
        assert plan.releasing == [] and plan.pushes == {}

        held = {**alpha, "status": {"pushedPods": [{"name": "worker-1", "uid": "a1"}]}}
        fresh = controller_for()
        try:
            await fresh.run(zeta_key, pools=[zeta], adapters=adapters, pods=pods)
            plan = await fresh.run(zeta_key, pools=[zeta], adapters=adapters, pods=pods, other_pools=[held])
            assert plan.pushes == {} and holds(other, "sql") == {"v1"}
        finally:
            await fresh.client.close()
    finally:
        await controller.client.close()
        await other.stop()


async def test_a_deleting_pool_empties_a_pod_an_earlier_invalid_pool_selects_but_never_held(stager):
    other = FakeStager(TOKEN)
    await other.start()
    pods, zeta = pods_and_zeta(stager, other)
    zeta_key = (NS, "zeta")
    alpha = {**zeta, "metadata": {**zeta["metadata"], "name": "alpha"}, "spec": {**zeta["spec"], **INVALID}}
    adapters = [adapter_body("sql", pool="zeta", pinned=True)]
    controller = controller_for()
    try:
        await controller.run(zeta_key, pools=[zeta], adapters=adapters, pods=pods)
        plan = await controller.run(zeta_key, pools=[deleting(zeta)], adapters=adapters, pods=pods,
                                    other_pools=[alpha])
        assert plan.draining == ["worker-1"] and other.applied.adapters == []
        plan = await controller.run(zeta_key, pools=[deleting(zeta)], adapters=adapters, pods=pods,
                                    other_pools=[alpha])
        assert plan.draining == []
    finally:
        await controller.client.close()
        await other.stop()


def plan_of(**fields) -> PoolPlan:
    return PoolPlan(**fields)


def test_unload_wait_combines_the_plans_of_every_pool():
    ours = plan_of(unloading={"chat": ["w0"]}, silent=["w0"], overdue=["w0"])
    theirs = plan_of(unloading={"chat": ["w5", "w6"]}, unreachable=["w6"])
    wait = adapter_unload_wait("chat", [ours, theirs])
    assert wait.waiting == ["w5", "w6"] and wait.given_up == ["w0"]
    assert "still reported by w5" in wait.message and "w6" in wait.message and "spec" in wait.message
    assert "w0" in wait.message  # said, though no longer waited for
    assert adapter_unload_wait("chat", [ours, plan_of()]) is None  # a pass that did not see the deletion
    done = adapter_unload_wait("chat", [plan_of(unloading={"chat": []})])
    assert done.waiting == [] and done.given_up == [] and done.message == ""


def test_a_pod_given_up_by_one_pass_is_waited_for_while_another_sees_it_hold_the_adapter():
    """w0 is silent past the grace to the pool that released it (a wrong port, say), but the invalid pool that
    holds it reaches it and sees it report the adapter: the deletion waits for it."""
    released = plan_of(unloading={"chat": ["w0"]}, silent=["w0"], overdue=["w0"])
    held = plan_of(unloading={"chat": ["w0", "w1"]}, unreachable=["w0"])
    wait = adapter_unload_wait("chat", [released, held])
    assert wait.waiting == ["w0", "w1"] and wait.given_up == []
    assert "still reported by w0, w1" in wait.message and "no answer" not in wait.message
    assert "what w0 last accepted is not known" in wait.message


async def test_an_adapter_moved_off_an_invalid_pool_is_unloaded_from_its_pods(operator, sidecars):  # noqa: F811
    """The adapter served by "main" moves to "zeta" while main's spec is invalid (main pushes nothing): when it
    is deleted, main's pods, which still hold it, are told to drop it, and the finalizer waits for them."""
    emulator = operator
    await create(emulator, "pods", pod_body("worker-0", sidecars[0].port))
    await create(emulator, "lorapools", POOL)
    await create(emulator, "loraadapters", adapter_body("sql"))
    await create(emulator, "loraadapters", adapter_body("chat"))
    await eventually(lambda: status(emulator, "chat")["phase"] == "Ready", "chat Ready")
    await patch(emulator, "lorapools", "main", {"metadata": {"generation": 2}, "spec": INVALID})
    # Seen invalid before chat moves: else a pass of main still valid in the operator's index (under load)
    # may push its pods their set without chat, which this test says an invalid pool does not do.
    await eventually(lambda: emulator.objects[POOLS, NS, "main"]["status"]["observedGeneration"] == 2,
                     "main's invalid spec seen")
    zeta = copy.deepcopy(POOL)
    zeta["metadata"]["name"] = "zeta"
    zeta["spec"]["workerSelector"] = {"matchLabels": {"gpu": "h200"}}
    await create(emulator, "lorapools", zeta)
    await patch(emulator, "loraadapters", "chat", {"metadata": {"generation": 2}, "spec": {"pool": "zeta"}})
    await eventually(lambda: status(emulator, "chat")["phase"] == "Pending", "chat moved to zeta")
    assert holds(sidecars[0], "chat") == {"v1"}  # main is invalid: its pods are left as they are
    await delete(emulator, "loraadapters", "chat")
    await eventually(lambda: gone(emulator, "chat"), "chat deleted")
    assert holds(sidecars[0], "chat") == set() and holds(sidecars[0], "sql") == {"v1"}


async def test_an_adapter_moved_off_a_pool_whose_selector_is_invalid_too_is_unloaded(stager):
    """A pool whose spec.workerSelector is invalid too selects no pod, but the pods its push record names (pushed
    to while it was valid) may hold what it gave them: an adapter deleted meanwhile is unloaded from them, and
    its finalizer waits for them. One another live pool selects is left to that pool."""
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    lost = {**POOL, "spec": {**POOL["spec"], **INVALID, "workerSelector": {"matchLabels": {}}}}
    controller = controller_for()
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        assert (await controller.run(KEY, pools=[lost], adapters=[sql, chat], pods=pods)).pushes == {}
        inputs = {"pools": [lost], "adapters": [sql, deleting(chat)], "pods": pods}
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": ["worker-0"]} and set(plan.pushes) == {"worker-0"}
        assert adapter_unload_wait("chat", [plan]).waiting == ["worker-0"]
        assert holds(stager, "chat") == set() and holds(stager, "sql") == {"v1"}
        plan = await controller.run(KEY, **inputs)
        assert plan.unloading == {"chat": []} and plan.pushes == {}
        zeta = {**POOL, "metadata": {**POOL["metadata"], "name": "zeta"}}
        plan = await controller.run(KEY, **{**inputs, "adapters": [deleting(sql)]}, other_pools=[zeta])
        assert plan.unloading == {"sql": []} and plan.pushes == {} and holds(stager, "sql") == {"v1"}
    finally:
        await controller.client.close()


async def test_which_pools_may_hold_an_adapter(stager):
    """What decides which pools' passes a deleted adapter's finalizer runs (besides its own pool's): those whose
    pods may hold it, and every pool while that is not known."""
    pods = [with_uid(pod_body("worker-0", stager.port), "a0")]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    controller = controller_for()
    try:
        assert controller.may_hold(KEY, "chat", [POOL])  # no pass of it here yet
        await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods)
        assert not controller.may_hold(KEY, "chat", [POOL]) and controller.may_hold(KEY, "sql", [POOL])
        assert controller.may_hold(KEY, "chat", [deleting(POOL)])
        led = {**POOL, "status": {"pushedPods": [{"name": "worker-0", "uid": "a0"}, {"name": "worker-9", "uid": "a9"}]}}
        assert controller.may_hold(KEY, "chat", [led])  # another leader pushed to worker-9
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        plan = await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods)  # chat moved to another pool
        assert set(plan.pushes) == {"worker-0"} and controller.may_hold(KEY, "chat", [POOL])  # still reported
        await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods)
        assert not controller.may_hold(KEY, "chat", [POOL])
    finally:
        await controller.client.close()


async def quiet(stager: FakeStager, *, pause: float = 0.5, attempts: int = 40) -> int:
    """The number of reads ``stager`` was sent, once none came for two pauses of ``pause`` s in a row (the
    handlers' passes are over: one pause alone was too short on a loaded machine, where a retry came later)."""
    still = 0
    for _ in range(attempts):
        reads = stager.reads
        await asyncio.sleep(pause)
        still = still + 1 if stager.reads == reads else 0
        if still == 2:
            return reads
    raise AssertionError("the sidecar is read all the time")


async def test_an_adapter_finalizer_runs_no_pass_of_a_pool_that_never_held_it(cluster, sidecars):  # noqa: F811
    """Deleting an adapter of "main" runs no pass of "zeta", whose pods were never given it (each pass reads
    every sidecar of its pool; one slow to answer would hold up each retry of the finalizer)."""
    emulator, url = cluster
    zeta_pod = pod_body("worker-1", sidecars[1].port)
    zeta_pod["metadata"]["labels"] = {"tier": "zeta"}
    zeta = copy.deepcopy(POOL)
    zeta["metadata"]["name"] = "zeta"
    zeta["spec"]["workerSelector"] = {"matchLabels": {"tier": "zeta"}}
    async with running_operator(url, interval=60):  # no timer pass meanwhile: the handlers' only
        await create(emulator, "pods", pod_body("worker-0", sidecars[0].port))
        await create(emulator, "pods", zeta_pod)
        await create(emulator, "lorapools", POOL)
        await create(emulator, "lorapools", zeta)
        await create(emulator, "loraadapters", adapter_body("chat"))
        await create(emulator, "loraadapters", adapter_body("sum", pool="zeta"))
        await eventually(lambda: holds(sidecars[0], "chat") and holds(sidecars[1], "sum"), "both pushed")
        reads = await quiet(sidecars[1])
        await delete(emulator, "loraadapters", "chat")
        await eventually(lambda: gone(emulator, "chat"), "chat deleted")
        assert holds(sidecars[0], "chat") == set() and sidecars[1].reads == reads


def test_the_unload_grace_is_a_config_field_and_must_be_positive():
    from lorafleet.operator.operator_config import OperatorConfig

    assert OperatorConfig(stager_token="s" * 16).unload_grace == 300.0
    with pytest.raises(ValueError, match="unload_grace must be > 0"):
        OperatorConfig(stager_token="s" * 16, unload_grace=0)
