"""A pod slow to answer a push delays no other pod's directive: pushes run as per-pod flights that a pass
waits on briefly only; a pod with a push in flight gets the newest directive once it answers, and is not
taken as having applied anything meanwhile."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.operator.controller import PoolController
from lorafleet.operator.push_flights import PushFlights
from lorafleet.operator.workers import Refused, StagerClient, Worker
from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef

from .crd_validation import crd_schema, validate
from .fake_stager import FakeStager
from .test_handlers import NS, POOL, TOKEN, adapter_body, eventually, pod_body

KEY = (NS, "main")
CANARY = {"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}, "weight": 20}


def weight(stager: FakeStager) -> int:
    return stager.applied.by_name()["sql"].canary_weight


def two_pods(fast: FakeStager, slow: FakeStager, *, push_wait: float):
    """A controller over worker-0 (``fast``) and worker-1 (``slow``, the one a test stalls), and a call of a pass
    with adapter sql's spec."""
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0, push_timeout=600.0), push_wait=push_wait)
    pods = [pod_body("worker-0", fast.port), pod_body("worker-1", slow.port)]

    def run(max_age: float = 0.0, **spec):
        return controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", **spec)], pods=pods, max_age=max_age)

    return controller, run


def failing_pod(stager: FakeStager, now: list[float], *, cap: float):
    """A controller (its clock ``now[0]``, retries every 10 s doubling up to ``cap``) over one pod whose version
    of sql fails, and the inputs of its passes."""
    controller = PoolController(StagerClient(token=TOKEN, timeout=2.0, push_timeout=600.0), retry_base=10,
                                retry_cap=cap, push_wait=0.05, clock=lambda: now[0])
    stager.unavailable.add(("sql", "v1"))
    return controller, {"pools": [POOL], "adapters": [adapter_body("sql")], "pods": [pod_body("worker-0", stager.port)]}


async def test_a_rollback_reaches_the_other_pods_while_one_has_not_answered_its_last_push():
    async with FakeStager(TOKEN) as fast, FakeStager(TOKEN) as slow:
        # A push timeout far longer than the test: only the flight design lets the passes end.
        controller, run = two_pods(fast, slow, push_wait=0.1)

        try:
            await run(canary=CANARY)
            await eventually(lambda: not controller.flights.in_flight(KEY), "the first pushes answered")
            slow.stall = asyncio.Event()  # worker-1 applies its next push, and answers only once this is set
            plan = await run(canary={**CANARY, "weight": 50})
            await eventually(lambda: weight(fast) == 50 and weight(slow) == 50, "50 % applied")
            assert controller.flights.in_flight(KEY) == ["worker-1"]
            slow_worker = Worker("worker-1", f"http://127.0.0.1:{slow.port}")
            record = controller.push_records[KEY]
            assert record.last(slow_worker) is None  # not answered: not taken as applied
            num_slow_pushes = len(slow.pushes)
            # The canary is bad: rolled back on worker-0 without waiting for worker-1's answer.
            plan = await run()
            await eventually(lambda: fast.applied.by_name()["sql"].canary is None, "worker-0 rolled back")
            assert "worker-1" in plan.pushes  # wanted, and queued on its flight
            await run()
            assert len(slow.pushes) == num_slow_pushes  # queued behind the push in flight, not sent again
            # Once worker-1 answers, it gets the newest directive with no pass running.
            slow.stall.set()
            await eventually(lambda: slow.applied.by_name()["sql"].canary is None, "worker-1 rolled back")
            assert len(slow.pushes) == num_slow_pushes + 1
            await eventually(lambda: not controller.flights.in_flight(KEY), "worker-1 answered")
            plan = await run()  # its answer is this pass's: accepted, nothing to push
            assert plan.pushes == {} and plan.adapter_statuses["sql"]["phase"] == "Ready"
        finally:
            if slow.stall is not None:
                slow.stall.set()
            await controller.flights.close()


class Client:
    """StagerClient.push, answering each push once its event is set."""

    def __init__(self) -> None:
        self.pushed: list[int] = []  # generations, in order
        self.answer: dict[int, asyncio.Event] = {}

    async def push(self, worker: Worker, desired: DesiredState):
        self.pushed.append(desired.generation)
        await self.answer.setdefault(desired.generation, asyncio.Event()).wait()
        return True

    async def close(self) -> None:
        pass


def state(generation: int, version: str) -> DesiredState:
    ref = VersionRef(version, f"s3://adapters/sql/{version}/")
    return DesiredState(generation, [AdapterDirective(name="sql", tenant="acme", stable=ref)])


