"""The tasks of the operator's kopf timers, so that stopping the operator stops every one of them at once.

When the operator stops, kopf tells the timers it knows of to stop (each wakes from its sleep and exits);
but a watch event still being handled then spawns a timer anew, after that, and nothing tells that one:
kopf waits 5 s for the tasks left running before it cancels them, so every stop took 5 s (and the late
timer ran passes against clients already closed). Each timer handler enters here first; once the watches
are over (the cleanup handler), ``stop`` cancels each timer kopf did not tell to stop, and a timer that
starts after that is cancelled as it enters, before its pass.

A pass itself ends as soon as kopf tells its timer to stop (``run``): kopf gives a stopping timer only a few
loop cycles before it logs it "did not exit in time" and leaves it running, so a pass waiting on a server
that does not answer (up to its request timeout) held the stop and ran on against clients being closed.
A pass cut short changes nothing: its patch is not written, and the next operator's pass starts afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable
from typing import TypeVar

import kopf

T = TypeVar("T")


class TimerTasks:
    def __init__(self) -> None:
        self.is_stopping = False
        # timer task -> its kopf stop flag (a task that ends, with its object, drops out)
        self._running: weakref.WeakKeyDictionary[asyncio.Task, kopf.DaemonStopped] = weakref.WeakKeyDictionary()

    def enter(self, stopped: kopf.DaemonStopped) -> bool:
        """Called first by each timer handler: whether it may run its pass (not once the operator stops)."""
        task = asyncio.current_task()
        if task is None:
            return not self.is_stopping
        if self.is_stopping:
            task.cancel()  # lands at the timer's next wait, after this handler returns: no pass, no new one
            return False
        self._running[task] = stopped
        return True

    def stop(self) -> int:
        """Cancel every timer kopf did not tell to stop (those it told finish the pass they are in); how many."""
        self.is_stopping = True
        orphans = [task for task, stopped in list(self._running.items()) if not stopped and not task.done()]
        for task in orphans:
            task.cancel()
        return len(orphans)

    async def run(self, stopped: kopf.DaemonStopped, work: Awaitable[T]) -> T | None:
        """``work`` (a timer's pass), cancelled as soon as kopf tells the timer to stop: its result, or None
        when it was cut short."""
        pass_task = asyncio.ensure_future(work)
        stop_task = asyncio.ensure_future(_stop_told(stopped))
        try:
            await asyncio.wait((pass_task, stop_task), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the timer itself is cancelled (``stop``)
            stop_task.cancel()
            if not pass_task.done():
                pass_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pass_task
        return None if pass_task.cancelled() else pass_task.result()


async def _stop_told(stopped: kopf.DaemonStopped) -> None:
    await stopped.wait()
