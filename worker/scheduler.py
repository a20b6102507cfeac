"""Scheduler: continuous batching over a paged KV cache, adapter-aware.

Each step: running sequences first (a decode token, or the next chunk of an unfinished prefill),
then waiting ones in arrival order, all within `max_num_batched_tokens` tokens and `max_num_seqs`
sequences. When the KV pages run out, the most recently admitted running sequence is preempted:
its pages are freed and it goes back to the head of the queue to be recomputed later (it keeps its
adapter reference). A waiting sequence whose adapter is not resident yet is skipped (the pool
starts the load) while the others run; `max_loras_per_batch` bounds the distinct adapters of a step
(too many segments slow the LoRA kernels), except for a sequence that has waited
`max_adapter_wait_steps` steps, which is admitted anyway so no tenant starves. For the same reason a
sequence that has waited that long for an adapter that is loaded but finds no GPU room is no longer
overtaken: the pages running requests give back go to its adapter (a load in flight never holds
anyone back). An adapter a queued sequence holds (a preempted one keeps its reference) or was loaded
for is never evicted: when nothing runs and the queue's head cannot get pages, or such a starved
sequence's adapter finds no room, the others let go of theirs. A sequence that preempted itself running
alone (adapters hold the rest of the pool) is readmitted only once the pages of all its tokens can be
had, not chunk by chunk into the same wall.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from lorafleet.worker.adapter_entry import AdapterNotFoundError
from lorafleet.worker.block_manager import BlockManager
from lorafleet.worker.engine_errors import UnknownAdapterError
from lorafleet.worker.page_pool import PagePoolError
from lorafleet.worker.sequence import Sequence, SequenceStatus


class CapacityError(RuntimeError):
    """A request can never get the KV pages it needs in the current pool."""


class AdapterSlots(Protocol):
    """The part of the AdapterPool the scheduler uses. `acquire` raises when the adapter cannot be
    loaded (only the sequences waiting for it fail)."""

    def acquire(self, key: str, waiter: object = None, *, count: bool = True) -> int | None: ...
    def release(self, slot: int) -> None: ...
    def abandon(self, key: str, waiter: object) -> None: ...


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


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        adapter_pool: AdapterSlots | None = None,
        max_loras_per_batch: int | None = None,
        max_adapter_wait_steps: int = 32,
        reclaim_pages: Callable[[int], int] | None = None,
        adapter_state: Callable[[str], str] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.adapter_pool = adapter_pool
        self.max_loras_per_batch = max_loras_per_batch
        self.max_adapter_wait_steps = max_adapter_wait_steps
        # Unified paging: idle adapters (no request uses them) give their pages to the KV cache
        # before any request is preempted. Returns how many pages were freed.
        self.reclaim_pages = reclaim_pages
        # Where an adapter is: "gpu" (its pages taken: resident or being copied), "room" (in CPU memory,
        # waiting only for GPU pages or a slot) or "load" (being read).
        self.adapter_state = adapter_state
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._skipped_steps: dict[int, int] = {}  # seq_id -> steps skipped for adapter grouping
        # Sequences that preempted themselves running alone: readmitted only once the pages of all their
        # tokens can be had (admitted chunk by chunk, they would get as far and preempt themselves again).
        self._short_alone: set[int] = set()
        self.num_preemptions = 0
        self.max_stuck_steps = 100  # steps a request that cannot get pages, with nothing running, may wait
        # seq_id -> steps it waited so far; a sequence leaving the queue takes its count along (the next one
        # gets a wait of its own), and any admission clears them all (something runs: pages will come back).
        self._stuck_steps: dict[int, int] = {}
        self.failed: list[Sequence] = []  # finished by the scheduler (adapter load failed); engine reports them

    # ---- queue -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.failed)  # failed: not reported yet

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished or aborted: KV pages and the adapter reference are released at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        was_waiting_for_adapter = seq.status is SequenceStatus.WAITING and seq.adapter_slot is None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self.block_manager.free(seq)
        self._release_adapter(seq)
        if was_waiting_for_adapter and seq.adapter is not None and self.adapter_pool is not None:
            self.adapter_pool.abandon(seq.adapter, seq.seq_id)
        self._skipped_steps.pop(seq.seq_id, None)
        self._short_alone.discard(seq.seq_id)
        self._stuck_steps.pop(seq.seq_id, None)

    def fail(self, seqs: list[Sequence], exc: Exception) -> None:
        """End `seqs` with `exc`: pages and adapter references are released at once, and the engine
        reports them at its next step."""
        for seq in seqs:
            self.finish(seq, "error")
            seq.error, seq.exception = str(exc), exc
            self.failed.append(seq)

    def fail_all(self, exc: Exception) -> None:
        """End every running and waiting sequence with `exc` (the worker shuts down)."""
        self.fail([*self.running, *self.waiting], exc)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        loras: set[str] = set()

        # 1. Running sequences, oldest first; preempt from the young end when pages run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0:
                i += 1
                continue
            while not self._allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    if not self.running:
                        self._short_alone.add(seq.seq_id)
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing after it remains either
            self._add_to_batch(batch, seq, num_new)
            if seq.adapter is not None:
                loras.add(seq.adapter)
            budget -= num_new
            i += 1

        # 2. Waiting sequences (none while preempting: pages are short).
        if batch.preempted:
            return batch
        skipped: list[Sequence] = []  # passed over for their adapter (count towards max_adapter_wait_steps)
        stuck: Sequence | None = None  # cannot get room (KV pages, or its adapter's) while nothing runs
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            try:
                admit = self._can_admit_adapter(seq, loras)
            except AdapterNotFoundError as exc:
                # Its version was replaced or unregistered before the pool could load it for this request.
                # With nothing generated yet the caller may resolve the name again (UnknownAdapterError).
                self._fail(seq, exc if seq.output_token_ids else UnknownAdapterError(str(exc)))
                continue
            except Exception as exc:  # the adapter failed to load: this request fails, others go on
                self._fail(seq, exc)
                continue
            if not admit:
                if not self._starved_for_room(seq):
                    skipped.append(seq)
                    continue
                # No overtaking it any more: the pages running requests give back go to its adapter. With
                # nothing running, the queue's adapters hold the room: they are let go of (below).
                if not self.running:
                    if self._gave_up(seq, f"its adapter {seq.adapter} finds no GPU pages or slot, and no more can be "
                                          "freed (pinned adapters hold them); unpin adapters, raise --max-loras or "
                                          "give the engine a larger pool"):
                        continue
                    stuck = seq
                skipped.append(seq)
                break
            num_new = self._num_new_tokens(seq, budget)
            whole = seq.num_uncomputed_tokens if seq.seq_id in self._short_alone else num_new
            if num_new == 0 or not self._allocate(seq, whole):
                if num_new and not self.running:  # nothing runs, so no KV page will come back
                    if self._gave_up(seq, f"needs {self.block_manager.num_blocks_needed(seq, whole)} KV pages but "
                                          "no more can be freed (pinned or in-use adapters hold the rest of the "
                                          "pool); shorten the prompt, unpin adapters or give the engine a larger "
                                          "pool"):
                        continue
                    stuck = seq
                self.waiting.appendleft(seq)  # arrival order for pages: no overtaking a big prompt
                break
            self._stuck_steps.clear()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._skipped_steps.pop(seq.seq_id, None)
            self._short_alone.discard(seq.seq_id)
            self._add_to_batch(batch, seq, num_new)
            if seq.adapter is not None:
                loras.add(seq.adapter)
            budget -= num_new
        for seq in reversed(skipped):
            self._skipped_steps[seq.seq_id] = self._skipped_steps.get(seq.seq_id, 0) + 1
            self.waiting.appendleft(seq)
        if stuck is not None:
            self._let_go_of_adapters(but=stuck)
        return batch

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        """Give `seq` the pages for `num_new` more tokens if they can be had (reclaiming idle
        adapter pages first); False leaves everything unchanged."""
        bm = self.block_manager
        if not bm.can_allocate(seq, num_new) and not (
            self.reclaim_pages is not None
            and self.reclaim_pages(bm.num_blocks_needed(seq, num_new)) > 0
            and bm.can_allocate(seq, num_new)
        ):
            return False
        try:
            bm.allocate(seq, num_new)
        except PagePoolError:  # an adapter load on another thread took the pages in between
            return False
        return True

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        num_new = seq.num_uncomputed_tokens
        if num_new <= budget:
            return num_new
        # Without chunking a prompt waits for a step with room for all of it, unless no step ever has
        # room (a prompt, or a preempted sequence regrown, past max_num_batched_tokens): it would wait
        # forever, so it is prefilled in chunks.
        return budget if self.enable_chunked_prefill or num_new > self.max_num_batched_tokens else 0

    def _can_admit_adapter(self, seq: Sequence, loras: set[str]) -> bool:
        if seq.adapter is None or self.adapter_pool is None:
            return True
        if (
            self.max_loras_per_batch is not None
            and seq.adapter not in loras
            and len(loras) >= self.max_loras_per_batch
            and self._skipped_steps.get(seq.seq_id, 0) < self.max_adapter_wait_steps
        ):
            return False
        if seq.adapter_slot is None:
            # Taken again after giving it back (_let_go_of_adapters): the request was counted once already.
            seq.adapter_slot = self.adapter_pool.acquire(seq.adapter, seq.seq_id, count=not seq.adapter_counted)
            seq.adapter_counted = True
        return seq.adapter_slot is not None

    def _starved_for_room(self, seq: Sequence) -> bool:
        """`seq` has waited `max_adapter_wait_steps` steps for an adapter that is loaded and only lacks
        GPU room, which requests admitted after it keep taking."""
        return (
            self._skipped_steps.get(seq.seq_id, 0) >= self.max_adapter_wait_steps
            and self.adapter_state is not None
            and self.adapter_state(seq.adapter) == "room"
        )

    def _gave_up(self, seq: Sequence, message: str) -> bool:
        """Nothing runs and (dequeued) `seq` cannot get room. Wait out transient holders (an adapter copy in
        flight becomes reclaimable once done) for max_stuck_steps steps, then fail it: True if it failed."""
        steps = self._stuck_steps[seq.seq_id] = self._stuck_steps.get(seq.seq_id, 0) + 1
        if steps <= self.max_stuck_steps:
            return False
        self._fail(seq, CapacityError(message))
        return True

    def _let_go_of_adapters(self, *, but: Sequence) -> None:
        """Nothing runs and `but` cannot get pages (for its KV cache or its adapter) or an adapter slot: the
        other queued sequences give back the adapters they hold or wait for, so that idle adapters can give
        their room away (an adapter a queued request holds, or was loaded for, is never evicted). Each takes
        its adapter again when admitted. A replaced version is kept: it could not be taken again."""
        for seq in self.waiting:
            if seq is but or seq.adapter is None or self.adapter_pool is None:
                continue
            if self.adapter_state is not None and self.adapter_state(seq.adapter) != "gpu":
                continue
            if seq.adapter_slot is not None:
                self._release_adapter(seq)
            else:
                self.adapter_pool.abandon(seq.adapter, seq.seq_id)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """Finish a waiting (already dequeued) sequence with an error the engine reports."""
        seq.error = str(exc)
        seq.exception = exc
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        self.block_manager.free(seq)
        if seq.adapter_slot is None and seq.adapter is not None and self.adapter_pool is not None:
            self.adapter_pool.abandon(seq.adapter, seq.seq_id)  # it may wait for its adapter's room
        self._release_adapter(seq)
        self._skipped_steps.pop(seq.seq_id, None)
        self._short_alone.discard(seq.seq_id)
        self._stuck_steps.pop(seq.seq_id, None)
        self.failed.append(seq)

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        if num_new == 1 and seq.num_uncomputed_tokens == 1:  # a decode samples (a 1-token chunk may not)
            batch.decodes.append(seq)
        else:
            batch.prefills.append((seq, num_new))

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        # Recompute later: drop the cache, keep the tokens (prompt + output so far) and the adapter.
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter_slot is not None and self.adapter_pool is not None:
            self.adapter_pool.release(seq.adapter_slot)
        seq.adapter_slot = None
