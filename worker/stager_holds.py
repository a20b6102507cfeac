"""CacheHolds: the copies in the stager's disk cache that stay whatever its budget, as the engine may read them.

The engine loads from the paths the stager hands out, at any time after: held are the copies it is served
(the last push's), those the push in progress stages (the engine serves the previous set until the push
reaches it), a copy `/v1/stage` just handed out (leased for `stage_lease_s`), and the copies of versions a
push replaced that the engine still reports. A new stable version replaces the one serving only once it
has loaded; until then the engine keeps the old one as its fallback, and reads it from disk again if it
was evicted from memory meanwhile.

Running example: push 1 {sql: v1}, push 2 {sql: v2}: v1's copy is held while the engine's report lists
sql@v1; the report after v2 has loaded no longer does, and the next trim may evict it.

The replaced copies are kept in the cache folder too (REPLACED_FILE), for a sidecar restarted meanwhile: what it
adopts from the engine is the last push, which no longer names the fallback.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from lorafleet.worker.directives import ReportedState
from lorafleet.worker.staged_copy import Staged

Copies = dict[tuple[str, str], Staged]  # (name, version) -> staged copy
REPLACED_FILE = ".replaced"  # [[name, version, cache key, sha256], ...]: a file, which the cache ignores


class CacheHolds:
    def __init__(self, root: Path, lease_s: float) -> None:
        self.root = root
        self.lease_s = lease_s
        self.pushing: set[str] = set()  # cache keys the push in progress asked for
        self._leases: dict[str, float] = {}  # cache key -> until when (monotonic) /v1/stage's copy is held
        self._prune_at = 64  # leases counted when the expired ones are next dropped
        self._replaced: Copies = self._read_replaced()  # versions a push replaced, while the engine reports them

    def lease(self, key: str) -> None:
        """Hold `key`'s copy for `lease_s`. A push leases every version it stages: the expired leases are
        dropped once their number has doubled (each call did it, a push of 16,000 versions held the event
        loop 8 s), a new dict, as `protected` reads the old one in a download thread."""
        now = time.monotonic()
        if len(self._leases) >= self._prune_at:
            self._leases = {k: t for k, t in self._leases.items() if t > now}
            self._prune_at = max(64, 2 * len(self._leases))
        self._leases[key] = now + self.lease_s

    def hold_replaced(self, old: Copies, new: Copies) -> None:
        """A push swaps the served copies `old` for `new`: the versions it drops stay held (see release_replaced)."""
        self._set_replaced({k: s for k, s in {**self._replaced, **old}.items() if k not in new})

    def release_replaced(self, report: ReportedState) -> None:
        """Let go of the replaced versions that the engine's `report` (of the last push, or later) no longer lists."""
        reported = {(a.name, a.version) for a in report.adapters}
        self._set_replaced({k: s for k, s in self._replaced.items() if k in reported})

    def _set_replaced(self, replaced: Copies) -> None:
        changed, self._replaced = replaced.keys() != self._replaced.keys(), replaced
        if changed:  # not kept (a full disk): a sidecar restarted then holds the pushed copies only
            with contextlib.suppress(OSError):
                partial = self.root / f"{REPLACED_FILE}.{os.getpid()}"
                partial.write_text(json.dumps([[n, v, s.path.name, s.sha256] for (n, v), s in replaced.items()
                                               if s.path.parent == self.root]))
                partial.replace(self.root / REPLACED_FILE)

    def _read_replaced(self) -> Copies:
        """What an earlier sidecar held as replaced, of copies still cached (the first report lets go of the rest)."""
        try:
            listed = json.loads((self.root / REPLACED_FILE).read_text())
            return {(n, v): Staged(self.root / key, sha, cached=True) for n, v, key, sha in listed
                    if "/" not in key and not key.startswith(".") and (self.root / key).is_dir()}
        except (OSError, ValueError, TypeError):
            return {}

    def protected(self, served: Copies) -> set[str]:
        """Cache keys not to evict. Called by the cache's trim in a download thread: it reads copies of what
        the event loop changes."""
        now = time.monotonic()
        copies = [*served.values(), *self._replaced.values()]
        return ({s.path.name for s in copies if s.path.parent == self.root} | set(self.pushing)
                | {k for k, until in list(self._leases.items()) if until > now})

    @property
    def replaced(self) -> set[tuple[str, str]]:
        return set(self._replaced)
