"""IntakeWaits: requests that found every intake place taken wait for one, for `--intake-wait-s`, instead of a
429 at once.

A burst of more requests than `--max-intake-requests` (a benchmark's 256 connections against 64 places, or 8 on
2 cores) had all but the first refused with 429 intake_full, although a small request holds its place for
milliseconds (its body read, parsed, tokenized): vLLM takes such a burst whole. Waiting costs the worker no
memory beyond the connection: a waiting request's body is not read, it stays in the socket. Each place that
frees goes to one waiter: the one whose tenant reads the fewest requests now, the longest waiting among those,
so one tenant's burst does not queue another tenant's request behind all of it. A newcomer takes a free place
directly only when nobody waits. At most WAITERS_PER_PLACE waiters a place; past that, or after the wait, 429
intake_full as before. Refusals for the tenant's own share (tenant_queue_full, tenant_intake_full) never wait.
"""

from __future__ import annotations

import asyncio

from lorafleet.worker.admission import INTAKE_FULL, Admission

WAITERS_PER_PLACE = 16


class IntakeWaits:
    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._waiters: list[tuple[str, asyncio.Future]] = []  # (tenant, woken) in arrival order
        self._woken = 0  # waiters handed a place that have not taken it yet: newcomers wait behind them

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def enter(self, tenant: str, sequences: bool, shared: bool, wait_s: float) -> str | None:
        """Take an intake place for `tenant` (Admission.enter_intake), waiting up to `wait_s` for one while all
        are taken; None once taken, else why not (counted as a refusal, nothing taken)."""
        admission, loop = self._admission, asyncio.get_running_loop()
        deadline, chosen = loop.time() + wait_s, False
        while True:
            reason = admission.intake_refusal(tenant, sequences, shared)
            first = chosen or not (self._waiters or self._woken)  # no jumping the queue
            if reason is None and first:
                return admission.enter_intake(tenant, sequences, shared)
            left = deadline - loop.time()
            if reason not in (None, INTAKE_FULL) or left <= 0 or len(self._waiters) >= self._most():
                if chosen:
                    self.wake()  # the place it was handed goes on
                admission.num_refused += 1
                return reason or INTAKE_FULL
            woken = loop.create_future()
            entry = (tenant, woken)
            # Handed a place that another took first: first in line again.
            self._waiters.insert(0 if chosen else len(self._waiters), entry)
            self.wake()  # a place free beyond those handed out (it came behind others on one): taken in turn
            try:
                await asyncio.wait({woken}, timeout=left)
            except BaseException:  # its client left (the handler cancelled)
                self._forget(entry, pass_on=True)
                raise
            chosen = self._forget(entry, pass_on=False)

    def _most(self) -> int:
        return self._admission.max_intake * WAITERS_PER_PLACE

    def _forget(self, entry: tuple[str, asyncio.Future], pass_on: bool) -> bool:
        """`entry` no longer waits: whether it was handed a place (passed on to the next with `pass_on`)."""
        woken = entry[1]
        if woken.done():
            self._woken -= 1
            if pass_on:
                self.wake()
            return True
        self._waiters.remove(entry)
        woken.cancel()
        return False

    def wake(self) -> None:
        """An intake place was left (or a waiter queued): hand each place free and not handed already to the
        waiter whose tenant reads the fewest requests now (the longest waiting of those)."""
        admission = self._admission
        reading = admission.num_in_intake_by_tenant
        while self._waiters and (not admission.max_intake
                                 or admission.num_in_intake + self._woken < admission.max_intake):
            at = min(range(len(self._waiters)), key=lambda i: (reading.get(self._waiters[i][0], 0), i))
            _, woken = self._waiters.pop(at)
            self._woken += 1
            woken.set_result(None)
