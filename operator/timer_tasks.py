"""The tasks of the operator's kopf timers, so that stopping the operator stops every one of them at once.

When the operator stops, kopf tells the timers it knows of to stop (each wakes from its sleep and exits);
but a watch event still being handled then spawns a timer anew, after that, and nothing tells that one:
kopf waits 5 s for the tasks left running before it cancels them, so every stop took 5 s (and the late
timer ran passes against clients already closed). Each timer handler enters here first; once the watches
are over (the cleanup handler), ``stop`` cancels each timer kopf did not tell to stop, and a timer that
starts after that is cancelled as it enters, before its pass.
"""

from __future__ import annotations

import asyncio
import weakref

import kopf


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
