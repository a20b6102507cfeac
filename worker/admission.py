"""Admission: how many sequences the worker holds at once (running batch + queue); more -> 429.

Counted in the HTTP layer, before a request reaches the engine, so a burst is refused at once
with `Retry-After` instead of growing an unbounded queue that only times out later.
"""

from __future__ import annotations


class Admission:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"admission capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.num_admitted = 0  # sequences admitted and not yet released
        self.num_refused = 0

    def can_admit(self, num_seqs: int) -> bool:
        return self.num_admitted + num_seqs <= self.capacity

    def admit(self, num_seqs: int) -> bool:
        """Take room for `num_seqs` sequences; False (and nothing taken) when the queue is full."""
        if not self.can_admit(num_seqs):
            self.num_refused += 1
            return False
        self.num_admitted += num_seqs
        return True

    def release(self, num_seqs: int) -> None:
        if num_seqs > self.num_admitted:
            raise ValueError(f"releasing {num_seqs} sequences but only {self.num_admitted} are admitted")
        self.num_admitted -= num_seqs
