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
