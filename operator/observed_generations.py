"""The highest spec generation each LoRAPool's and LoRAAdapter's status was written for: no write lowers it.

A pass computes statuses from the specs it read when it began, and a timer's pass may end after an update
handler wrote the status of a newer generation: a pool edited to an invalid spec has its status written at once
(there is no pass to run), and a pass begun before the edit, ending after, wrote its status over it,
observedGeneration back to the older generation and Ready as it was then, until the next tick. Such a status is
stale: of it only what says where the pool's pods stand (``POD_FIELDS``, whatever the spec) is written.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)
ObjectKey = tuple[str, str, str, str]  # (kind, namespace, name, uid): an object re-created under its name is another
POD_FIELDS = ("pushedPods", "pushing")  # a pool's: the pods pushed to, and those not answered yet
GONE_KEPT = 4096  # objects gone (finalizer done) remembered, so a pass ending later does not record them again


def object_key(kind: str, body: Mapping[str, Any]) -> ObjectKey:
    meta = body.get("metadata") or {}
    return kind, meta.get("namespace") or "", meta.get("name") or "", meta.get("uid") or ""


class ObservedGenerations:
    """The highest ``observedGeneration`` of each object's status written (``admit`` / ``forget``)."""

    def __init__(self, gone_kept: int = GONE_KEPT) -> None:
        self._highest: dict[ObjectKey, int] = {}
        self._gone: OrderedDict[ObjectKey, None] = OrderedDict()  # the latest gone_kept forgotten keys (uids are unique)
        self._gone_kept = gone_kept

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
        if key not in self._gone:  # a pass ending after the object's finalizer: nothing to remember
            self._highest[key] = generation
        return wanted

    def forget(self, key: ObjectKey) -> None:
        """The object is gone (its finalizer is done)."""
        self._highest.pop(key, None)
        self._gone[key] = None
        self._gone.move_to_end(key)
        while len(self._gone) > self._gone_kept:
            self._gone.popitem(last=False)

    def __len__(self) -> int:
        """Objects whose highest generation is remembered."""
        return len(self._highest)
