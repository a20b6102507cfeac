"""The sizes a pool's workers reported for each adapter version, remembered between passes.

The tenant byte quota counts an adapter version's size once a worker reported it (placement.spec_bytes), and
a version refused over the quota keeps being counted after the workers dropped it through its status
(``bytes``, ``refusedBytes``, ``canaryBytes``). A status is read back through the operator's indexes, which
lag behind its writes: a pass that reads the adapter before the last refusal's status came back would find
the size unknown, admit the version again and have it downloaded once more. This memory covers that gap;
the status covers a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lorafleet.operator.crd_models import AdapterSpec, InvalidAdapter
from lorafleet.worker.directives import ReportedState


class ReportedSizes:
    """(adapter name, version) -> the largest size a worker reported for it once staged, for one pool."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], int] = {}

    def note(self, reports: Iterable[ReportedState | None]) -> None:
        """Remember the sizes in this pass's answers (a version still staging reports its listed size)."""
        for reported in reports:
            for st in reported.adapters if reported is not None else ():
                if st.bytes > 0:  # a download in progress says its size too (the quota counts it)
                    key = (st.name, st.version)
                    self._bytes[key] = max(self._bytes.get(key, 0), st.bytes)

    def apply(self, specs: list[AdapterSpec | InvalidAdapter]) -> list[AdapterSpec | InvalidAdapter]:
        """``specs`` with the sizes remembered for their versions (stable, canary, last valid spec's) where
        their status does not know them yet; what is remembered of other versions is let go."""
        wanted = set()
        out: list[AdapterSpec | InvalidAdapter] = []
        for x in specs:
            if isinstance(x, AdapterSpec):
                x = self._sized(x)
                wanted |= _versions(x)
            if x.last_valid is not None:
                x = dataclasses.replace(x, last_valid=self._sized(x.last_valid))
                wanted |= _versions(x.last_valid)
            out.append(x)
        for key in set(self._bytes) - wanted:
            del self._bytes[key]
        return out

    def _sized(self, a: AdapterSpec) -> AdapterSpec:
        stable = self._bytes.get((a.name, a.version), 0)
        canary = self._bytes.get((a.name, a.canary.version), 0) if a.canary is not None else 0
        if stable <= a.known_bytes and canary <= a.known_canary_bytes:
            return a
        return dataclasses.replace(a, known_bytes=max(a.known_bytes, stable),
                                   known_canary_bytes=max(a.known_canary_bytes, canary))


def _versions(a: AdapterSpec) -> set[tuple[str, str]]:
    return {(a.name, a.version)} | ({(a.name, a.canary.version)} if a.canary is not None else set())
