"""Adapter version resolution: the stable version, or the canary for a weighted share of users.

A request names an adapter (`sql`) or pins a version (`sql@v3`). For a bare name the resolver
picks the stable version, or the canary with probability `canary_weight` percent. The pick is
sticky per `user` (or `safety_identifier`, OpenAI's successor of it): `sha256(name, user)` maps every user to a fixed bucket in [0, 10000), and the
canary serves buckets below `canary_weight * 100`; raising the weight only moves users from stable
to canary, never back. Requests without a `user` (or with an empty one, which names nobody) draw a
fresh bucket each time.

Running example: `sql` stable v2, canary v3 at 20 %: user "alice" hashes to bucket 1234 -> v3
(1234 < 2000) on every request; user "bob" at bucket 8001 -> v2 until the weight passes 80.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

NUM_BUCKETS = 10_000


@dataclass(slots=True, frozen=True)
class VersionSplit:
    """Which versions of one adapter serve traffic, and how it is split."""

    stable: str
    canary: str | None = None
    canary_weight: int = 0  # percent of users, 0..100

    def __post_init__(self) -> None:
        if not 0 <= self.canary_weight <= 100:
            raise ValueError(f"canary_weight must be in 0..100 (got {self.canary_weight})")
        if self.canary is None and self.canary_weight:
            raise ValueError("canary_weight must be 0 when there is no canary version")

    @property
    def versions(self) -> tuple[str, ...]:
        return (self.stable,) if self.canary is None else (self.stable, self.canary)

    def percent_of(self, version: str) -> int:
        """Share of the name's users sent to `version`."""
        if version == self.canary:
            return self.canary_weight
        return 100 - self.canary_weight if version == self.stable else 0


def user_bucket(name: str, user: str) -> int:
    """A stable bucket in [0, NUM_BUCKETS) for (adapter, user); independent across adapters."""
    digest = hashlib.sha256(f"{name}\x00{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % NUM_BUCKETS


class CanaryResolver:
    """Picks the version of an adapter that serves one request, given its split and the `user`."""

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, name: str, split: VersionSplit, user: str | None = None) -> str:
        if split.canary is None or split.canary_weight == 0:
            return split.stable
        bucket = user_bucket(name, user) if user else self._rng.randrange(NUM_BUCKETS)
        return split.canary if bucket < split.canary_weight * (NUM_BUCKETS // 100) else split.stable
