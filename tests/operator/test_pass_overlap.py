"""Passes of one pool that meet: a push still in flight across passes, a timer's call arriving while a pass waits
for its pushes' answers, and a pool forgotten while a call waits for its lock."""

from __future__ import annotations

import asyncio

from lorafleet.operator.controller import PoolController
from lorafleet.operator.workers import StagerClient

from .fake_stager import FakeStager
from .test_handlers import NS, POOL, TOKEN, adapter_body, eventually, pod_body
from .test_push_flights import CANARY, weight

KEY = (NS, "main")


async def test_a_push_queued_behind_one_in_flight_is_no_retry_of_a_failed_version():
    """A pod whose version failed, with its push still unanswered for minutes: each pass queues a push behind it
    (sent only if the answer takes another set), so none of them is a retry. Counted as one, the backoff doubled
    on every pass while nothing was sent, and the first real retry came minutes late."""
    async with FakeStager(TOKEN) as stager:
        now = [1000.0]
        controller = PoolController(StagerClient(token=TOKEN, timeout=2.0, push_timeout=600.0), retry_base=10,
                                    retry_cap=300, push_wait=0.05, clock=lambda: now[0])
        stager.unavailable.add(("sql", "v1"))
        inputs = {"pools": [POOL], "adapters": [adapter_body("sql")], "pods": [pod_body("worker-0", stager.port)]}
        stager.stall = asyncio.Event()  # the first push is applied (and fails); its answer comes at t=60
        sent_at = []
        try:
            for t in range(0, 300, 10):
                now[0] = 1000.0 + t
                if t == 60:
                    stager.stall.set()
                    await eventually(lambda: not controller.flights.in_flight(KEY), "the first push answered")
                sent = len(stager.pushes)
                await controller.run(KEY, **inputs)
                if t >= 60:
                    await eventually(lambda: not controller.flights.in_flight(KEY), "answered")
                if len(stager.pushes) > sent:
                    sent_at.append(t)
        finally:
            stager.stall.set()
            await controller.flights.close()
        # Retried once its base period has passed and the pod answered, then after 20, 40 and 80 s.
        assert sent_at == [0, 60, 80, 120, 200], sent_at


async def test_a_timer_s_call_served_by_the_pass_in_flight_waits_no_longer_than_its_plan_may_be_old():
    """A timer's call that the pass in flight serves (its plan young enough) does not cut that pass's wait for its
    pushes' answers at once; but once that plan would be too old, it does: the call waited out the whole push
    wait behind a slow pod, and then ran a pass of its own all the same."""
    async with FakeStager(TOKEN) as fast, FakeStager(TOKEN) as slow:
        controller = PoolController(StagerClient(token=TOKEN, timeout=2.0, push_timeout=600.0), push_wait=600.0)
        pods = [pod_body("worker-0", fast.port), pod_body("worker-1", slow.port)]

        def run(max_age: float = 0.0, **spec):
            return controller.run(KEY, pools=[POOL], adapters=[adapter_body("sql", **spec)], pods=pods,
                                  max_age=max_age)

        first = timer = None
        try:
            await run()
            slow.stall = asyncio.Event()  # worker-1 applies its next push, and answers only once this is set
            first = asyncio.create_task(run(canary=CANARY))
            await eventually(lambda: weight(fast) == 20 and weight(slow) == 20, "the canary pushed")
            timer = asyncio.create_task(run(max_age=0.5, canary=CANARY))
            await eventually(timer.done, "the timer's call ended while worker-1 has not answered")
            assert first.done() and controller.flights.in_flight(KEY) == ["worker-1"]
        finally:
            slow.stall.set()
            await asyncio.gather(*(t for t in (first, timer) if t is not None), return_exceptions=True)
            await controller.flights.close()


async def test_a_pool_forgotten_while_a_call_waits_for_its_lock_never_runs_two_passes_at_once():
    """A lock just released reads as unlocked until its waiter wakes: forgetting the pool then dropped the lock,
    a new call made another, and two passes ran side by side (the one ending second failed with a KeyError)."""
    async with FakeStager(TOKEN) as stager:
        controller = PoolController(StagerClient(token=TOKEN, timeout=2.0, push_timeout=5.0), push_wait=0.05)
        inputs = {"pools": [POOL], "adapters": [adapter_body("sql")], "pods": [pod_body("w", stager.port)]}
        loop = asyncio.get_running_loop()
        run_pass, later, running, most = controller._run, [], [0], [0]

        async def counted(*args, **kwargs):
            running[0] += 1
            most[0] = max(most[0], running[0])
            try:
                if most[0] > 0 and not later:
                    await asyncio.sleep(0.05)
                plan = await run_pass(*args, **kwargs)
            finally:
                running[0] -= 1
            if not later:  # in the moment between this release and the waiter's wake-up, the pool is forgotten
                loop.call_soon(lambda: (controller.retain(set()),
                                        later.append(asyncio.ensure_future(controller.run(KEY, **inputs)))))
            return plan

        controller._run = counted
        try:
            first = asyncio.ensure_future(controller.run(KEY, **inputs))
            await asyncio.sleep(0)
            waiting = asyncio.ensure_future(controller.run(KEY, **inputs))  # queued on the lock
            await asyncio.gather(first, waiting)
            await eventually(lambda: bool(later), "a call after the pool was forgotten")
            await asyncio.gather(*later)
        finally:
            await controller.flights.close()
        assert most[0] == 1, most
