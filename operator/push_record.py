"""What the operator last pushed to each worker pod of one pool: memory only (lost on restart, by design).

The record follows the pods that exist, not every pod that ever did: each pass drops the entries of the
pods its pool no longer lists, and an entry is tied to the pod's uid, so a pod re-created under the same
name starts with no record and gets a fresh push (its whole desired state under a new generation).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lorafleet.operator.workers import Worker
from lorafleet.worker.directives import DesiredState


class PushRecord:
    """The last push each of one pool's pods accepted, tied to the pod's uid."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, DesiredState]] = {}  # pod name -> (its uid, last accepted push)

    def __len__(self) -> int:
        return len(self._last)

    def last(self, worker: Worker) -> DesiredState | None:
        """The last push ``worker`` accepted; None if none is known (or it was an earlier pod so named)."""
        entry = self._last.get(worker.pod)
        return entry[1] if entry is not None and entry[0] == worker.uid else None

    def record(self, worker: Worker, desired: DesiredState) -> None:
        """``worker`` accepted ``desired``."""
        self._last[worker.pod] = (worker.uid, desired)

    def forget(self, worker: Worker) -> None:
        """``worker`` refused a push (e.g. a stale generation): what it holds is not what was last pushed."""
        self._last.pop(worker.pod, None)

    def retain(self, pods: Iterable[dict[str, Any]]) -> None:
        """Keep the entries of ``pods`` (the pool's pods as listed now, ready or not) and drop the rest."""
        present = {
            (meta.get("name"), meta.get("uid") or "") for meta in (p.get("metadata") or {} for p in pods)
        }
        for pod in [pod for pod, (uid, _) in self._last.items() if (pod, uid) not in present]:
            del self._last[pod]
