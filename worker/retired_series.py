"""RetiredSeries: when the request series of a retired adapter version may leave /metrics.

A push that rolls a canary back retires its version while requests still run on it; they are counted
when they finish, and they are what the canary analysis needs most (often the failures that triggered
the rollback). Dropping the version's series at the push lost them: a request finishing later either
found no series or made a fresh one that went again at once, before any scrape. So a retired version's
series stay while a request holds the version (`acquire` when it resolves, `release` once it is
counted), and for `grace_s` after the later of the retirement and the last request's end, long enough
for a scrape to read the final counts (keep it above the scrape interval); then `expired` hands them
over to be dropped. Label cardinality stays bounded: the versions retired within the last `grace_s`,
plus those that running requests still hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Key = tuple[str, str]  # (adapter label, version)


class RetiredSeries:
    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self._holds: dict[Key, int] = {}  # requests that will still count on the version
        self._retired: dict[Key, float] = {}  # retired version -> when its grace began

    def acquire(self, key: Key) -> None:
        self._holds[key] = self._holds.get(key, 0) + 1

    def release(self, key: Key) -> None:
        num_holds = self._holds.get(key, 0) - 1
        if num_holds > 0:
            self._holds[key] = num_holds
            return
        self._holds.pop(key, None)
        if key in self._retired:  # the last request counted just now: a scrape must still see it
            self._retired[key] = self.clock()

    def retire(self, key: Key) -> None:
        """The version is no longer served (idempotent: a later call keeps the first time)."""
        self._retired.setdefault(key, self.clock())

    def restore(self, key: Key) -> None:
        """The version is served again: its series stay."""
        self._retired.pop(key, None)

    def expired(self) -> list[Key]:
        """Retired versions that no request holds and whose grace is over: their series go now (and they
        are forgotten here)."""
        now = self.clock()
        gone = [k for k, since in self._retired.items() if k not in self._holds and now - since >= self.grace_s]
        for key in gone:
            del self._retired[key]
        return gone
