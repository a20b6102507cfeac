"""Eviction policies: which evictable adapter goes first. Chosen by name in the pool's config.

A policy only orders candidates; the pool decides who is a candidate (never an adapter with
in-flight requests, never a pinned one) and how many to evict. Time is a logical clock (one tick per
acquire), so orders are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class EvictionCandidate:
    key: str  # "name@version"
    nbytes: int  # bytes it frees in the tier being evicted from
    last_used: int  # logical tick of its last acquire
    uses: int  # acquires so far
    reload_seconds: float  # what bringing it back would cost (measured load time, or an estimate)


class EvictionPolicy(Protocol):
    name: str

    def order(self, candidates: list[EvictionCandidate]) -> list[EvictionCandidate]:
        """Candidates, first to evict first."""
        ...


class LRUPolicy:
    """Least recently used first: the default, good when recent use predicts the next."""

    name = "lru"

    def order(self, candidates: list[EvictionCandidate]) -> list[EvictionCandidate]:
        return sorted(candidates, key=lambda c: (c.last_used, c.key))


class LFUPolicy:
    """Least frequently used first (ties: least recent): good when the hot set is stable."""

    name = "lfu"

    def order(self, candidates: list[EvictionCandidate]) -> list[EvictionCandidate]:
        return sorted(candidates, key=lambda c: (c.uses, c.last_used, c.key))


class CostAwarePolicy:
    """Lowest value per byte first, value = uses × reload cost: a large, rarely used adapter that is
    cheap to bring back goes before a small hot one that is expensive to reload."""

    name = "cost"

    def order(self, candidates: list[EvictionCandidate]) -> list[EvictionCandidate]:
        def value_per_byte(c: EvictionCandidate) -> float:
            return (c.uses + 1) * max(c.reload_seconds, 1e-6) / max(c.nbytes, 1)

        return sorted(candidates, key=lambda c: (value_per_byte(c), c.last_used, c.key))


POLICIES: dict[str, type] = {"lru": LRUPolicy, "lfu": LFUPolicy, "cost": CostAwarePolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
