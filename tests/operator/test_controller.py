"""One pass of PoolController against fake sidecars: retry backoff for failed versions, pod churn, pushes not
answered, pods a pool released, an invalid pool's pods (a deleting pool's drain: test_pool_deletion.py)."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.operator.controller import PoolController, RetryBackoff
from lorafleet.operator.workers import StagerClient

from .fake_stager import FakeStager
from .test_handlers import NS, POOL, TOKEN, adapter_body, eventually, pod_body

KEY = (NS, "main")


def test_retry_backoff_doubles_up_to_the_cap_and_clears():
    b = RetryBackoff(base=10, cap=40)
    assert not b.may_retry("u", 0)
    b.failing("u", 0, pushed=False)  # first seen failing: wait one base period
    assert not b.may_retry("u", 9.9) and b.may_retry("u", 10)
    b.failing("u", 12, pushed=False)  # seen again without a push: the deadline stands
    assert b.may_retry("u", 12)
    b.failing("u", 10, pushed=True)  # retried: twice as long
    assert not b.may_retry("u", 29.9) and b.may_retry("u", 30)
    b.failing("u", 30, pushed=True)  # 40 s: the cap
    assert not b.may_retry("u", 69.9) and b.may_retry("u", 70)
    b.failing("u", 70, pushed=True)
    assert not b.may_retry("u", 109.9) and b.may_retry("u", 110)
    b.clear("u")
    assert not b.may_retry("u", 10**6)
    b.failing("v", 0, pushed=False)
    b.retain({"w"})
    assert not b.may_retry("v", 10**6)
    b.failing("x", 0, pushed=True)  # first seen failing on a pass that pushed (a new version): one base period too
    assert not b.may_retry("x", 9.9) and b.may_retry("x", 10)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
async def stager():
    async with FakeStager(TOKEN) as s:
        yield s


async def test_a_failed_version_is_re_pushed_with_backoff_until_it_stages(stager):
    clock = Clock()
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0), retry_base=10, retry_cap=60, clock=clock)
    stager.unavailable.add(("sql", "v1"))
    inputs = {"pools": [POOL], "adapters": [adapter_body("sql")], "pods": [pod_body("worker-0", stager.port)]}
    try:
        plan = await controller.run(KEY, **inputs)
        assert set(plan.pushes) == {"worker-0"} and len(stager.pushes) == 1
        for _ in range(3):  # seen failing: no re-push until the backoff elapses
            plan = await controller.run(KEY, **inputs)
            assert plan.pushes == {} and plan.failing == ["worker-0"]
            assert plan.adapter_statuses["sql"]["phase"] == "Degraded"
            assert "worker-0: sql@v1: NoSuchKey" in plan.adapter_statuses["sql"]["message"]
        clock.now += 10
        plan = await controller.run(KEY, **inputs)
        assert set(plan.pushes) == {"worker-0"} and len(stager.pushes) == 2  # a new generation: staged again
        clock.now += 10  # the next retry waits twice as long
        assert (await controller.run(KEY, **inputs)).pushes == {}
        clock.now += 10
        assert set((await controller.run(KEY, **inputs)).pushes) == {"worker-0"}
        stager.unavailable.clear()  # the store is back: the next retry (40 s after the last) stages it
        clock.now += 39
        assert (await controller.run(KEY, **inputs)).failing == ["worker-0"]
        clock.now += 1
        assert set((await controller.run(KEY, **inputs)).pushes) == {"worker-0"}
        plan = await controller.run(KEY, **inputs)
        assert plan.failing == [] and plan.adapter_statuses["sql"]["phase"] == "Ready"
    finally:
        await controller.client.close()


def pods_and_zeta(stager: FakeStager, other: FakeStager) -> tuple[list[dict], dict]:
    """worker-0 (on ``stager``) and worker-1 (on ``other``, labelled gpu=h200), and pool "zeta", which selects
    gpu=h200 pods and sorts after "main"."""
    pods = [pod_body("worker-0", stager.port), pod_body("worker-1", other.port)]
    pods[1]["metadata"]["labels"]["gpu"] = "h200"
    zeta = {**POOL, "metadata": {**POOL["metadata"], "name": "zeta"},
            "spec": {**POOL["spec"], "workerSelector": {"matchLabels": {"gpu": "h200"}}}}
    return pods, zeta


async def test_an_invalid_pool_keeps_its_workers_from_a_later_pool(stager):
    """"alpha" sorts first and its spec is invalid: "main" selects the same pod yet pushes nothing to it."""
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    alpha = {**POOL, "metadata": {**POOL["metadata"], "name": "alpha"}, "spec": {**POOL["spec"], "eviction": "fifo"}}
    try:
        plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")],
                                    pods=[pod_body("worker-0", stager.port)], other_pools=[alpha])
        assert plan.pushes == {} and stager.pushes == []
        [ready] = plan.pool_status["conditions"]
        assert ready["status"] == "False" and "worker-0 (owned by LoRAPool 'alpha')" in ready["message"]
    finally:
        await controller.client.close()


def with_uid(pod: dict, uid: str) -> dict:
    return {**pod, "metadata": {**pod["metadata"], "uid": uid}}


async def test_pushes_are_remembered_for_the_pods_listed_now_only(stager):
    """Pod churn: a pod gone drops out of the record, and a pod re-created under its name (a new uid) gets a
    fresh push even where its sidecar still reports what the earlier pod was pushed."""
    other = FakeStager(TOKEN)
    await other.start()
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    first = [with_uid(pod_body("worker-0", stager.port), "a0"), with_uid(pod_body("worker-1", other.port), "a1")]
    inputs = {"pools": [POOL], "adapters": [adapter_body("sql")]}
    try:
        plan = await controller.run(KEY, pods=first, **inputs)
        assert set(plan.pushes) == {"worker-0", "worker-1"} and len(controller.push_records[KEY]) == 2
        assert (await controller.run(KEY, pods=first, **inputs)).pushes == {}  # converged
        plan = await controller.run(KEY, pods=first[:1], **inputs)  # worker-1 deleted
        assert plan.pushes == {} and len(controller.push_records[KEY]) == 1
        # Re-created on the same sidecar, whose report matches the last push to the pod that is gone.
        again = [first[0], with_uid(pod_body("worker-1", other.port), "b1")]
        plan = await controller.run(KEY, pods=again, **inputs)
        assert set(plan.pushes) == {"worker-1"} and len(other.pushes) == 2 and len(controller.push_records[KEY]) == 2
        # Re-created between two passes, never seen missing: the new uid alone makes it a new pod.
        again[0] = with_uid(pod_body("worker-0", stager.port), "b0")
        plan = await controller.run(KEY, pods=again, **inputs)
        assert set(plan.pushes) == {"worker-0"} and len(stager.pushes) == 2 and len(controller.push_records[KEY]) == 2
    finally:
        await controller.client.close()
        await other.stop()


async def test_a_worker_at_a_new_address_gets_a_fresh_push(stager):
    """The same pod (name and uid) answers at another address (its IP changed with its sandbox): what the
    old address accepted says nothing of the new one, even where the new sidecar reports the same state."""
    other = FakeStager(TOKEN)
    await other.start()
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    inputs = {"pools": [POOL], "adapters": [adapter_body("sql")]}
    try:
        plan = await controller.run(KEY, pods=[with_uid(pod_body("worker-0", stager.port), "a0")], **inputs)
        assert set(plan.pushes) == {"worker-0"}
        other.applied = stager.applied
        plan = await controller.run(KEY, pods=[with_uid(pod_body("worker-0", other.port), "a0")], **inputs)
        assert set(plan.pushes) == {"worker-0"} and len(other.pushes) == 1
    finally:
        await controller.client.close()
        await other.stop()


@pytest.mark.parametrize("how", ["unanswered", "cut_short"])
async def test_a_push_without_an_answer_is_not_taken_as_accepted(stager, how):
    """A push that landed but got no answer (the reply timed out, or the pass was cancelled while waiting:
    operator stopping, handler cancelled): the pod holds either push, so the next pass re-pushes. Here an
    edit is reverted: a stale record would match it, and no report shows the priority that landed."""
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0, push_timeout=0.2 if how == "unanswered" else None))
    pods = [pod_body("worker-0", stager.port)]
    try:
        await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
        stager.stall = asyncio.Event()
        edited = controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", priority=5)], pods=pods)
        if how == "unanswered":
            await edited
        else:
            cut = asyncio.create_task(edited)
            await eventually(lambda: stager.applied.by_name()["sql"].priority == 5, "the push applied")
            cut.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cut
        assert stager.applied.by_name()["sql"].priority == 5  # applied; the reply never came
        stager.stall.set()
        stager.stall = None
        # A push cut short goes on in the background (push_flights.py): its answer, once in, is the next pass's.
        await eventually(lambda: not controller.flights.in_flight(KEY), "the push cut short answered")
        plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql")], pods=pods)
        assert set(plan.pushes) == {"worker-0"} and stager.applied.by_name()["sql"].priority == 0
    finally:
        if stager.stall is not None:
            stager.stall.set()
        await controller.client.close()


async def test_no_memory_is_kept_for_a_pool_that_is_gone(stager):
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    inputs = {"adapters": [adapter_body("sql")], "pods": [pod_body("worker-0", stager.port)]}
    try:
        await controller.run(KEY, pools=[POOL], **inputs)
        controller.forget(KEY)  # its finalizer, done
        # A pass that ends after it (an adapter's timer): the pool is not listed any more.
        await controller.run(KEY, pools=[], **inputs)
        assert KEY not in controller.push_records
        # Pools deleted while this replica stood by: dropped when a pool timer names the live ones.
        await controller.run(KEY, pools=[POOL], **inputs)
        controller.retain({(NS, "other")})
        assert controller.known_pools() == []
    finally:
        await controller.client.close()


def relabeled(pod: dict, labels: dict) -> dict:
    return {**pod, "metadata": {**pod["metadata"], "labels": labels}}


async def test_a_released_pod_is_emptied_unless_another_pool_takes_it(stager):
    """Both pods leave "main"'s selector (their labels changed): worker-1 is "zeta"'s now and left to it;
    worker-0 no pool selects, so it is told to hold nothing, pinned adapters included, as a deleting pool's
    workers are, and a deleting adapter's finalizer waits for it too. Once it holds nothing it is let go."""
    other = FakeStager(TOKEN)
    await other.start()
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    pods, zeta = pods_and_zeta(stager, other)
    sql = adapter_body("sql", pinned=True, warm="all")
    chat = adapter_body("chat", warm="all")
    deleting_chat = {**chat, "metadata": {**chat["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods, other_pools=[zeta])
        assert all({d.name for d in s.applied.adapters} == {"sql", "chat"} for s in (stager, other))
        moved = [relabeled(pods[0], {}), relabeled(pods[1], {"gpu": "h200"})]
        inputs = {"pools": [POOL], "adapters": [sql, deleting_chat], "pods": moved, "other_pools": [zeta]}
        plan = await controller.run(KEY, **inputs)
        assert set(plan.pushes) == {"worker-0"} and plan.pushes["worker-0"].adapters == []
        assert stager.applied.adapters == []
        assert plan.releasing == ["worker-0"] and plan.unloading == {"chat": ["worker-0"]}  # as reported before
        assert len(other.pushes) == 1 and {d.name for d in other.applied.adapters} == {"sql", "chat"}
        assert plan.adapter_statuses["sql"]["instances"] == []  # statuses count the pool's own pods only

        num_pushes = len(stager.pushes)
        plan = await controller.run(KEY, **inputs)
        assert plan.releasing == [] and plan.unloading == {"chat": []} and plan.pushes == {}
        assert len(controller.push_records[KEY]) == 0  # holds nothing: let go
        assert (await controller.run(KEY, **inputs)).pushes == {} and len(stager.pushes) == num_pushes
        # Selected again, then released while not ready (remembered, nothing to reach), then simply gone: no error.
        await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods[:1], other_pools=[zeta])
        assert [d.name for d in stager.applied.adapters] == ["sql"] and len(controller.push_records[KEY]) == 1
        not_ready = relabeled(pods[0], {})
        not_ready["status"] = {**not_ready["status"], "phase": "Pending"}
        plan = await controller.run(KEY, pools=[POOL], adapters=[sql], pods=[not_ready], other_pools=[zeta])
        assert plan.pushes == {} and plan.releasing == [] and len(controller.push_records[KEY]) == 1
        plan = await controller.run(KEY, pools=[POOL], adapters=[sql], pods=[], other_pools=[zeta])
        assert plan.pushes == {} and len(controller.push_records[KEY]) == 0
    finally:
        await controller.client.close()
        await other.stop()


async def test_a_pod_released_while_the_pool_spec_was_invalid_is_emptied_once_it_is_fixed(stager):
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    inputs = {"adapters": [adapter_body("sql", pinned=True)], "pods": [pod_body("worker-0", stager.port)]}
    moved = {"workerSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}
    invalid = {**POOL, "spec": {**POOL["spec"], **moved, "eviction": "fifo"}}
    fixed = {**POOL, "spec": {**POOL["spec"], **moved}}
    try:
        await controller.run(KEY, pools=[POOL], **inputs)
        assert (await controller.run(KEY, pools=[invalid], **inputs)).pushes == {}  # left as it is meanwhile
        assert [d.name for d in stager.applied.adapters] == ["sql"]
        plan = await controller.run(KEY, pools=[fixed], **inputs)
        assert set(plan.pushes) == {"worker-0"} and stager.applied.adapters == []
    finally:
        await controller.client.close()


async def test_a_pod_released_while_the_operator_was_down_is_emptied(stager):
    """The pods a pool pushed to are kept in its status.pushedPods: a new operator (a restart, a new leader)
    finds there a pod the pool stopped selecting meanwhile and empties it, as the one before would have.
    A pod the status does not name (never pushed to) is left alone, and one re-created under its name (a new
    uid) is not the pod pushed to."""
    other = FakeStager(TOKEN)
    await other.start()
    pods = [with_uid(pod_body("worker-0", stager.port), "a0"), with_uid(pod_body("worker-1", other.port), "a1")]
    inputs = {"adapters": [adapter_body("sql", pinned=True, warm="all")]}
    first = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    second = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    try:
        plan = await first.run(KEY, pools=[POOL], pods=pods[:1], **inputs)
        assert plan.pool_status["pushedPods"] == [{"name": "worker-0", "uid": "a0"}]
        other.applied = stager.applied  # holds the same, pushed by someone else
        # The operator restarts; meanwhile both pods left the pool (their labels changed) and worker-1 came.
        pool = {**POOL, "status": plan.pool_status}
        moved = [relabeled(pods[0], {}), relabeled(pods[1], {})]
        plan = await second.run(KEY, pools=[pool], pods=moved, **inputs)
        assert set(plan.pushes) == {"worker-0"} and stager.applied.adapters == [] and plan.releasing == ["worker-0"]
        assert other.pushes == [] and [d.name for d in other.applied.adapters] == ["sql"]
        plan = await second.run(KEY, pools=[pool], pods=moved, **inputs)
        assert plan.releasing == [] and plan.pool_status["pushedPods"] == []  # holds nothing: let go
        # Re-created under its name before the new operator's first pass: not the pod pushed to.
        third = PoolController(StagerClient(token=TOKEN, timeout=2.0))
        stager.applied = other.applied
        recreated = relabeled(with_uid(pod_body("worker-0", stager.port), "b0"), {})
        try:
            assert (await third.run(KEY, pools=[{**POOL, "status": {"pushedPods": [{"name": "worker-0", "uid": "a0"}]}}],
                                    pods=[recreated], **inputs)).pushes == {}
        finally:
            await third.client.close()
    finally:
        await first.client.close()
        await second.client.close()
        await other.stop()


async def test_an_adapter_deleted_while_the_pool_spec_is_invalid_is_still_unloaded(stager):
    """An invalid pool leaves its pods as they are, except that an adapter being deleted leaves them: each is
    told what it last accepted less that adapter, and the adapter's finalizer waits for it. A new operator
    that does not know what a pod last accepted cannot tell it (it would have to guess the rest of its set):
    it says so, and the finalizer waits for the spec to be fixed."""
    pods = [pod_body("worker-0", stager.port)]
    sql, chat = adapter_body("sql"), adapter_body("chat")
    deleting_chat = {**chat, "metadata": {**chat["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    invalid = {**POOL, "spec": {**POOL["spec"], "eviction": "fifo"}}
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    restarted = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql, chat], pods=pods)
        assert (await controller.run(KEY, pools=[invalid], adapters=[sql, chat], pods=pods)).pushes == {}
        plan = await restarted.run(KEY, pools=[invalid], adapters=[sql, deleting_chat], pods=pods)
        assert plan.pushes == {} and plan.unloading == {"chat": ["worker-0"]} and plan.unreachable == ["worker-0"]
        plan = await controller.run(KEY, pools=[invalid], adapters=[sql, deleting_chat], pods=pods)
        assert set(plan.pushes) == {"worker-0"} and [d.name for d in stager.applied.adapters] == ["sql"]
        assert plan.unloading == {"chat": ["worker-0"]}  # as reported before the push
        plan = await controller.run(KEY, pools=[invalid], adapters=[sql, deleting_chat], pods=pods)
        assert plan.pushes == {} and plan.unloading == {"chat": []} and plan.unreachable == []
    finally:
        await controller.client.close()
        await restarted.client.close()


async def test_a_replica_leading_again_empties_a_pod_another_leader_pushed_to_and_released(stager):
    """Replica A pushed to worker-0, then stood by; B led, pushed to worker-1 (a new pod) and wrote both in
    status.pushedPods; worker-1 then left the pool. A leads again: what it remembers lacks worker-1, but
    the status names it, so A empties it. A status that lags behind (naming a pod A already let go, which
    holds nothing) costs no push."""
    other = FakeStager(TOKEN)
    await other.start()
    pods = [with_uid(pod_body("worker-0", stager.port), "a0"), with_uid(pod_body("worker-1", other.port), "a1")]
    inputs = {"adapters": [adapter_body("sql", warm="all")]}
    a, b = (PoolController(StagerClient(token=TOKEN, timeout=2.0)) for _ in range(2))
    try:
        await a.run(KEY, pools=[POOL], pods=pods[:1], **inputs)
        plan = await b.run(KEY, pools=[POOL], pods=pods, **inputs)
        assert plan.pool_status["pushedPods"] == [{"name": "worker-0", "uid": "a0"}, {"name": "worker-1", "uid": "a1"}]
        pool = {**POOL, "status": plan.pool_status}
        moved = [pods[0], relabeled(pods[1], {})]
        plan = await a.run(KEY, pools=[pool], pods=moved, **inputs)
        assert "worker-1" in plan.pushes and other.applied.adapters == []
        plan = await a.run(KEY, pools=[pool], pods=moved, **inputs)
        assert plan.releasing == [] and plan.pool_status["pushedPods"] == [{"name": "worker-0", "uid": "a0"}]
        num_pushes = len(other.pushes)
        plan = await a.run(KEY, pools=[pool], pods=moved, **inputs)  # the status still names worker-1
        assert plan.pushes == {} and len(other.pushes) == num_pushes and plan.releasing == []
    finally:
        await a.client.close()
        await b.client.close()
        await other.stop()


async def test_an_invalid_pools_adapters_say_what_its_pods_still_serve(stager):
    """An invalid pool leaves its pods as they are; its adapters' status read nothing served (no stable
    version, no instances) unless some adapter was being deleted, the only case its pods were read."""
    pods = [pod_body("worker-0", stager.port)]
    sql = adapter_body("sql")
    invalid = {**POOL, "spec": {**POOL["spec"], "eviction": "fifo"}}
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0))
    try:
        await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods)
        status = (await controller.run(KEY, pools=[POOL], adapters=[sql], pods=pods)).adapter_statuses["sql"]
        assert status["phase"] == "Ready" and status["stableVersion"] == "v1"
        pushed = len(stager.pushes)
        plan = await controller.run(KEY, pools=[invalid], adapters=[{**sql, "status": status}], pods=pods)
        status = plan.adapter_statuses["sql"]
        assert status["phase"] == "Degraded" and "its pods keep what they were last told" in status["message"]
        assert status["stableVersion"] == "v1" and [i["pod"] for i in status["instances"]] == ["worker-0"]
        assert len(stager.pushes) == pushed  # read, never told anything
    finally:
        await controller.client.close()
