"""Scheduler: continuous batching over a paged KV cache, adapter-aware, fair across tenants.

Each step: running sequences' decodes first, then their unfinished prompts' next chunks, then waiting ones, all
within `max_num_batched_tokens` tokens and `max_num_seqs` sequences; the prompt chunks of several tenants each
take an even share of the tokens decodes leave, what one leaves going to the others (token_shares.py). Each seat
goes to the tenant (its adapter's name while the request names none) with a preempted sequence, else the fewest
running sequences, else the longest unserved; FCFS within a tenant (waiting_queue.py). When the KV pages run
out, the youngest running sequence of the tenant with the most is preempted (one scheduled earlier in the step
leaves the batch): its pages are freed and it goes back to the head of its tenant's queue to be recomputed later
(it keeps its adapter reference). A waiting sequence whose adapter is not resident yet is skipped (the pool
starts the load) with those of its tenant waiting for the same adapter, while the others run;
`max_loras_per_batch` bounds the distinct adapters of a step (too many segments slow the LoRA kernels), except
for a sequence that has waited `max_adapter_wait_steps` steps, which is admitted anyway so no tenant starves.
For the same reason a sequence that has waited that long for an adapter that is loaded but finds no GPU room is
no longer overtaken for it: short of pages, nothing more is admitted, so the pages running requests give back go
to its adapter; short of a slot only, requests that would take one (a new slot, or a new reference to an adapter
running requests use) wait behind it, the others (base model, or a slot already held) go on while they leave its
pages free. A load in flight never holds anyone back; one waiting that long for its adapter owner's GPU share
holds back new references to that owner's busy adapters only (ShareWaits). An adapter a queued sequence holds (a
preempted one keeps its reference) or was loaded for is never evicted: when nothing runs and a queue's head
cannot get pages, or such a starved sequence's adapter finds no room, the others let go of theirs (those holding
a replaced version, never taken again once let go, go ahead of it). One that preempted itself running alone
(adapters hold the rest of the pool) is readmitted only once the pages of all its tokens can be had, not chunk
by chunk into the same wall; one that never can (`never_fits`) fails at once, or ends by length with its output.
Where several tenants have keys (`shared`), one runs at most three quarters of the seats. Guided decodes whose
grammar work would make a step longer than `max_grammar_seconds_per_step` take turns (grammar_pacing.py).
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections.abc import Callable, Collection

from lorafleet.worker.adapter_entry import AdapterNotFoundError, AdapterSlots, adapter_pages, replaced_version
from lorafleet.worker.admission import tenant_share
from lorafleet.worker.block_manager import BlockManager
from lorafleet.worker.engine_errors import CapacityError, EngineError, UnknownAdapterError
from lorafleet.worker.grammar_pacing import pace
from lorafleet.worker.page_pool import PagePoolError
from lorafleet.worker.scheduled_batch import ScheduledBatch
from lorafleet.worker.sequence import Sequence, SequenceStatus
from lorafleet.worker.token_shares import StepTokens, TokenShares, prefill_tenants
from lorafleet.worker.waiting_queue import WaitingQueue, pinned_on_gpu, waits_behind


class Scheduler(StepTokens):
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
        never_fits: Callable[[Sequence], EngineError | None] | None = None,
        max_grammar_seconds_per_step: float = 0.0,
    ) -> None:
        self.block_manager, self.max_num_seqs, self.max_num_batched_tokens = block_manager, max_num_seqs, max_num_batched_tokens
        self.enable_chunked_prefill, self.adapter_pool = enable_chunked_prefill, adapter_pool
        self.max_loras_per_batch, self.max_adapter_wait_steps = max_loras_per_batch, max_adapter_wait_steps
        # Unified paging: idle adapters (no request uses them) give their pages to the KV cache
        # before any request is preempted. Returns how many pages were freed.
        self.reclaim_pages = reclaim_pages
        # Where an adapter is: "gpu" (its pages taken: resident or copying), "room" (in CPU memory, waiting only
        # for GPU pages or a slot), "quota" (its tenant's own adapters must leave) or "load".
        self.adapter_state = adapter_state
        self.never_fits = never_fits  # why a sequence can never get the KV pages it needs (kv_room.py)
        # A step's estimated grammar seconds for guided decodes (grammar_pacing.py; 0: no bound), each row's estimate
        # (the engine's sampler's GrammarCosts.estimate), and how many decodes it has left out of a step so far.
        self.max_grammar_seconds_per_step, self.num_grammar_deferrals = max_grammar_seconds_per_step, 0
        self.grammar_estimate: Callable[[Sequence], float] = lambda seq: seq.grammar_cost
        self.shared: Callable[[], bool] = bool  # several tenants have keys: one runs at most tenant_share seats
        self.waiting = WaitingQueue(page_wait_limit=max_adapter_wait_steps)
        self.running: list[Sequence] = []
        self._skipped_steps: dict[int, int] = {}  # seq_id -> steps skipped for adapter grouping
        # Sequences that preempted themselves running alone: readmitted only once the pages of all their tokens
        # can be had (chunk by chunk, they would get as far and preempt themselves again).
        self._short_alone: set[int] = set()
        # Steps and seconds a request short of pages, nothing running, may wait (a step can be shorter than the
        # copy it waits for); seq_id -> (steps, since when), cleared by any admission.
        self.max_stuck_steps, self.min_stuck_s, self._stuck_steps, self.num_preemptions = 100, 1.0, {}, 0
        self._stuck_seen: set[int] = set()  # sequences _gave_up looked at in this step's admission
        self.failed: list[Sequence] = []  # ended by the scheduler (a failure, or max_tokens lowered to fit); engine reports them

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
        """Finished or aborted: KV pages and the adapter reference are released at once, also for a sequence a
        failed step left half-moved (its status says a queue it is no longer in)."""
        if seq.status is SequenceStatus.RUNNING and seq in self.running:  # else its share went when it left
            self._remove_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            with contextlib.suppress(ValueError, KeyError):  # not queued (its tenant's queue gone too)
                self.waiting.remove(seq)
        was_waiting_for_adapter = seq.status is SequenceStatus.WAITING and seq.adapter_slot is None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self.block_manager.free(seq, keep=reason != "error")  # a failed one's KV may not be sound
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
        batch, loras, decodes = ScheduledBatch(), set(), [s for s in self.running if s.num_uncomputed_tokens <= 1]
        # 1. Running sequences, oldest first, decodes then prompt chunks; short of pages, preempt (preemption_victim).
        budget = self._run(batch, decodes, self.max_num_batched_tokens, None, loras) + self._pace(batch)
        full = len(self.running) >= self.max_num_seqs  # no seat: no waiting tenant is looked at (thousands may wait)
        shares = TokenShares(budget, prefill_tenants(self.running, self.waiting, self._seats(), admitting=not full))
        budget = self._run(batch, [s for s in self.running if s.num_uncomputed_tokens > 1], budget, shares, loras)
        # 2. Waiting sequences (none while preempting: pages are short), then 3. the tokens left to held chunks.
        if not batch.preempted:  # pages are short: what preempting freed is for the sequence that needed it
            self._top_up(batch, budget if full else self._admit_waiting(batch, budget, loras, shares), loras)
        return batch

    def _pace(self, batch: ScheduledBatch) -> int:
        """Costly guided decodes take turns (grammar_pacing.py): those held this step leave the batch, once the
        preemptions the decodes needed are made (a row kept must not be the one preempted while held ones wait),
        keeping the KV room they got for their next step. Returns their tokens, back to the step's budget."""
        kept, held = pace(batch.decodes, self.max_grammar_seconds_per_step, self.grammar_estimate)
        batch.decodes[:] = kept
        self.num_grammar_deferrals += held
        return held

    def _seats(self) -> int:
        """Seats one tenant may run where several have keys (a quarter stays for the others), else 0: no bound."""
        return tenant_share(self.max_num_seqs) if self.shared() else 0

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, loras: set[str], shares: TokenShares) -> int:
        """Admit waiting sequences while seats and tokens last, each from the tenant ranked first
        (WaitingQueue.rank), FCFS within a tenant. A head passed over for its adapter lets the tenant's
        others go; a head short of KV pages stops admission (no overtaking a big prompt)."""
        heap = [self.waiting.rank(t) for t in self.waiting.tenants()]
        heapq.heapify(heap)
        passed: set[tuple[str, str | None]] = set()  # (tenant, adapter) queues passed over this step
        looked: set[int] = set()  # sequences dequeued this step; self._stuck_seen: those of them that were stuck
        self._stuck_seen = set()
        skipped: list[Sequence] = []  # passed over for their adapter (count towards max_adapter_wait_steps)
        stuck: Sequence | None = None  # cannot get room (KV pages, or its adapter's) while nothing runs
        starved: Sequence | None = None  # next in line for a GPU slot (see _starved_for_room)
        reserve = 0  # KV pages left free for the starved sequence's adapter
        busy: set[str] = set()  # adapters running requests use: they must drain for it (see waits_behind)
        held = self.waiting.share_waits.held(self.running, self.adapter_state, self.adapter_pool)
        seats = self._seats()
        past_share: list[str] = []  # tenants held to their token share: they take what the others leave
        while (heap or past_share) and budget > 0 and len(self.running) < self.max_num_seqs:
            if not heap:  # every other tenant served: running prompts, then those past their share take the rest
                budget = budget if starved is not None else self._top_up(batch, budget, loras)
                shares.lift()
                heap = [self.waiting.rank(t) for t in past_share if self.waiting.has_tenant(t)]
                heapq.heapify(heap)
                past_share = []
                continue
            tenant = heapq.heappop(heap)[-1]
            if self.waiting.seated(tenant, seats):
                continue  # none running is preempted for them
            if shares.exhausted(tenant):
                past_share.append(tenant)
                continue
            seq = self._next_head(tenant, passed, busy if starved is not None else None, held)
            if seq is None:
                continue  # nothing more of this tenant can go this step
            looked.add(seq.seq_id)
            if (self._stuck_steps and not self.running and seq.seq_id not in self._stuck_steps
                    and seq.adapter is not None and seq.adapter_slot is None
                    and not pinned_on_gpu(seq.adapter, self.adapter_state, self.adapter_pool)
                    ) or (not self.waiting.page_starved(seq) and self.block_manager.filled_by_another(seq, batch)):
                # Another waits for the room adapters hold, nothing running: no adapter is placed or held again
                # meanwhile (two would trade the room every step); a pinned one never gives its room anyway. Or a
                # prefill of this step writes a block of its tokens: it takes it kept at the next (prefix_cache.py).
                passed.add((tenant, seq.adapter))
                self._requeue(heap, tenant)
                continue
            try:
                admit = self._can_admit_adapter(seq, loras)
            except AdapterNotFoundError as exc:
                # Its version was replaced or unregistered before the pool could load it for this request.
                # With nothing generated yet the caller may resolve the name again (UnknownAdapterError).
                self.fail([seq], exc if seq.output_token_ids else UnknownAdapterError(str(exc)))
                self._requeue(heap, tenant)
                continue
            except Exception as exc:  # its adapter failed to load or leaves too little room: it fails
                self.fail([seq], exc if seq.output_token_ids or not replaced_version(seq.adapter, self.adapter_pool) else
                          UnknownAdapterError(f"{exc} (a push replaced {seq.adapter} meanwhile)"))
                self._requeue(heap, tenant)
                continue
            if not admit:
                passed.add((tenant, seq.adapter))
                if self._starved_for_room(seq, "quota"):
                    self.waiting.share_waits.note(seq, self.adapter_pool)
                if starved is None and self._starved_for_room(seq):
                    # No overtaking it for GPU room any more: with nothing running, the queue's adapters hold
                    # the room (let go of below); short of pages, the pages running requests give back go to
                    # its adapter; short of a slot only, requests that need no new slot still go.
                    starved = seq
                    if not self.running:
                        if self._gave_up(seq, f"its adapter {seq.adapter} finds no GPU pages or slot, and no more "
                                              "can be freed (pinned adapters hold them); unpin adapters, raise "
                                              "--max-loras or give the engine a larger pool"):
                            self._requeue(heap, tenant)
                            continue
                        stuck = seq
                    pages = adapter_pages(seq.adapter, self.adapter_pool)
                    if stuck is not None or pages is None or not self.block_manager.allocator.can_allocate(
                            pages, "adapter"):
                        skipped.append(seq)
                        break
                    reserve = pages
                    busy = {s.adapter for s in self.running if s.adapter is not None}
                skipped.append(seq)
                self._requeue(heap, tenant)
                continue
            self.block_manager.attach(seq)  # from the kept blocks its tokens begin with (prefix_cache.py)
            num_new = self._num_new_tokens(seq, budget, shares.cap(seq, budget))
            whole = seq.num_uncomputed_tokens if seq.seq_id in self._short_alone else num_new
            if (num_new == 0 or (reserve and not self.block_manager.can_allocate(seq, whole, reserve=reserve))
                    or not self._allocate(seq, whole)):
                needed = self.block_manager.num_blocks_needed(seq, whole)
                short = num_new and needed > self.block_manager.allocator.available("kv")  # its kept blocks not idle yet
                self.block_manager.free(seq)  # lets the kept blocks go
                if num_new and not self.running:  # nothing runs, so no KV page will come back
                    if self._gave_up(seq, f"needs {needed} KV pages but "
                                          "no more can be freed (pinned or in-use adapters hold the rest of the "
                                          "pool); shorten the prompt, unpin adapters or give the engine a larger "
                                          "pool"):
                        self._requeue(heap, tenant)
                        continue
                    stuck = seq
                if short:
                    self.waiting.short_of_pages(seq)  # short not only of the reserve (seen without reclaiming): no overtaking it for ever
                break
            self._start(seq, batch, num_new, loras)
            self.block_manager.admitted(seq)
            shares.take(seq, num_new)
            if seq.adapter is not None and starved is not None:
                busy.add(seq.adapter)
            budget -= num_new
            self._requeue(heap, tenant)
        for seq in skipped:
            self._skipped_steps[seq.seq_id] = self._skipped_steps.get(seq.seq_id, 0) + 1
        # One stuck before and looked at now without giving up room (its adapter waits for its owner's quota now,
        # or room came): no longer passes every other request over, which could be the one that frees its way.
        for seq_id in looked - self._stuck_seen:
            self._stuck_steps.pop(seq_id, None)
        if stuck is not None:
            self._let_go_of_adapters(but=stuck)
        return 0 if starved is not None else budget  # no top-up while one waits for room: pages go to it

    def _start(self, seq: Sequence, batch: ScheduledBatch, num_new: int, loras: set[str]) -> None:
        self.waiting.remove(seq)
        self._stuck_steps.clear()
        seq.status = SequenceStatus.RUNNING
        if seq.scheduled_at is None:  # kept over preemptions: the queue time is to the first admission
            seq.scheduled_at = time.monotonic()
        self.running.append(seq)  # its skipped steps stay until it finishes: preempted, it waits out no bound again
        self.waiting.started(seq)
        self._short_alone.discard(seq.seq_id)
        batch.add(seq, num_new)
        if seq.adapter is not None:
            loras.add(seq.adapter)

    def _requeue(self, heap: list[tuple], tenant: str) -> None:
        if self.waiting.has_tenant(tenant):
            heapq.heappush(heap, self.waiting.rank(tenant))

    def _next_head(self, tenant: str, passed: set, busy: set[str] | None, held: Collection[str]) -> Sequence | None:
        """The tenant's oldest head not passed over this step. `busy` is set once a sequence is starved for a GPU
        slot: those that would take its slot wait behind it (waits_behind); `held`: see ShareWaits."""
        for _, seq in self.waiting.heads(tenant):
            if (tenant, seq.adapter) in passed:
                continue
            if (busy is not None and waits_behind(seq, busy, self.adapter_state, self.adapter_pool)) or (
                    seq.adapter in held and seq.adapter_slot is None):
                passed.add((tenant, seq.adapter))
                continue
            return seq
        return None

    def _remove_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.waiting.stopped(seq)

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

    def _can_admit_adapter(self, seq: Sequence, loras: set[str]) -> bool:
        if seq.adapter is None or self.adapter_pool is None:
            return True
        seated = self._fits(seq, loras) or self._skipped_steps.get(seq.seq_id, 0) >= self.max_adapter_wait_steps
        # Without a seat in the step (max_loras_per_batch), an adapter not on the GPU still starts loading now, so
        # that it is there when a seat frees (it keeps the reference if it lands at once, as a preempted one does).
        if seq.adapter_slot is None and (seated or self.adapter_state is not None and self.adapter_state(seq.adapter) != "gpu"):
            # Its GPU hit or miss was counted as it arrived (Engine.add_request), once.
            seq.adapter_slot = self.adapter_pool.acquire(seq.adapter, seq.seq_id, count=False, tenant=seq.tenant)
            if seq.adapter_slot is not None and not seq.kv_room_checked and self.never_fits and (exc := self.never_fits(seq)):
                raise exc  # its adapter's size is known now
        return seated and seq.adapter_slot is not None

    def _starved_for_room(self, seq: Sequence, state: str = "room") -> bool:
        """`seq` has waited `max_adapter_wait_steps` steps for an adapter that is loaded and only lacks
        GPU room ("room"), or its tenant's GPU share ("quota"), which requests admitted after it keep taking."""
        return (self._skipped_steps.get(seq.seq_id, 0) >= self.max_adapter_wait_steps
                and self.adapter_state is not None and self.adapter_state(seq.adapter) == state)

    def _gave_up(self, seq: Sequence, message: str) -> bool:
        """Nothing runs and (dequeued) `seq` cannot get room. One that never can (`never_fits`) fails at once;
        else wait out transient holders (an adapter copy in flight becomes reclaimable once done) for
        max_stuck_steps steps and min_stuck_s seconds, then fail it: True if it failed."""
        steps, since = self._stuck_steps.get(seq.seq_id, (0, time.monotonic()))
        self._stuck_steps[seq.seq_id] = (steps := steps + 1, since)
        self._stuck_seen.add(seq.seq_id)
        never = self.never_fits(seq) if self.never_fits is not None else None
        # Lowered to fit and reached; or never fitting (pins since it began), its min_tokens written: ends by length
        if len(seq.output_token_ids) >= (max(1, seq.params.min_tokens) if never is not None else seq.params.max_tokens):
            self.finish(seq, "length")
            self.failed.append(seq)  # reported at the engine's next step
            return True
        if never is None and (steps <= self.max_stuck_steps or time.monotonic() - since < self.min_stuck_s):
            return False
        self.fail([seq], never or CapacityError(message))
        return True

    def _let_go_of_adapters(self, *, but: Sequence) -> None:
        """Nothing runs and `but` cannot get pages or a slot: the other queued sequences give back the adapters
        they hold or wait for, so that idle ones give their room away (one a queued request holds or was loaded
        for is never evicted); each takes it again when admitted. Its version stays registered for it meanwhile
        (detached), also one a push replaced: it may leave the GPU and is read again when the sequence is back."""
        for seq in list(self.waiting):
            if seq is but or seq.adapter is None or self.adapter_pool is None:
                continue
            if self.adapter_state is not None and self.adapter_state(seq.adapter) != "gpu":
                continue  # nothing of it on the GPU to give back
            # It keeps its version (AdapterPool.hold, as a queued request does): a push may not drop it meanwhile.
            if seq.adapter_slot is None:
                self.adapter_pool.abandon(seq.adapter, seq.seq_id, detach=True)
            else:
                self._release_adapter(seq, detach=True)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        # Recompute later (from its blocks still kept): keep the tokens (prompt + output so far) and the adapter.
        self._remove_running(seq)
        self.block_manager.free(seq, keep=True)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _release_adapter(self, seq: Sequence, *, detach: bool = False) -> None:
        if seq.adapter_slot is not None and self.adapter_pool is not None:
            self.adapter_pool.release(seq.adapter_slot, detach=seq.seq_id if detach else None, tenant=seq.tenant)
        seq.adapter_slot = None
