"""Forwards failing in a row: one failed forward fails only its requests (a bad adapter, a batch the
kernels refuse) and the engine serves on, but a run of them means the device is broken (e.g. a lasting
CUDA error) and every request would fail. After `limit` in a row the AsyncEngine's thread ends as on a
bug, so /healthz and /readyz answer 503 and the container is restarted; a successful forward resets it.

    engine.forward_failures.failed(exc)  # or .succeeded() once a forward ran
    engine.forward_failures.check()  # raises EngineUnhealthy after `limit` in a row

A forward of one adapter's requests alone that fails is that adapter's failure (a kernel refusing its shapes,
its weights), not the device's: it does not count (Engine._forward_failed runs a failed forward of several
adapters again one adapter at a time), unless a one-token forward without adapters fails too
(ModelRunner.probe): a broken device is found out by traffic of one adapter at a time as well.
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

    def succeeded(self) -> None:
        """A forward ran: the device works."""
        self.in_a_row, self.last = 0, None

    def failed(self, exc: BaseException, counted: bool = True) -> None:
        """A forward failed; `counted` False: one adapter's failure alone (its forward of that adapter only),
        which says nothing of the device (the run is neither longer nor over)."""
        if counted:
            self.in_a_row += 1
            self.last = exc

    def check(self) -> None:
        if self.in_a_row >= self.limit:
            raise EngineUnhealthy(f"{self.in_a_row} forwards in a row failed (--max-failed-forwards "
                                  f"{self.limit}); the last: {self.last!r}") from self.last
