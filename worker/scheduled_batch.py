"""ScheduledBatch: what one scheduler step runs (decodes, prefill chunks) and what it preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.worker.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) in forward order: decodes first, then prefill chunks."""
        return [(s, 1) for s in self.decodes] + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def adapters(self) -> set[str]:
        return {s.adapter for s, _ in self.scheduled if s.adapter is not None}
