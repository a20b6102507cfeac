"""PoolController.run when passes queue on a pool's lock: a pass answers a later call only if its inputs were
read after that call began."""

from __future__ import annotations

import asyncio

from lorafleet.operator.controller import PassInputs, PoolController
from lorafleet.operator.workers import StagerClient

from .fake_stager import FakeStager
from .test_controller import KEY
from .test_handlers import POOL, TOKEN, adapter_body, pod_body

CANARY = {"version": "v2", "source": {"uri": "s3://adapters/sql/v2/"}}


async def test_an_edit_queued_behind_a_timer_pass_that_read_its_inputs_before_it_gets_its_own_pass():
    """A timer's call read the adapters (weight 20) and waits behind a slow pass; the edit to weight 0 comes
    next. The timer's pass starts after the edit's call began, but with inputs from before it: the edit must
    not be answered with that plan (nothing pushed, the status of the old generation)."""
    async with FakeStager(TOKEN) as stager:
        controller = PoolController(StagerClient(token=TOKEN, timeout=5.0))
        pods = [pod_body("worker-0", stager.port)]
        at_20 = adapter_body("sql", canary=CANARY | {"weight": 20})
        at_0 = adapter_body("sql", canary=CANARY | {"weight": 0})
        at_0["metadata"]["generation"] = 2
        try:
            await controller.run(KEY, pools=[POOL], adapters=[at_20], pods=pods)
            gate, fetch = asyncio.Event(), controller.client.fetch_states

            async def slow(workers, **kw):  # a pass staging a large canary holds the pool's lock
                await gate.wait()
                return await fetch(workers, **kw)

            controller.client.fetch_states = slow
            slow_pass = asyncio.create_task(controller.run(KEY, pools=[POOL], adapters=[at_20], pods=pods))
            await asyncio.sleep(0)
            timer = asyncio.create_task(controller.run(KEY, pools=[POOL], adapters=[at_20], pods=pods,
                                                       max_age=0.0))
            await asyncio.sleep(0)
            edit = asyncio.create_task(controller.run(KEY, pools=[POOL], adapters=[at_0], pods=pods))
            await asyncio.sleep(0)
            gate.set()
            await asyncio.gather(slow_pass, timer)
            status = (await edit).adapter_statuses["sql"]
            assert (status["observedGeneration"], status["canaryWeight"]) == (2, 0)
            assert [d.canary_weight for d in stager.pushes[-1].adapters] == [0]
        finally:
            await controller.client.close()


async def test_calls_queued_behind_a_pass_are_answered_by_one_pass_that_reads_the_state_once_it_is_due():
    """Fifty calls (a mass deletion's finalizers) queue behind a slow pass: they are answered by one more pass,
    not one each, and that pass reads the state as it is when it runs (the last adapter edited meanwhile)."""
    async with FakeStager(TOKEN) as stager:
        controller = PoolController(StagerClient(token=TOKEN, timeout=5.0))
        pods = [pod_body("worker-0", stager.port)]
        state = {"adapters": [adapter_body("sql", canary=CANARY | {"weight": 20})]}
        reads = []

        def read() -> PassInputs:
            reads.append(len(reads))
            return PassInputs([POOL], list(state["adapters"]), pods, [], [])

        try:
            await controller.run_reading(KEY, read)
            gate, fetch = asyncio.Event(), controller.client.fetch_states

            async def slow(workers, **kw):
                await gate.wait()
                return await fetch(workers, **kw)

            controller.client.fetch_states = slow
            first = asyncio.create_task(controller.run_reading(KEY, read))
            while len(reads) < 2:  # the slow pass has read its inputs and holds the lock
                await asyncio.sleep(0)
            at_0 = adapter_body("sql", canary=CANARY | {"weight": 0})
            at_0["metadata"]["generation"] = 2
            state["adapters"] = [at_0]
            queued = [asyncio.create_task(controller.run_reading(KEY, read)) for _ in range(50)]
            await asyncio.sleep(0)
            gate.set()
            await first
            plans = await asyncio.gather(*queued)
            assert len(reads) == 3
            assert {p.adapter_statuses["sql"]["canaryWeight"] for p in plans} == {0}
            assert [d.canary_weight for d in stager.pushes[-1].adapters] == [0]
        finally:
            await controller.client.close()
