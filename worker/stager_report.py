"""The stager's `GET /v1/state` report: what its engine reports, plus tier `disk` for the staged versions the
engine has not loaded, the push's versions still being staged (and how far), and staging errors.

A staged version's size comes from the disk cache's own count for a cache entry; a local folder's is counted
by one thread at a time, waited for FOLDER_SIZE_WAIT_S at most by the report that started it (the reports while
it runs wait for nothing): a mount that stops answering leaves the report its last known sizes (0 before any),
never a report that does not come, nor a thread more per report.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.worker.directives import AdapterState, ReportedState
from lorafleet.worker.disk_cache import dir_bytes

if TYPE_CHECKING:
    from lorafleet.worker.stager import Stager

FOLDER_SIZE_WAIT_S = 2.0


class FolderSizes:
    """The sizes of local adapter folders, counted on one thread at a time (see the module doc)."""

    def __init__(self) -> None:
        self.known: dict[Path, int] = {}
        self._counting: asyncio.Future | None = None

    async def of(self, paths: list[Path]) -> dict[Path, int]:
        missing = [p for p in paths if p not in self.known]
        if missing and (self._counting is None or self._counting.done()):  # else a count still runs: not waited
            self._counting = asyncio.ensure_future(asyncio.to_thread(self._count, missing))
            await asyncio.wait([self._counting], timeout=FOLDER_SIZE_WAIT_S)
        return {p: self.known.get(p, 0) for p in paths}

    def _count(self, paths: list[Path]) -> None:
        for path in paths:  # each one known as soon as counted: a hung one keeps only those after it unknown
            self.known[path] = dir_bytes(path)

    def forget(self, keep: set[Path]) -> None:
        """Sizes of folders no longer staged go (a folder served again is counted afresh)."""
        self.known = {p: n for p, n in self.known.items() if p in keep}


async def stager_state(stager: Stager) -> ReportedState:
    if stager.engine is not None:
        try:
            report = await stager.engine.report()
            stager._pool_size = (report.pool_bytes, report.pool_slots)
        except Exception as exc:
            # Its pool's size does not change while it restarts: placement keeps counting its room.
            report = ReportedState(error=f"engine unreachable: {exc}")
            report.pool_bytes, report.pool_slots = stager._pool_size
    else:
        report = ReportedState(generation_applied=stager.generation)
    report.awaiting_push, report.pushed_generation = not stager.delivered, stager.generation
    if report.error is None and report.generation_applied >= stager.generation:  # not one from before a push
        stager.holds.release_replaced(report)
    staged = dict(stager.staged)
    found: dict[tuple[str, str], AdapterState] = {}  # indexed: a pool may hold 100,000s of versions
    for a in report.adapters:
        found.setdefault((a.name, a.version), a)
    unloaded = [key for key in staged if key not in found]
    root = stager.cache.root
    folders = [staged[key].path for key in unloaded if staged[key].path.parent != root]
    stager.folder_sizes.forget({s.path for s in staged.values()})
    sizes = await stager.folder_sizes.of(folders)
    for key in unloaded:
        path = staged[key].path
        size = sizes[path] if path.parent != root else stager.cache.size_of(path.name)
        found[key] = AdapterState(*key, tier="disk", bytes=size)
        report.adapters.append(found[key])
    for key in staged:
        if found[key].tier == "none":
            found[key].tier = "disk"
    progress: dict[str, tuple[int, int]] = {}  # URI -> (done, total) of its furthest download (two cache keys)
    for uri, done, total in list(stager.downloading.values()) if stager.pending else ():  # download threads change it
        progress[uri] = max(progress.get(uri, (0, 0)), (done, total))
    for key, uri in sorted(stager.pending.items()):  # the push's versions still being staged, and how far
        if key not in found:
            done, total = progress.get(uri, (None, 0))
            report.adapters.append(found.setdefault(key, AdapterState(*key, tier="none", staging=True, bytes=total,
                                                                      bytes_done=done)))
    for key, message in stager.errors.items():
        if key not in found:
            report.adapters.append(found.setdefault(key, AdapterState(*key, tier="none")))
        found[key].error = found[key].error or message
    if report.error is None and stager.unsent == stager.generation and stager.unsent_why:  # said in pool statuses
        report.error = f"push {stager.generation} did not reach the engine: {stager.unsent_why}"
    return report