async def test_a_pod_answering_late_gets_only_the_newest_set_and_none_it_already_holds():
    client = Client()
    flights = PushFlights(client, wait=0.0)
    w = Worker("worker-0", "http://10.0.0.1:8001")
    assert await flights.push(KEY, {w.pod: (w, state(1, "v1"))}) == {}  # not answered yet
    await flights.push(KEY, {w.pod: (w, state(2, "v2"))})
    await flights.push(KEY, {w.pod: (w, state(3, "v3"))})  # replaces generation 2, never sent
    client.answer[1].set()
    await eventually(lambda: client.pushed == [1, 3], "the newest pushed once the first is answered")
    client.answer.setdefault(3, asyncio.Event()).set()
    await eventually(lambda: not flights.in_flight(KEY), "answered")
    [(worker, desired, outcome)] = flights.settle(KEY)
    assert (worker, desired.generation, outcome) == (w, 3, True) and flights.settle(KEY) == []
    # Queued behind a push of the same set (a generation apart only): not pushed again once it is accepted.
    await flights.push(KEY, {w.pod: (w, state(4, "v4"))})
    await flights.push(KEY, {w.pod: (w, state(5, "v4"))})
    client.answer.setdefault(4, asyncio.Event()).set()
    await eventually(lambda: not flights.in_flight(KEY), "answered")
    assert client.pushed == [1, 3, 4] and flights.settle(KEY)[0][1].generation == 4
    await flights.close()


class _HookedClient(StagerClient):
    """Reads the sidecars after running `hook` once (a moment in the middle of a pass); pushes to the pod of
    uid "old" refused with a 413 once `release_old` is set."""

    hook = None

    def __init__(self, **kw):
        super().__init__(**kw)
        self.release_old = asyncio.Event()

    async def fetch_states(self, workers, **kw):
        if self.hook is not None and workers:
            hook, self.hook = self.hook, None
            await hook()
        return await super().fetch_states(workers, **kw)

    async def push(self, worker, desired):
        if worker.uid == "old":
            await self.release_old.wait()
            return Refused(413, "adapter set over the sidecar's --max-cpu-bytes")
        return await super().push(worker, desired)


async def test_an_earlier_pushs_late_answer_is_not_taken_for_the_newer_push_still_unanswered():
    """The answer to pass 1's push came while pass 2 read the sidecars; pass 2 pushed a newer set (adding x),
    not answered within its wait, and took that earlier answer as its own: the pod counted as holding pass 1's
    set (an adapter's finalizer elsewhere could skip it), though it might hold x already."""
    async with FakeStager(TOKEN) as stager:
        client = _HookedClient(token=TOKEN, timeout=2.0, push_timeout=600.0)
        controller = PoolController(client, push_wait=0.2)
        pods = [pod_body("worker-0", stager.port)]
        first, second = asyncio.Event(), asyncio.Event()
        try:
            stager.stall = first  # pass 1's push lands, its answer late
            await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", warm=1)], pods=pods)
            assert controller.flights.in_flight(KEY) == ["worker-0"]

            async def answer_the_first_push():
                stager.stall = second  # pass 2's push lands, its answer late too
                first.set()
                await eventually(lambda: not controller.flights.in_flight(KEY), "the first push answered")

            client.hook = answer_the_first_push
            plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", warm=1), adapter_body("x", warm=1)],
                                        pods=pods)
            assert "worker-0" in plan.pushes and controller.flights.in_flight(KEY) == ["worker-0"]
            assert controller.push_records[KEY].last(Worker("worker-0", f"http://127.0.0.1:{stager.port}")) is None
            assert controller.may_hold(KEY, "x", [POOL])
        finally:
            first.set()
            second.set()
            await controller.flights.close()


async def test_a_deleted_pods_late_refusal_is_not_blamed_on_the_pod_re_created_under_its_name():
    async with FakeStager(TOKEN) as stager:
        client = _HookedClient(token=TOKEN, timeout=2.0, push_timeout=600.0)
        controller = PoolController(client, push_wait=0.2)

        def pod(uid: str) -> dict:
            body = pod_body("worker-0", stager.port)
            body["metadata"]["uid"] = uid
            return body

        try:
            await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", warm=1)], pods=[pod("old")])
            client.release_old.set()  # the deleted pod's refusal comes late
            await eventually(lambda: not controller.flights.in_flight(KEY), "the old pod answered")
            stager.stall = asyncio.Event()  # the new pod's first push: answered once staged, later
            plan = await controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", warm=1)], pods=[pod("new")])
            ready = next(c for c in plan.pool_status["conditions"] if c["type"] == "Ready")
            assert "refused" not in ready["message"], ready
        finally:
            if stager.stall is not None:
                stager.stall.set()
            await controller.flights.close()


