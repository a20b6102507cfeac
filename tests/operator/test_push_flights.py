"""A pod slow to answer a push delays no other pod's directive: pushes run as per-pod flights that a pass
waits on briefly only; a pod with a push in flight gets the newest directive once it answers, and is not
taken as having applied anything meanwhile."""

from __future__ import annotations

import asyncio

from lorafleet.operator.controller import PoolController
from lorafleet.operator.push_flights import PushFlights
from lorafleet.operator.workers import StagerClient, Worker
from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef

from .fake_stager import FakeStager
from .test_handlers import NS, POOL, TOKEN, adapter_body, eventually, pod_body

KEY = (NS, "main")
CANARY = {"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}, "weight": 20}


def weight(stager: FakeStager) -> int:
    return stager.applied.by_name()["sql"].canary_weight


async def test_a_rollback_reaches_the_other_pods_while_one_has_not_answered_its_last_push():
    async with FakeStager(TOKEN) as fast, FakeStager(TOKEN) as slow:
        # A push timeout far longer than the test: only the flight design lets the passes end.
        controller = PoolController(StagerClient(token=TOKEN, timeout=2.0, push_timeout=600.0), push_wait=0.1)
        pods = [pod_body("worker-0", fast.port), pod_body("worker-1", slow.port)]

        def run(**spec):
            return controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", **spec)], pods=pods)

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
