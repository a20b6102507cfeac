"""IntakeWaits: a request that finds every intake place taken waits for one (--intake-wait-s) instead of a 429 at
once; places go to waiters tenants fairly, never to a newcomer ahead of them, and a waiter that leaves loses
nothing of anyone else's."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.worker.admission import INTAKE_FULL, TENANT_QUEUE_FULL, Admission
from lorafleet.worker.intake_waits import WAITERS_PER_PLACE, IntakeWaits


def _waits(max_intake: int, **admission) -> tuple[Admission, IntakeWaits]:
    a = Admission(capacity=1000, max_intake=max_intake, **admission)
    return a, IntakeWaits(a)


def _leave(admission: Admission, waits: IntakeWaits, tenant: str) -> None:
    admission.leave_intake(tenant)
    waits.wake()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_waiter_takes_the_place_that_frees_and_one_that_waits_too_long_is_refused():
    admission, waits = _waits(1)
    assert await waits.enter("a", True, False, 5.0) is None
    second = asyncio.create_task(waits.enter("b", True, False, 5.0))
    await _settle()
    assert not second.done() and waits.num_waiting == 1
    _leave(admission, waits, "a")
    assert await second is None and admission.num_in_intake_by_tenant == {"b": 1}
    assert await waits.enter("c", True, False, 0.05) == INTAKE_FULL  # nothing frees within its wait
    assert waits.num_waiting == 0 and admission.num_refused == 1 and admission.num_in_intake == 1
    assert await waits.enter("c", True, False, 0.0) == INTAKE_FULL  # 0: refused at once, as before


async def test_a_freed_place_goes_to_the_tenant_reading_the_fewest_requests_not_the_longest_queue():
    admission, waits = _waits(2)
    for _ in range(2):
        assert await waits.enter("a", True, False, 5.0) is None
    flood = [asyncio.create_task(waits.enter("a", True, False, 5.0)) for _ in range(5)]
    await _settle()
    other = asyncio.create_task(waits.enter("b", True, False, 5.0))
    await _settle()
    _leave(admission, waits, "a")  # a reads 1 now, b none: b's request goes first, although it came last
    assert await other is None and not any(t.done() for t in flood)
    _leave(admission, waits, "a")
    await _settle()
    assert sum(t.done() for t in flood) == 1  # then a's, in their order
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


async def test_a_newcomer_does_not_take_a_place_handed_to_a_waiter():
    admission, waits = _waits(1)
    assert await waits.enter("a", True, False, 5.0) is None
    waiter = asyncio.create_task(waits.enter("b", True, False, 5.0))
    await _settle()
    _leave(admission, waits, "a")  # handed to b, which has not run yet
    newcomer = asyncio.create_task(waits.enter("c", True, False, 5.0))
    assert await waiter is None
    await _settle()
    assert not newcomer.done() and admission.num_in_intake_by_tenant == {"b": 1}
    _leave(admission, waits, "b")
    assert await newcomer is None


async def test_a_waiter_that_leaves_after_being_handed_a_place_passes_it_on():
    admission, waits = _waits(1)
    assert await waits.enter("a", True, False, 5.0) is None
    first = asyncio.create_task(waits.enter("b", True, False, 5.0))
    await _settle()
    second = asyncio.create_task(waits.enter("c", True, False, 5.0))
    await _settle()
    _leave(admission, waits, "a")  # handed to b...
    first.cancel()  # ...whose client leaves before it takes it
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await second is None and admission.num_in_intake_by_tenant == {"c": 1}
    assert waits.num_waiting == 0


async def test_refusals_of_the_tenant_s_own_share_never_wait_and_waiters_are_bounded():
    admission, waits = _waits(1, max_per_tenant=1)
    assert await waits.enter("a", True, False, 5.0) is None
    assert await waits.enter("a", True, False, 5.0) == TENANT_QUEUE_FULL  # at once: retrying is what helps
    waiting = [asyncio.create_task(waits.enter(f"t{i}", True, False, 5.0)) for i in range(WAITERS_PER_PLACE)]
    await _settle()
    assert waits.num_waiting == WAITERS_PER_PLACE
    assert await asyncio.wait_for(waits.enter("late", True, False, 5.0), 1) == INTAKE_FULL  # past the bound: at once
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert waits.num_waiting == 0


async def test_every_free_place_is_handed_out_not_only_one_a_release():
    """Two places free while the one waiter is still to take the first: the second was handed to nobody, and a
    newcomer queued behind the woken waiter waited out its time beside it, then was refused."""
    admission, waits = _waits(2)
    for tenant in ("a", "b"):
        assert await waits.enter(tenant, True, False, 5.0) is None
    waiter = asyncio.create_task(waits.enter("w", True, False, 5.0))
    await _settle()
    _leave(admission, waits, "a")  # handed to the waiter, which has not run yet
    _leave(admission, waits, "b")  # nobody else waits: free
    newcomer = asyncio.create_task(waits.enter("n", True, False, 5.0))  # arrives before the waiter runs
    assert await waiter is None
    assert await asyncio.wait_for(newcomer, 1) is None
    assert admission.num_in_intake == 2 and waits.num_waiting == 0
