"""Passes of one pool that meet: a push still in flight across passes, and a pool forgotten while a call waits
for its lock."""

from __future__ import annotations

import asyncio

from lorafleet.operator.controller import PoolController
from lorafleet.operator.workers import StagerClient

from .fake_stager import FakeStager
from .test_handlers import NS, POOL, TOKEN, adapter_body, eventually, pod_body
from .test_push_flights import failing_pod

KEY = (NS, "main")


async def test_a_push_queued_behind_one_in_flight_is_no_retry_of_a_failed_version():
    """A pod whose version failed, with its push still unanswered for minutes: each pass queues a push behind it
    (sent only if the answer takes another set), so none of them is a retry. Counted as one, the backoff doubled
    on every pass while nothing was sent, and the first real retry came minutes late."""
    async with FakeStager(TOKEN) as stager:
        now = [1000.0]
        controller, inputs = failing_pod(stager, now, cap=300)
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
