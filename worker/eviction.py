"""Eviction policies: which evictable adapter goes first. Chosen by name in the pool's config.

A policy only orders candidates; the pool decides who is a candidate (never an adapter with
in-flight requests, never a pinned one) and how many to evict. Time is a logical clock (one tick per
acquire and per release: an adapter used until a moment ago is that recent), so orders are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class EvictionCandidate:
    key: str  # "name@version"
    nbytes: int  # bytes it frees in the tier being evicted from
    last_used: int  # logical tick of its last acquire or release
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


def plan_placement(*, need_pages: int, nbytes: int, tenant: str, quota, ordered: list[tuple[str, str, int, int]],
                   tenant_count: int, tenant_bytes: int, free_pages: int, free_slots: int) -> list[str] | None:
    """Which evictable adapters to evict so a new one fits, or None if it cannot fit now.

    ordered: evictable adapters, first to evict first, as (key, tenant, pages, bytes). The tenant's
    quota (a TenantQuota) is made first, and only from the tenant's own adapters, so one tenant can
    never push out everyone else's; then pages and a slot, from anyone's. Nothing is chosen unless
    the whole need can be met (no pointless evictions).
    """
    victims: list[tuple[str, str, int, int]] = []
    count, held = tenant_count, tenant_bytes
    for cand in (c for c in ordered if c[1] == tenant):
        if not quota.exceeded(count + 1, held + nbytes):
            break
        victims.append(cand)
        count, held = count - 1, held - cand[3]
    if quota.exceeded(count + 1, held + nbytes):
        return None
    pages = free_pages + sum(v[2] for v in victims)
    slots = free_slots + len(victims)
    for cand in (c for c in ordered if c not in victims):
        if pages >= need_pages and slots >= 1:
            break
        victims.append(cand)
        pages += cand[2]
        slots += 1
    if pages < need_pages or slots < 1:
        return None
    return [v[0] for v in victims]
