"""A thread that notes the time every `every_s` while a block runs: the gaps between its ticks show whether the
block let other threads run (or held the interpreter lock)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def ticking(every_s: float) -> Iterator[list[float]]:
    """Yields the list of tick times (time.perf_counter()), filled in while the block runs."""
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(every_s)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        yield ticks
    finally:
        done.set()
        thread.join()
