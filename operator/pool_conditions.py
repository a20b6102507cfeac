"""The conditions of each pool's status as this operator last wrote them.

A pool's status has two writers, the reconcile (Ready and the like) and the autoscaler (Scaling), and a
merge patch replaces the `conditions` list whole: each writes the list with its own types replaced and the
other's kept as its view of the status has them (status_patches.merge_conditions). That view is kopf's, updated
by watch events; a patch of one writer that lands before the other's last patch came back through the watch
would write back the other's condition as it was before, until its next pass. Each writer's list is settled
here instead: its own conditions, the other's as last written (this operator is their only writer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PoolKey = tuple[str, str]


class PoolConditions:
    def __init__(self) -> None:
        self._written: dict[PoolKey, list[dict[str, Any]]] = {}

    def settle(self, key: PoolKey, wanted: dict[str, Any], mine: Callable[[str], bool]) -> dict[str, Any]:
        """`wanted` (a status patch whose conditions are the writer's own, those of types `mine` takes, merged
        into its view of the others) with the others as last written here, where anything was; remembered as
        written."""
        conditions = wanted.get("conditions")
        if conditions is None:
            return wanted
        last = self._written.get(key)
        if last is not None:
            settled = [c for c in conditions if mine(c.get("type"))] + [c for c in last if not mine(c.get("type"))]
            conditions = _ordered(settled, [c.get("type") for c in conditions + last])
        self._written[key] = conditions
        return {**wanted, "conditions": conditions}

    def forget(self, key: PoolKey) -> None:
        """A deleted pool's: one created again under its name starts from what the API server holds."""
        self._written.pop(key, None)

    def retain(self, keys: set[PoolKey]) -> None:
        """Keep only these pools' (the live ones)."""
        for key in set(self._written) - keys:
            del self._written[key]


def _ordered(conditions: list[dict[str, Any]], order: list[Any]) -> list[dict[str, Any]]:
    """`conditions` in the order their types first appear in `order` (a list that does not move about)."""
    rank: dict[Any, int] = {}
    for t in order:
        rank.setdefault(t, len(rank))
    return sorted(conditions, key=lambda c: rank.get(c.get("type"), len(rank)))
