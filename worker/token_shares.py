"""A step's prefill tokens shared among the tenants that want them.

Decodes go first, one token each. What they leave of `max_num_batched_tokens` is split evenly among the tenants
(fairness keys) with prefill work, a running prompt's next chunk or a waiting request, so that one tenant's long
prompts, older in the queue, cannot take every step's tokens while another's short prompt waits behind them.
Tokens a tenant leaves unused are not lost: once admission is done they go to the prefills held to their share,
oldest first (`Scheduler._top_up`). One tenant alone keeps the whole budget.
"""

from __future__ import annotations

from collections.abc import Collection

from lorafleet.worker.sequence import Sequence
from lorafleet.worker.waiting_queue import fairness_key


class TokenShares:
    def __init__(self, budget: int, tenants: Collection[str]) -> None:
        """`budget`: the step's tokens left after its decodes; `tenants`: the fairness keys with prefill work."""
        self.split = len(tenants) > 1
        share = max(1, budget // len(tenants)) if self.split else budget
        self._left = dict.fromkeys(tenants, share)

    def cap(self, seq: Sequence, budget: int) -> int:
        """The most prefill tokens `seq` may take now: the step's `budget`, held to its tenant's share."""
        if not self.split:
            return budget
        return max(0, min(budget, self._left.get(fairness_key(seq), budget)))

    def exhausted(self, tenant: str) -> bool:
        return self.split and self._left.get(tenant, 1) <= 0

    def take(self, seq: Sequence, num_new: int) -> None:
        key = fairness_key(seq)
        if key in self._left:
            self._left[key] -= num_new


def prefill_tenants(running: list[Sequence], waiting_tenants: Collection[str]) -> set[str]:
    """Fairness keys with prefill work this step: a running sequence's unfinished prompt, or a waiting request."""
    return {fairness_key(s) for s in running if s.num_uncomputed_tokens > 1} | set(waiting_tenants)