async def test_a_failed_version_on_a_pod_answering_after_the_wait_is_re_pushed_with_a_doubling_backoff():
    """A pod whose every push is answered after the pass's wait: each retry counts as one (it was sent) and the
    next waits twice as long; counted only when answered within the wait, every pass past the first base period
    re-pushed it."""
    async with FakeStager(TOKEN) as stager:
        now = [1000.0]
        controller, inputs = failing_pod(stager, now, cap=60)
        pushed_at = []
        try:
            for t in range(0, 90, 10):  # a pass every 10 s
                now[0] = 1000.0 + t
                stager.stall = asyncio.Event()  # a push is applied; its answer comes once the pass has ended
                plan = await controller.run(KEY, **inputs)
                stager.stall.set()
                await eventually(lambda: not controller.flights.in_flight(KEY), "the push answered")
                if plan.pushes:
                    pushed_at.append(t)
            assert plan.failing == ["worker-0"]
            # The first push, then retries 10 s after the failure was seen (at 10 s), then 20 s, then 40 s later.
            assert pushed_at == [0, 20, 40, 80]
        finally:
            stager.stall.set()
            await controller.flights.close()


@pytest.mark.parametrize("call", ["rollback", "timer"])
async def test_a_pass_queued_behind_one_waiting_for_its_pushes_answers_is_not_held_up_by_that_wait(call):
    """A pass that has just pushed to a slow pod waits for its answer holding the pool's lock: a rollback's pass
    queued behind it waited as long, for a pod whose push it merely queues. The waiting pass stops waiting once
    another pass wants the pool; the pod's answer goes to a later pass. A timer's call that the pass in flight
    serves (its plan young enough) lets it wait, but only while that plan may serve it: it waited out the whole
    push wait, then ran a pass of its own all the same."""
    async with FakeStager(TOKEN) as fast, FakeStager(TOKEN) as slow:
        # A push wait far longer than the test: only a pass that stops waiting lets the rollback through.
        controller, run = two_pods(fast, slow, push_wait=600.0)

        first = rollback = None
        try:
            await run()
            slow.stall = asyncio.Event()  # worker-1 applies its next push, and answers only once this is set
            first = asyncio.create_task(run(canary=CANARY))
            await eventually(lambda: weight(fast) == 20 and weight(slow) == 20, "the canary pushed")
            rollback = asyncio.create_task(run() if call == "rollback" else run(max_age=0.5, canary=CANARY))
            await eventually(rollback.done, "the second call ended while worker-1 has not answered")
            assert first.done() and controller.flights.in_flight(KEY) == ["worker-1"]
            if call == "timer":
                return
            assert fast.applied.by_name()["sql"].canary is None and "worker-1" in rollback.result().pushes
            slow.stall.set()
            await eventually(lambda: slow.applied.by_name()["sql"].canary is None, "worker-1 rolled back")
        finally:
            slow.stall.set()
            await asyncio.gather(*(t for t in (first, rollback) if t is not None), return_exceptions=True)
            await controller.flights.close()


async def test_the_pool_status_names_the_pods_with_a_push_in_flight():
    """status.pushing: the pods whose push is not answered yet (what they hold is not known meanwhile), a field
    of the pool's CRD (the API server prunes a status field its schema does not list)."""
    async with FakeStager(TOKEN) as fast, FakeStager(TOKEN) as slow:
        controller, run = two_pods(fast, slow, push_wait=0.1)

        try:
            await run()
            slow.stall = asyncio.Event()  # worker-1 applies its next push, and answers only once this is set
            plan = await run(canary=CANARY)
            assert "worker-1" in plan.pool_status["pushing"]  # (worker-0 too, unless it answered within the wait)
            assert set(plan.pool_status) <= set(crd_schema("lorapools")["properties"]["status"]["properties"])
            validate({**POOL, "status": plan.pool_status}, "lorapools")
            slow.stall.set()
            await eventually(lambda: not controller.flights.in_flight(KEY), "worker-1 answered")
            assert (await run(canary=CANARY)).pool_status["pushing"] == []
        finally:
            if slow.stall is not None:
                slow.stall.set()
            await controller.flights.close()
