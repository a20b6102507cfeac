"""Directive pushes to a pool's worker pods, each in a task of its own that a pass waits on briefly only.

A sidecar may be slow to answer a push (its first one since it started is answered once staged, up to the
operator's push timeout), and a pass holds its pool's lock. A pass waiting for the slowest pod delayed every
other pod's next directive by as long, an emergency canary rollback's included, and each pass queued on the
lock meanwhile pushed to the slow pod once more. So:

* a pod has at most one push in flight (a ``Flight``). A pass that wants to push to a pod with one in flight
  queues its desired state there instead (the newest replaces any queued before); once the push in flight is
  answered, the queued one is pushed at once, with no pass waiting for it, unless the answer accepted the
  same adapter set and settings (a generation apart only);
* a pass waits ``wait`` seconds at most for the flights it started (``push``), none for those in flight before
  it: they were slow already, and each pass queued on the pool's lock waiting for them would hold up the next
  edit once more. It stops waiting once another pass wants the pool (``cut``), else the pass queued behind it
  would wait as long, for pods whose push it merely queues. A pod that has not answered by then counts as not
  answered, never as accepted: the caller keeps what it holds unknown, and the answer, when it comes, goes to
  the next pass of its pool (``settle``).

Each answer says which desired state it is for: the last one pushed, which need not be the pass's own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

from lorafleet.operator.workers import Refused, StagerClient, Worker
from lorafleet.worker.directives import DesiredState

log = logging.getLogger(__name__)
PoolKey = tuple[str, str]  # (namespace, pool name)
Outcome = Literal[True] | Refused | None  # StagerClient.push's: accepted, refused, no answer
Answer = tuple[Worker, DesiredState, Outcome]  # (the pod, the desired state pushed to it last, how it answered)


@dataclass(slots=True)
class Flight:
    """One pod's push in flight, and what to push once it is answered."""

    worker: Worker
    desired: DesiredState  # being pushed now
    queued: DesiredState | None = None  # the newest a pass wanted since
    task: asyncio.Task | None = None


def same_set(a: DesiredState, b: DesiredState) -> bool:
    """The same adapters and pool settings (their generations aside)."""
    return (a.adapters, a.eviction, a.cpu_bytes) == (b.adapters, b.eviction, b.cpu_bytes)


class PushFlights:
    """Every pool's pushes in flight (``push`` / ``settle`` / ``forget``), over one ``StagerClient``."""

    def __init__(self, client: StagerClient, *, wait: float) -> None:
        self.client = client
        self.wait = wait
        self._flights: dict[PoolKey, dict[Worker, Flight]] = {}
        self._answers: dict[PoolKey, dict[Worker, Answer]] = {}  # answered, not yet handed to a pass

    def in_flight(self, key: PoolKey) -> list[str]:
        """The pods of pool ``key`` with a push not answered yet."""
        return sorted(w.pod for w in self._flights.get(key, {}))

    async def push(self, key: PoolKey, pushes: dict[str, tuple[Worker, DesiredState]], *,
                   cut: asyncio.Event | None = None) -> dict[str, Answer]:
        """Push each pod its desired state (queued behind a push in flight to it), and wait ``wait`` seconds at
        most for the pushes started here, none once ``cut`` is set: pod -> its answer, for those answered by then
        (the rest: ``settle``, later)."""
        flights = self._flights.setdefault(key, {})
        earlier = self._answers.get(key, {})
        tasks = set()
        for worker, desired in pushes.values():
            flight = flights.get(worker)
            if flight is None:
                # An earlier push's answer come since this pass began: this push supersedes it. Handed back,
                # it would pass as this push's answer while this one is still unanswered.
                earlier.pop(worker, None)
                flight = flights[worker] = Flight(worker, desired)
                flight.task = asyncio.create_task(self._fly(key, flight))
                tasks.add(flight.task)
            else:
                flight.queued = desired
        if tasks:  # a pass cancelled here leaves its flights running: their answers go to the next pass
            await _until_answered(tasks, self.wait, cut)
        answers = self._answers.get(key, {})
        return {pod: answers.pop(worker) for pod, (worker, _) in pushes.items() if worker in answers}

    def settle(self, key: PoolKey) -> list[Answer]:
        """The answers to pool ``key``'s pushes that came after the pass that made them had ended."""
        return list(self._answers.pop(key, {}).values())

    async def _fly(self, key: PoolKey, flight: Flight) -> None:
        outcome: Outcome = None
        try:
            while True:
                outcome = None  # until the push of flight.desired is answered
                outcome = await self.client.push(flight.worker, flight.desired)
                queued, flight.queued = flight.queued, None
                if queued is None or (outcome and same_set(queued, flight.desired)):
                    break
                flight.desired = queued
        finally:
            # No await from the last answer to here: a pass never queues on a flight that has ended.
            flights = self._flights.get(key)
            if flights is not None and flights.get(flight.worker) is flight:  # else forgotten: nobody asks
                del flights[flight.worker]
                self._answers.setdefault(key, {})[flight.worker] = (flight.worker, flight.desired, outcome)

    def forget(self, key: PoolKey) -> None:
        """Drop pool ``key``'s flights (cancelled: what they pushed is nobody's record any more) and answers."""
        for flight in self._flights.pop(key, {}).values():
            if flight.task is not None:
                flight.task.cancel()
        self._answers.pop(key, None)

    async def close(self) -> None:
        """Cancel every flight and close the client (the operator is stopping)."""
        tasks = [f.task for flights in self._flights.values() for f in flights.values() if f.task is not None]
        for key in list(self._flights):
            self.forget(key)
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()


async def _until_answered(tasks: set[asyncio.Task], timeout: float, cut: asyncio.Event | None) -> None:
    """Until every flight of ``tasks`` has ended, ``timeout`` seconds have passed or ``cut`` is set (the flights
    go on)."""
    if cut is None:
        await asyncio.wait(tasks, timeout=timeout)
        return
    answered = asyncio.ensure_future(asyncio.wait(tasks, timeout=timeout))
    called = asyncio.ensure_future(cut.wait())
    try:
        await asyncio.wait((answered, called), return_when=asyncio.FIRST_COMPLETED)
    finally:
        answered.cancel()
        called.cancel()
