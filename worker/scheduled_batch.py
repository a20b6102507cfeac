"""ScheduledBatch: what one scheduler step runs (decodes, prefill chunks) and what it preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet.worker.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    # The prefix cache's index of `prefills` (PrefixCache._fillers): positions in it, of the first `indexed`. It
    # follows `add` and `grow`; `remove` shifts positions, so it drops the index. Change `prefills` only through them.
    fillers: dict | None = field(default=None, compare=False, repr=False)
    indexed: int = field(default=0, compare=False, repr=False)

    def add(self, seq: Sequence, num_new: int) -> None:
        """Run `num_new` tokens of `seq`: a decode when it samples its one new token, else a prefill chunk
        (a 1-token chunk of a longer prefill samples nothing)."""
        if num_new == 1 and seq.num_uncomputed_tokens == 1:
            self.decodes.append(seq)
        else:
            self.prefills.append((seq, num_new))

    def grow(self, i: int, more: int) -> None:
        """Prefill chunk `i` runs `more` tokens more (its position stays: the prefix cache's index holds)."""
        seq, num_new = self.prefills[i]
        self.prefills[i] = (seq, num_new + more)

    def remove(self, seq: Sequence) -> int:
        """Take `seq` out of the step (preempted after it was added); returns its tokens, 0 if not in it."""
        if seq in self.decodes:
            self.decodes.remove(seq)
            return 1
        for i, (s, num_new) in enumerate(self.prefills):
            if s is seq:
                del self.prefills[i]
                self.fillers = None
                return num_new
        return 0

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


def by_adapter(batch: ScheduledBatch) -> dict[str | None, ScheduledBatch]:
    """`batch`'s sequences grouped by the adapter they run with (None: the base model), each group a batch of its
    own in the same order (what it preempted stays out: that happened)."""
    groups: dict[str | None, ScheduledBatch] = {}
    for seq in batch.decodes:
        groups.setdefault(seq.adapter, ScheduledBatch()).decodes.append(seq)
    for seq, num_new in batch.prefills:
        groups.setdefault(seq.adapter, ScheduledBatch()).prefills.append((seq, num_new))
    return groups
