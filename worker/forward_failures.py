"""Forwards failing in a row: one failed forward fails only its requests (a bad adapter, a batch the
kernels refuse) and the engine serves on, but a run of them means the device is broken (e.g. a lasting
CUDA error) and every request would fail. After `limit` in a row the AsyncEngine's thread ends as on a
bug, so /healthz and /readyz answer 503 and the container is restarted; a successful forward resets it.

    with engine.forward_failures:  # counts the forward (and sampling) inside
        ...
    engine.forward_failures.check()  # raises EngineUnhealthy after `limit` in a row
"""

from __future__ import annotations


class EngineUnhealthy(RuntimeError):
    """`limit` forwards in a row failed: the engine can no longer serve."""


class ForwardFailures:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_failed_forwards must be >= 1, got {limit}")
        self.limit = limit
        self.in_a_row = 0
        self.last: BaseException | None = None  # the latest failure of the run

    def __enter__(self) -> ForwardFailures:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            self.in_a_row, self.last = 0, None
        elif isinstance(exc, Exception):
            self.in_a_row += 1
            self.last = exc
        return False  # the caller fails the forward's requests

    def check(self) -> None:
        if self.in_a_row >= self.limit:
            raise EngineUnhealthy(f"{self.in_a_row} forwards in a row failed (--max-failed-forwards "
                                  f"{self.limit}); the last: {self.last!r}") from self.last
