"""The highest spec generation each LoRAPool's and LoRAAdapter's status was written for: no write lowers it.

A pass computes statuses from the specs it read when it began, and a timer's pass may end after an update
handler wrote the status of a newer generation: a pool edited to an invalid spec has its status written at once
(there is no pass to run), and a pass begun before the edit, ending after, wrote its status over it,
observedGeneration back to the older generation and Ready as it was then, until the next tick. Such a status is
stale: of it only what says where the pool's pods stand (``POD_FIELDS``, whatever the spec) is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)
ObjectKey = tuple[str, str, str, str]  # (kind, namespace, name, uid): an object re-created under its name is another
POD_FIELDS = ("pushedPods", "pushing")  # a pool's: the pods pushed to, and those not answered yet


def object_key(kind: str, body: Mapping[str, Any]) -> ObjectKey:
    meta = body.get("metadata") or {}
    return kind, meta.get("namespace") or "", meta.get("name") or "", meta.get("uid") or ""


class ObservedGenerations:
    """The highest ``observedGeneration`` of each object's status written (``admit`` / ``forget``)."""

    def __init__(self) -> None:
        self._highest: dict[ObjectKey, int] = {}

    def admit(self, key: ObjectKey, wanted: dict[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
        """``wanted`` (a status) when it is for a generation no older than one written already, by this operator or
        in ``current`` (the object's status as it is); else only its ``POD_FIELDS``."""
        generation = wanted.get("observedGeneration")
        if not isinstance(generation, int):
            return wanted
        written = current.get("observedGeneration")
        highest = max(self._highest.get(key, 0), written if isinstance(written, int) else 0)
        if generation < highest:
            log.info("%s %s/%s: its status of generation %d (a pass that read the spec before an edit) is not written "
                     "over that of generation %d", *key[:3], generation, highest)
            return {k: v for k, v in wanted.items() if k in POD_FIELDS}
        self._highest[key] = generation
        return wanted

    def forget(self, key: ObjectKey) -> None:
        """The object is gone (its finalizer is done)."""
        self._highest.pop(key, None)
