"""What the operator last pushed to each worker pod of one pool.

What each pod accepted is kept in memory only: after a restart every pod gets a fresh push. Which pods were
pushed to is also written to the pool's ``status.pushedPods`` (name and uid) and read back by a new
operator (or a new leader), so a pod released while it was down is still emptied (controller.py).

The record follows the pods that exist, not every pod that ever did: each pass drops the entries of the
pods its pool no longer lists, and an entry is tied to the pod's uid and its sidecar's address, so a pod
re-created under the same name, or answering at another address (its IP changed), starts with no record
and gets a fresh push (its whole desired state under a new generation).

It is also how a pool knows which pods it may have given adapters to: a pod that leaves the pool (its
labels or the pool's workerSelector changed) and that no other pool takes over keeps its entry until it
was told to hold nothing and reports nothing (controller.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lorafleet.operator.workers import Worker
from lorafleet.worker.directives import DesiredState


def pod_id(pod: dict[str, Any]) -> tuple[str, str]:
    """(name, uid) of a pod's (slim) body: what the record ties an entry to."""
    meta = pod.get("metadata") or {}
    return meta.get("name", ""), meta.get("uid") or ""


def pushed_pod_ids(status: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(name, uid) of each well-formed entry of a pool's ``status.pushedPods``, in order."""
    ids = []
    for entry in (status or {}).get("pushedPods") or []:
        name, uid = (entry.get("name"), entry.get("uid")) if isinstance(entry, dict) else (None, None)
        if isinstance(name, str) and name and isinstance(uid, str):
            ids.append((name, uid))
    return ids


class PushRecord:
    """The last push each of one pool's pods accepted, tied to the pod's uid and sidecar URL."""

    def __init__(self) -> None:
        # pod name -> (uid, url, last accepted push); None: pushed to, what it holds is not known
        self._last: dict[str, tuple[str, str, DesiredState | None]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def merge_status(self, status: dict[str, Any] | None) -> None:
        """Remember the pods a pool's ``status.pushedPods`` names that this record lacks (what they accepted is
        not known): those a predecessor pushed to (a restart), or another leader while this replica stood
        by. A pod remembered under its name already keeps its entry (the status may lag behind it)."""
        for name, uid in pushed_pod_ids(status):
            if name not in self._last:
                self._last[name] = (uid, "", None)  # no address: the next push to it is a fresh one

    def to_status(self) -> list[dict[str, str]]:
        """``status.pushedPods``: the pods remembered, by name."""
        return [{"name": pod, "uid": uid} for pod, (uid, _, _) in sorted(self._last.items())]

    def pod_ids(self) -> set[tuple[str, str]]:
        """(name, uid) of every pod remembered: those this pool pushed to, as they were listed then."""
        return {(pod, uid) for pod, (uid, _, _) in self._last.items()}

    def may_hold(self, pod: str, uid: str) -> bool:
        """Whether pod (name, uid) was pushed to and may hold adapters: its last known push listed some, or what
        it accepted is not known."""
        entry = self._last.get(pod)
        return entry is not None and entry[0] == uid and (entry[2] is None or bool(entry[2].adapters))

    def may_hold_adapter(self, name: str) -> bool:
        """Whether a pod remembered may hold adapter ``name``: its last known push listed it, or what it accepted
        is not known."""
        return any(last is None or name in last.by_name() for _, _, last in self._last.values())

    def last(self, worker: Worker) -> DesiredState | None:
        """The last push ``worker`` accepted; None if none is known (or it went to an earlier pod so named, or to
        another address)."""
        entry = self._last.get(worker.pod)
        return entry[2] if entry is not None and entry[:2] == (worker.uid, worker.url) else None

    def knows(self, worker: Worker) -> bool:
        """Whether ``worker`` (this pod, uid and address) is remembered as one pushed to."""
        entry = self._last.get(worker.pod)
        return entry is not None and entry[:2] == (worker.uid, worker.url)

    def record(self, worker: Worker, desired: DesiredState) -> None:
        """``worker`` accepted ``desired``."""
        self._last[worker.pod] = (worker.uid, worker.url, desired)

    def forget(self, worker: Worker) -> None:
        """A push to ``worker`` was refused (e.g. a stale generation) or not answered (it may have landed): what
        it holds is not known to be what was last pushed. The pod stays remembered as one pushed to."""
        self._last[worker.pod] = (worker.uid, worker.url, None)

    def drop(self, worker: Worker) -> None:
        """``worker`` left the pool and holds nothing: no longer remembered."""
        self._last.pop(worker.pod, None)

    def retain(self, pods: Iterable[dict[str, Any]]) -> None:
        """Keep the entries of ``pods`` (the pool's pods as listed now, ready or not, and those it released that
        still hold something) and drop the rest."""
        present = {
            (meta.get("name"), meta.get("uid") or "") for meta in (p.get("metadata") or {} for p in pods)
        }
        for pod in [pod for pod, (uid, _, _) in self._last.items() if (pod, uid) not in present]:
            del self._last[pod]
