"""TimerTasks: stopping the operator stops each timer kopf did not tell to stop, and any that starts later."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.operator.timer_tasks import TimerTasks


class Stopped:
    """kopf's ``stopped`` flag as a timer handler sees it: true once kopf told the timer to stop."""

    def __init__(self, is_set: bool) -> None:
        self.is_set = is_set

    def __bool__(self) -> bool:
        return self.is_set


async def test_stop_cancels_the_timers_kopf_did_not_tell_to_stop():
    timers = TimerTasks()
    passes: list[str] = []

    async def timer(name: str, stopped: Stopped) -> None:
        while True:  # kopf's loop: the handler, then a sleep until the next pass
            if timers.enter(stopped):
                passes.append(name)
            await asyncio.sleep(60)

    told, untold = (asyncio.create_task(timer(n, Stopped(n == "told"))) for n in ("told", "untold"))
    await asyncio.sleep(0)
    assert passes == ["told", "untold"]
    assert timers.stop() == 1 and timers.is_stopping
    with pytest.raises(asyncio.CancelledError):
        await untold
    assert not told.done()  # kopf ends it (it wakes from its sleep and exits)
    told.cancel()

    late = asyncio.create_task(timer("late", Stopped(False)))  # spawned by a watch event handled after that
    with pytest.raises(asyncio.CancelledError):
        await late
    assert passes == ["told", "untold"]


class StopFlag:
    """kopf's ``stopped`` flag with its wait(), for ``TimerTasks.run``."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


async def test_run_gives_the_pass_result_and_cuts_a_pass_short_when_the_timer_is_told_to_stop():
    timers, stopped = TimerTasks(), StopFlag()

    async def quick() -> str:
        return "wanted"

    assert await timers.run(stopped, quick()) == "wanted"

    cancelled = asyncio.Event()

    async def waiting_on_a_server() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    timer = asyncio.create_task(timers.run(stopped, waiting_on_a_server()))
    await asyncio.sleep(0)
    stopped.event.set()
    assert await asyncio.wait_for(timer, 1) is None and cancelled.is_set()


async def test_run_passes_on_the_pass_error_and_ends_the_pass_when_the_timer_is_cancelled():
    timers, stopped = TimerTasks(), StopFlag()

    async def failing() -> None:
        raise ValueError("bad spec")

    with pytest.raises(ValueError, match="bad spec"):
        await timers.run(stopped, failing())

    cancelled = asyncio.Event()

    async def waiting_on_a_server() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    timer = asyncio.create_task(timers.run(stopped, waiting_on_a_server()))
    await asyncio.sleep(0)
    timer.cancel()  # TimerTasks.stop
    with pytest.raises(asyncio.CancelledError):
        await timer
    assert cancelled.is_set()
