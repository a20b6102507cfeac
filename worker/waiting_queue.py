"""WaitingQueue: the scheduler's waiting sequences, one FCFS queue per tenant, served fairly; and the
running sequence to preempt, taken from the tenant that holds the most seats.

Each tenant's queue is split by adapter, so that the scheduler looks only at the head of each
(tenant, adapter) queue: the sequences behind a head share its adapter, and with it the reason it
waits. Arrival tickets keep FCFS within a tenant across its adapters; a sequence put back at the
front (preempted) gets a ticket below every other, so it comes first, as at the front of one queue.
A head passed over for KV pages `page_wait_limit` times keeps its place: its tenant ranks before those
that would take the pages running requests give back (a stream of requests from tenants served less
recently held a large prompt back for ever).

Running example: tenant t1 sends a@1 (ticket 0), base (1), a@1 (2); t2 sends b@1 (3). Queues:
t1 -> {a@1: [0, 2], None: [1]}, t2 -> {b@1: [3]}; heads(t1) = [a@1 #0, base #1]. Preempting the
base sequence of t1 puts it back as ticket -1: heads(t1) = [base #-1, a@1 #0].
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator

from lorafleet.worker.adapter_entry import AdapterNotFoundError, AdapterSlots
from lorafleet.worker.sequence import Sequence, SequenceStatus


def fairness_key(seq: Sequence) -> str:
    """Whose share a sequence counts against: its tenant when known, else its adapter's name (the
    base model is one more key)."""
    if seq.tenant is not None:
        return f"tenant {seq.tenant}"
    return "base" if seq.adapter is None else f"adapter {seq.adapter.split('@')[0]}"


def preemption_victim(running: list[Sequence]) -> Sequence:
    """Whom to preempt when KV pages run out: the youngest of `running` (in admission order) whose tenant
    runs the most sequences, so that the pressure falls on the tenant holding the most seats, as admission
    gives seats to the one holding the fewest; among tied tenants, the youngest overall."""
    counts = Counter(fairness_key(s) for s in running)
    most = max(counts.values())
    return next(s for s in reversed(running) if counts[fairness_key(s)] == most)


class WaitingQueue:
    def __init__(self, page_wait_limit: int = 32) -> None:
        self.page_wait_limit = page_wait_limit
        self._page_waits: dict[int, int] = {}  # seq_id -> steps passed over for KV pages at its tenant's head
        # tenant -> adapter key (None = base model) -> deque of (ticket, sequence), tickets increasing.
        self._queues: dict[str, dict[str | None, deque[tuple[int, Sequence]]]] = {}
        self._tickets = itertools.count()  # arrivals
        self._front_tickets = itertools.count(-1, -1)  # put back at the front: below every arrival
        self._len = 0
        self._num_running: dict[str, int] = {}  # tenant -> its running sequences
        self._served_at: dict[str, int] = {}  # tenant -> number of its last admission
        self._admissions = itertools.count()
        self.share_waits = ShareWaits()  # requests waiting for their adapter owner's GPU share (the scheduler's)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Tenant by tenant, each in its order. A snapshot: safe while the engine thread changes it."""
        for subs in list(self._queues.values()):
            for _, seq in sorted((item for q in list(subs.values()) for item in list(q)), key=lambda it: it[0]):
                yield seq

    def append(self, seq: Sequence) -> None:
        self._queue(seq).append((next(self._tickets), seq))
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        self._queue(seq).appendleft((next(self._front_tickets), seq))
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        tenant = fairness_key(seq)
        q = self._queues[tenant][seq.adapter]
        for item in q:
            if item[1] is seq:
                q.remove(item)
                break
        else:
            raise ValueError(f"{seq!r} is not waiting")
        self._len -= 1
        self._page_waits.pop(seq.seq_id, None)
        self._drop_if_empty(tenant, seq.adapter)

    def tenants(self) -> list[str]:
        return list(self._queues)

    def has_tenant(self, tenant: str) -> bool:
        return tenant in self._queues

    def heads(self, tenant: str) -> list[tuple[int, Sequence]]:
        """(ticket, sequence) at the head of each of the tenant's adapter queues, oldest first."""
        return sorted((q[0] for q in self._queues[tenant].values()), key=lambda it: it[0])

    def rank(self, tenant: str) -> tuple[bool, bool, int, int, int, str]:
        """Order in which waiting tenants are served (lowest first): one with a preempted sequence first (it
        keeps its place), then one with a head that has waited for KV pages `page_wait_limit` steps, then the
        fewest running sequences, the longest since its last admission (for a tenant that had nothing running
        or queued, since its arrival: ranked as never served, a stream of such tenants took every seat), the
        oldest head."""
        heads = self.heads(tenant)
        starved = any(self.page_starved(seq) for _, seq in heads)
        ticket = heads[0][0]
        return ticket >= 0, not starved, self._num_running.get(tenant, 0), self._served_at.get(tenant, -1), ticket, tenant

    def running(self, tenant: str) -> int:
        return self._num_running.get(tenant, 0)

    def seated(self, tenant: str, seats: int) -> bool:
        """`tenant` runs its `seats` (0: no bound) already: none more is admitted for it this step."""
        return bool(seats) and self.running(tenant) >= seats

    def page_starved(self, seq: Sequence) -> bool:
        """`seq` has been passed over for KV pages `page_wait_limit` times: nothing may overtake it any more."""
        return self._page_waits.get(seq.seq_id, 0) >= self.page_wait_limit

    def short_of_pages(self, seq: Sequence) -> None:
        """`seq`, a head, was passed over this step for want of KV pages."""
        self._page_waits[seq.seq_id] = self._page_waits.get(seq.seq_id, 0) + 1

    def started(self, seq: Sequence) -> None:
        """`seq` (just taken from the queue) runs: it counts against its tenant's share."""
        tenant = fairness_key(seq)
        self._num_running[tenant] = self._num_running.get(tenant, 0) + 1
        self._served_at[tenant] = next(self._admissions)

    def stopped(self, seq: Sequence) -> None:
        """`seq` no longer runs (finished, failed or preempted)."""
        tenant = fairness_key(seq)
        self._num_running[tenant] -= 1
        if not self._num_running[tenant]:
            del self._num_running[tenant]
            if tenant not in self._queues:
                self._served_at.pop(tenant, None)

    def popleft(self, tenant: str, adapter: str | None) -> Sequence:
        q = self._queues[tenant][adapter]
        _, seq = q.popleft()
        self._len -= 1
        self._page_waits.pop(seq.seq_id, None)
        self._drop_if_empty(tenant, adapter)
        return seq

    def _queue(self, seq: Sequence) -> deque[tuple[int, Sequence]]:
        tenant = fairness_key(seq)
        if tenant not in self._served_at:  # new, or back from idle: it counts from its arrival, not before all
            self._served_at[tenant] = next(self._admissions)
        return self._queues.setdefault(tenant, {}).setdefault(seq.adapter, deque())

    def _drop_if_empty(self, tenant: str, adapter: str | None) -> None:
        subs = self._queues[tenant]
        if not subs[adapter]:
            del subs[adapter]
            if not subs:
                del self._queues[tenant]
                if tenant not in self._num_running:
                    self._served_at.pop(tenant, None)


