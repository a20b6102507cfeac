"""What a status write carries: only the keys that changed, conditions merged with the other writer's, times
in RFC 3339."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def status_changes(current: dict[str, Any] | None, wanted: dict[str, Any]) -> dict[str, Any]:
    """Only the status keys whose value differs: an unchanged status is not re-written every tick."""
    current = current or {}
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def merge_conditions(current: dict[str, Any] | None, wanted: dict[str, Any], *,
                     drop: Iterable[str] = ()) -> dict[str, Any]:
    """``wanted`` with its conditions merged into the current ones. A pool's status has two writers, the
    reconcile (Ready) and the autoscaler (Scaling), and a merge patch replaces a list whole: each writes
    the list with its own types replaced (in place, or appended) and the other's kept as they are;
    ``drop``: types to remove."""
    current_conditions = (current or {}).get("conditions") or []
    gone = set(drop)
    if "conditions" not in wanted and not gone & {c.get("type") for c in current_conditions}:
        return wanted
    own = {c["type"]: c for c in wanted.get("conditions") or []}
    merged = [own.pop(c.get("type"), c) for c in current_conditions if c.get("type") not in gone]
    return {**wanted, "conditions": merged + list(own.values())}
