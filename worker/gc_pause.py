"""The garbage collector paused while a parser builds many objects at once.

A JSON document of a million small lists or objects (a request body, a safetensors header: a field nobody reads)
is built with the interpreter lock held, and the collections its allocations start walk every object built so
far: most of the parse's time (a 4 MB body of `{"": []}` items: 0.55 s with them, 0.12 s without), during which no
other thread runs. Pauses of several threads overlap: collections come back when the last one ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_pausers = 0  # threads inside collections_paused()
_resume = False  # whether collections were on when the first of them paused them


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    global _pausers, _resume
    with _lock:
        if _pausers == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0 and _resume:
                gc.enable()