class ShareWaits:
    """Requests that waited `max_adapter_wait_steps` steps for their adapter's owner's GPU share (the engine's
    adapter state "quota": only that owner's adapters leaving make room). While one waits, no request, whoever
    its caller, takes a new reference to an adapter of that owner that running requests use: those go idle and
    leave (a stream of requests for them kept the share full for ever). Other owners' adapters go on."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[Sequence, str | None]] = {}  # seq_id -> (the request, its adapter's owner)

    def note(self, seq: Sequence, adapter_pool: AdapterSlots) -> None:
        self._waiting[seq.seq_id] = (seq, _owner(adapter_pool, seq.adapter))

    def held(self, running: list[Sequence], adapter_state: Callable[[str], str], adapter_pool: AdapterSlots) -> set[str]:
        """The adapters no request may take a new reference to now (those still waiting are looked at again)."""
        self._waiting = {i: (s, o) for i, (s, o) in self._waiting.items()
                         if s.status == SequenceStatus.WAITING and adapter_state(s.adapter) == "quota"}
        owners = {o for _, o in self._waiting.values()}
        if not owners:
            return set()
        return {a for a in {s.adapter for s in running if s.adapter is not None} if _owner(adapter_pool, a) in owners}


def _owner(adapter_pool: AdapterSlots, key: str) -> str | None:
    try:
        return adapter_pool.entry(key).tenant
    except AdapterNotFoundError:
        return None


def waits_behind(seq: Sequence, busy: set[str], adapter_state: Callable[[str], str] | None,
                 adapter_pool: AdapterSlots | None) -> bool:
    """With a sequence starved for a GPU slot, does admitting `seq` keep that slot from it? A new slot
    would, and so would a new reference to an adapter running requests use (`busy`: a stream of them would
    never let it go idle, to be evicted). A base-model request, one holding its slot (preempted), or
    one for an adapter on the GPU that no running request uses (it waits for its requests, or is
    pinned: never evicted either way) goes on."""
    if seq.adapter is None or seq.adapter_slot is not None:
        return False
    if adapter_state is None or adapter_state(seq.adapter) != "gpu":
        return True
    if seq.adapter not in busy:
        return False
    try:
        return not adapter_pool.entry(seq.adapter).pinned
    except AdapterNotFoundError:
        return True


def pinned_on_gpu(key: str, adapter_state: Callable[[str], str] | None, adapter_pool: AdapterSlots | None) -> bool:
    """Adapter `key` is on the GPU and pinned: it never gives its room to anyone."""
    try:
        return adapter_state is not None and adapter_state(key) == "gpu" and adapter_pool.entry(key).pinned
    except AdapterNotFoundError:
        return False
