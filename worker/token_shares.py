"""A step's tokens: decodes first, then prompt chunks shared among the tenants that want them.

Decodes go first, one token each. What they leave of `max_num_batched_tokens` is split evenly among the tenants
(fairness keys) with prefill work, a running prompt's next chunk or a waiting request under its seat share, so that
one tenant's long prompts, older in the queue, cannot take every step's tokens while another's short prompt waits
behind them. Tokens a tenant leaves unused go, once the others are served, first to the running prompts held to
their share (to none, too), oldest first (`StepTokens._top_up`), then to the waiting requests of tenants past their
share. One tenant alone keeps the whole budget.
"""

from __future__ import annotations

from collections.abc import Collection

from lorafleet.worker.scheduled_batch import ScheduledBatch
from lorafleet.worker.sequence import Sequence, SequenceStatus
from lorafleet.worker.waiting_queue import WaitingQueue, fairness_key, preemption_victim


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

    def lift(self) -> None:
        """Every tenant was served its share: what is left goes to whoever takes it."""
        self.split = False

    def take(self, seq: Sequence, num_new: int) -> None:
        key = fairness_key(seq)
        if key in self._left:
            self._left[key] -= num_new


def prefill_tenants(running: list[Sequence], waiting: WaitingQueue, seats: int, *, admitting: bool = True) -> set[str]:
    """Fairness keys with prefill work this step: a running sequence's unfinished prompt, or a waiting request of a
    tenant under its `seats` (0: no bound) while a seat is free (`admitting`). One whose adapter is not on the GPU yet
    counts: its share keeps admission going, which places the adapter (what it leaves unused goes to the running
    prompts: `_top_up`)."""
    keys = {fairness_key(s) for s in running if s.num_uncomputed_tokens > 1}
    return keys | {t for t in waiting.tenants() if not waiting.seated(t, seats)} if admitting else keys


class StepTokens:
    """The Scheduler's filling of a step's tokens (worker/scheduler.py): running sequences in order, chunk sizes,
    and the top-up of held chunks. It works on the scheduler's state declared in `Scheduler.__init__`."""

    def _run(self, batch: ScheduledBatch, seqs: list[Sequence], budget: int, shares: TokenShares | None,
             loras: set[str]) -> int:
        """Schedule running `seqs` in order while `budget` tokens last; returns what is left of it."""
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in the step
            num_new = self._num_new_tokens(seq, budget, None if shares is None else shares.cap(seq, budget))
            if num_new == 0:
                continue
            while not self._allocate(seq, num_new):
                victim = preemption_victim(self.running)
                budget += batch.remove(victim)  # scheduled already: it leaves the batch (none of its tenant's is left)
                self._preempt(victim, batch)
                if victim is seq:
                    if not self.running:
                        self._short_alone.add(seq.seq_id)
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq preempted itself
            batch.add(seq, num_new)
            if shares is not None:
                shares.take(seq, num_new)
            if seq.adapter is not None:
                loras.add(seq.adapter)
            budget -= num_new
        return budget

    def _top_up(self, batch: ScheduledBatch, budget: int, loras: set[str]) -> int:
        """Tokens no tenant took go to running prompts held to their tenant's share (to none, too), oldest first;
        returns what is left."""
        chunks = {s.seq_id: i for i, (s, _) in enumerate(batch.prefills)}
        for seq in self.running:
            if budget <= 0:
                break
            i = chunks.get(seq.seq_id)
            num_new = 0 if i is None else batch.prefills[i][1]
            more = min(budget, seq.num_uncomputed_tokens - num_new)
            if seq.num_uncomputed_tokens <= 1 or more <= 0 or (i is None and not self._fits(seq, loras)) \
                    or not self._allocate(seq, num_new + more):
                continue
            if i is None:
                batch.add(seq, more)
                if seq.adapter is not None:
                    loras.add(seq.adapter)
            else:
                batch.grow(i, more)
            budget -= more
        return budget

    def _num_new_tokens(self, seq: Sequence, budget: int, cap: int | None = None) -> int:
        """Its uncomputed tokens chunked to `cap` (its tenant's share) or `budget`. Unchunked, a prompt waits for room
        for all of it (past any share), unless none ever has room (past max_num_batched_tokens) or its prefill began
        (the rest may never find room while older ones decode)."""
        num_new = seq.num_uncomputed_tokens
        began = seq.num_computed_tokens > seq.num_cached_tokens  # past what the prefix cache had for it
        if not (self.enable_chunked_prefill or began or num_new > self.max_num_batched_tokens):
            return num_new if num_new <= budget else 0
        return min(num_new, budget if cap is None else cap)

    def _fits(self, seq: Sequence, loras: set[str]) -> bool:
        """`seq`'s adapter is within max_loras_per_batch of the step's `loras`."""
        return (seq.adapter is None or self.max_loras_per_batch is None or seq.adapter in loras
                or len(loras) < self.max_loras_per_batch)
