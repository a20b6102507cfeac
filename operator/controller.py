"""One reconcile pass over a pool: gather (indexes + sidecar reports) -> reconcile_pool -> push.

Kopf-free glue between the thin handlers and the pure ``reconcile_pool``; one pass per pool at a
time (a lock per pool), and the last plan is kept so per-adapter timers do not each redo the pass; the calls
queued on the lock are answered by one pass that reads the indexes once it runs (``run_reading``). A pass
waits ``push_wait`` seconds at most for its pushes' answers, and stops waiting once another call needs a pass of
its own (an edit queued behind it on the pool's lock): a pod slower to answer is answered in the background and
delays no other pod's directive (push_flights.py); until it answers, it counts as not told.
A deleting pool is drained: its workers are told to hold nothing (its finalizer waits for that); one whose
workerSelector is invalid owns no pod, and drains the pods its push record names (after a restart, those its
status.pushedPods names) as pods it released: which pods it selected is unknown.
Which pool owns a pod that several select: ``ownership.own_pods``. A pod a live pool pushed to and no longer
owns (its labels or the pool's workerSelector changed, or an earlier pool with an invalid spec came to
select it) is drained the same way unless another pool takes it over: ``ownership.released_pods``; so is one
it pushed to that it may no longer reach (worker_trust.py: its spec.workerDeployment changed, or came to be
set), known by its (name, uid) in the pool's push record.

A valid pool's running pods that are not ready are read too: those whose sidecar awaits its first push (a new pod,
its model loading) are told the pool's set, none warm, so that they stage it while they start and turn ready
with it (reconcile.py: ``starting``); the others keep what they hold.
While an adapter is being deleted, the pods that cannot be pushed the pool's set are reached too, to unload
it: a live pool's running pods that are not ready, an invalid pool's pods (reconcile.py: ``held``); where its
workerSelector is invalid too, the pods its push record names (it pushed to them while valid) that no other
pool selects, else one would keep serving the adapter until the pool's spec is fixed. A pod
that cannot be told (its sidecar does not answer; or it is not ready and what it accepted is not known) holds
up the adapter's finalizer for ``unload_grace`` seconds at most when its pool will tell it its set once it
can (a valid pool, or a deleting one, whose finalizer waits for it): ``plan.overdue`` lists those past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from lorafleet.operator.crd_models import PoolSpec, SpecError, drain_spec, parse_adapter
from lorafleet.operator.ownership import first_claim, own_pods, pod_names, pool_claims, released_pods
from lorafleet.operator.push_flights import Outcome, PoolKey, PushFlights
from lorafleet.operator.push_record import PushRecord, pod_id, pushed_pod_ids
from lorafleet.operator.reconcile import PoolPlan, WorkerReport, reconcile_pool
from lorafleet.operator.reported_sizes import ReportedSizes
from lorafleet.operator.retry_backoff import RetryBackoff
from lorafleet.operator.status_patches import utc_now
from lorafleet.operator.statuses import with_refused_pushes
from lorafleet.operator.workers import Refused, StagerClient, Worker, discover_workers
from lorafleet.worker.directives import DesiredState, ReportedState

log = logging.getLogger(__name__)
# Seconds (at least; the operator makes it three of its passes when those are longer) a pod's last answer stands
# in for its sidecar's missing one (a timed-out state read): its warm copies stay placed there instead of moving
# to other workers and back (placement.py), which would load and pin them twice over; past it they are placed
# elsewhere, as for a pod that is gone.
QUIET_GRACE_S = 60.0
# Seconds a pass waits for its pushes' answers. A sidecar answers once what needs no download is applied,
# usually well within it; its first push since it started, only once staged (up to the push timeout).
PUSH_WAIT_S = 2.0


class PassInputs(NamedTuple):
    """What a pass reads: the pool's bodies (live or deleting), its adapters, the pods it may reach, the
    namespace's other pools and ReplicaSets, and the namespace's pods it may not reach (worker_trust.py)."""
    pools: list[dict[str, Any]]
    adapters: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    other_pools: list[dict[str, Any]]
    replicasets: list[dict[str, Any]]
    former: list[dict[str, Any]] = []  # read only; those its push record names are emptied (controller.py)


@dataclass(slots=True)
class PassResult:
    plan: PoolPlan
    started: float  # time.monotonic() when its inputs were read (at the latest)


class PoolController:
    def __init__(self, client: StagerClient, *, retry_base: float = 10.0, retry_cap: float = 300.0,
                 unload_grace: float = 300.0, quiet_grace: float = QUIET_GRACE_S, push_wait: float = PUSH_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.flights = PushFlights(client, wait=push_wait)
        self.clock = clock
        self.unload_grace = unload_grace
        self.quiet_grace = quiet_grace
        self._untold: dict[PoolKey, dict[tuple[str, str], float]] = {}  # (pod, uid) -> when last it could be told
        self._locks: dict[PoolKey, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._results: dict[PoolKey, PassResult] = {}
        # The pass holding a pool's lock: (when its caller read its inputs, set to cut its push wait short)
        self._passing: dict[PoolKey, tuple[float, asyncio.Event]] = {}
        self._callers: dict[PoolKey, int] = defaultdict(int)  # calls holding or waiting for a pool's lock
        self._backoff: dict[PoolKey, RetryBackoff] = defaultdict(lambda: RetryBackoff(retry_base, retry_cap))
        self.push_records: dict[PoolKey, PushRecord] = {}  # what each pool's pods accepted
        # (pod, uid) -> (when, its sidecar's last answer): stands in for one that misses a few passes (quiet_grace)
        self._answers: dict[PoolKey, dict[tuple[str, str], tuple[float, ReportedState]]] = {}
        self._refusals: dict[PoolKey, dict[str, str]] = {}  # pod -> why its sidecar refused its set
        self._sizes: dict[PoolKey, ReportedSizes] = defaultdict(ReportedSizes)  # ahead of the statuses read back

    async def run(self, key: PoolKey, *, pools: Iterable[dict[str, Any]], adapters: Iterable[dict[str, Any]],
                  pods: Iterable[dict[str, Any]], other_pools: Iterable[dict[str, Any]] = (),
                  replicasets: Iterable[dict[str, Any]] = (), former: Iterable[dict[str, Any]] = (),
                  max_age: float = 0.0) -> PoolPlan:
        """A fresh plan (or the last one when younger than ``max_age`` seconds) for pool ``key`` from inputs read
        before the call; ``replicasets``: the namespace's (worker_trust.slim_replicaset); ``former``: the pods
        ``pods`` leaves out (see ``PassInputs``)."""
        inputs = PassInputs(list(pools), list(adapters), list(pods), list(other_pools), list(replicasets),
                            list(former))
        return await self.run_reading(key, lambda: inputs, max_age=max_age, live=False)

    async def run_reading(self, key: PoolKey, read: Callable[[], PassInputs], *, max_age: float = 0.0,
                          live: bool = True) -> PoolPlan:
        """As ``run``, with the inputs read by ``read()`` once this call holds the pool's lock and needs a pass.
        ``live``: ``read`` reads the current state (the operator's indexes), so the calls that queued on the
        lock meanwhile are all answered by that one pass, not one pass each (a thousand adapters deleted at
        once: a handful of passes, not a thousand)."""
        started = time.monotonic()  # the caller read its inputs before this (``live``: reads them after)
        passing = self._passing.get(key)
        if passing is not None:  # once its plan will not do for this call, it stops waiting for its pushes'
            # answers, which would hold this call up as long (a timer's call that it serves now: once too old)
            asyncio.get_running_loop().call_later(max(0.0, passing[0] + max_age - started), passing[1].set)
        with self._calling(key):
            async with self._locks[key]:
                last = self._results.get(key)
                # A pass whose caller read its inputs after this call began is as fresh as a new one. Not one that
                # merely ran later: a timer's call that read them before an edit, then waited for the lock, would
                # answer the edit's call with the spec before the edit.
                if last is not None and (last.started >= started or time.monotonic() - last.started < max_age):
                    return last.plan
                begun = time.monotonic() if live else started
                inputs = read()
                cut = asyncio.Event()
                self._passing[key] = (begun, cut)
                try:
                    plan = await self._run(key, *inputs, cut=cut)
                finally:
                    del self._passing[key]
                self._results[key] = PassResult(plan, begun)
                return plan

    @contextlib.contextmanager
    def _calling(self, key: PoolKey) -> Iterator[None]:
        """Counts the calls holding or waiting for pool ``key``'s lock (``retain`` keeps the lock while any)."""
        self._callers[key] += 1
        try:
            yield
        finally:
            self._callers[key] -= 1
            if not self._callers[key]:
                del self._callers[key]

    async def _run(self, key: PoolKey, pools: list[dict], adapters: list[dict], pods: list[dict],
                   other_pools: list[dict], replicasets: list[dict], former: list[dict], *,
                   cut: asyncio.Event) -> PoolPlan:
        pool, pool_error, draining, invalid, lost = None, None, None, None, None
        blind = False  # deleting with an invalid workerSelector: only its push record names its pods
        for body in pools:
            deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
            try:
                parsed = PoolSpec.parse(body)
            except SpecError as exc:
                if not deleting:
                    pool_error = str(exc)
                    invalid = drain_spec(body)  # which pods it holds (None: its selector is invalid too)
                    lost = drain_spec(body, selector={}) if invalid is None else None  # its sidecars' port
                    continue
                parsed = drain_spec(body)  # its selector still says which workers hold its adapters
                if parsed is None:  # its selector is invalid: it owns no pod, and empties those it pushed to
                    parsed, blind = drain_spec(body, selector={}), True
            if deleting:
                draining = parsed
            else:
                pool = parsed
        specs = [parse_adapter(body) for body in adapters]  # an unparsable one is still unloaded by name
        # An invalid pool leaves its workers alone; a deleting one (its spec invalid too) empties those no live
        # pool took over; a valid or deleting one empties the pods it pushed to and released (all of them, for
        # a deleting one whose selector is invalid: which pods it selected is unknown).
        target = pool or draining
        claims = pool_claims(other_pools, replicasets)
        own, shared = ([], {}) if blind else own_pods(key[1], target.worker_selector if target else None, pods,
                                                      claims, draining=draining is not None)
        record = self.push_records.setdefault(key, PushRecord())
        record.merge_status(_status_of(pools))  # pods another operator (or leader) pushed to
        # Nothing names a pod it pushed to (no status.pushedPods, and a restart since), nor did at an earlier pass of
        # its deletion (the pods named then were emptied, or are gone): its workers are unknown.
        last = self._results.get(key)
        workers_unknown = blind and len(record) == 0 and (last is None or last.plan.draining is None
                                                           or last.plan.workers_unknown)
        # Pods it pushed to that it may no longer reach (made by another Deployment than its workerDeployment
        # names now, or by none where it named none before): emptied as pods it released, known by their (name,
        # uid) in its record, so that only the pods that had the stager token are sent it again. Else they would
        # keep what it pushed, and its adapters' finalizers would not wait for them.
        pushed = record.pod_ids()
        former = [p for p in former if pod_id(p) in pushed]
        released = released_pods(key[1], pushed, pods + former, set(pod_names(own)), claims) if target else []
        # Pods gone (or re-created under their name) lose what was pushed to them; an invalid pool, which releases
        # none, keeps those it may no longer reach for when it is fixed.
        record.retain(own + released + (former if target is None else []))
        refusals = self._refusals.setdefault(key, {})
        for worker, desired, outcome in self.flights.settle(key):  # answered after the pass that pushed had ended
            _note_answer(record, refusals, worker, desired, outcome)
        workers = discover_workers(own, target.worker_selector, default_port=target.stager_port) if target else []
        # Released pods no longer match the selector: {} (Kubernetes' empty selector) matches every pod.
        emptied = discover_workers(released, {}, default_port=target.stager_port) if target else []
        # Reached to unload adapters being deleted (a deleting pool empties its pods), and, for an invalid pool,
        # to read what its pods still serve (its adapters' status says so; they are told nothing else).
        # A valid pool's running pods that are not ready: those whose sidecar awaits its first push (a new pod, its
        # model loading; reconcile.py) are told the pool's set; the others may still serve what they hold.
        lagging = discover_workers(own, pool.worker_selector, default_port=pool.stager_port,
                                   not_ready=True) if pool is not None else []
        held: list[Worker] = []
        unloading = draining is None and (any(s.deleting for s in specs) or (pool is None and pool_error is not None))
        if unloading and pool is None and invalid is not None:
            mine = own_pods(key[1], invalid.worker_selector, pods, claims)[0]
            held = discover_workers(mine, invalid.worker_selector, default_port=invalid.stager_port, not_ready=None)
        elif unloading and pool is None and lost is not None:  # its selector is invalid too: the pods it pushed to
            # that no other pool selects
            mine = [p for p in pods + former if pod_id(p) in pushed and first_claim(p, claims) is None]
            held = discover_workers(mine, {}, default_port=lost.stager_port, not_ready=None)
        asked = workers + emptied + held  # read at once, and the pods not ready with a shorter timeout: they are many
        reads = await asyncio.gather(self.client.fetch_states(asked), self.client.fetch_states(lagging, quick=True))
        fetched = dict(zip(asked + lagging, reads[0] + reads[1], strict=True))  # on a node that is down, say
        starting = [w for w in lagging if (r := fetched[w]) is not None and r.awaiting_push]
        if unloading and pool is not None:  # not ready: it may still serve what it holds, and will once ready
            held = [w for w in lagging if w not in starting]
        reached = workers + emptied + held + starting
        reports = [fetched[w] for w in reached]
        self._sizes[key].note(reports)
        specs = self._sizes[key].apply(specs)
        backoff, now = self._backoff[key], self.clock()
        answers = self._answers.setdefault(key, {})
        answers.update({(w.pod, w.uid): (now, r) for w, r in zip(reached, reports, strict=True) if r is not None})
        for unreached in set(answers) - {(w.pod, w.uid) for w in reached}:
            del answers[unreached]
        views = [WorkerReport(w.pod, r, record.last(w), may_retry=backoff.may_retry(w.url, now),
                              last_answer=self._recent(answers.get((w.pod, w.uid)), now) if r is None else None)
                 for w, r in zip(reached, reports, strict=True)]
        num_emptied, num_held = len(workers) + len(emptied), len(workers) + len(emptied) + len(held)
        views, released_views, held_views, starting_views = (views[:len(workers)], views[len(workers):num_emptied],
                                                             views[num_emptied:num_held], views[num_held:])
        stamp = utc_now()
        plan = reconcile_pool(pool, specs, views, now=stamp, generation_floor=time.time_ns() // 1_000_000,
                              pool_error=pool_error, shared_pods=shared, released=released_views, held=held_views,
                              starting=starting_views)
        # Told its set once it can be (by this valid pool, or this deleting one, whose finalizer waits for it),
        # a pod that cannot be told now holds up an adapter's finalizer for the grace only.
        plan.overdue = self._overdue(key, reached, plan, told_later=reached if target else [], now=now)
        by_pod = {w.pod: w for w in reached}
        held_pods = {w.pod for w in held}
        for pod, desired in plan.pushes.items():
            if pod in held_pods:
                # What it last accepted less the deleting adapters: what it is to hold whether or not this push
                # lands (one that did not reports a lower generation and is told again). Forgotten, its set would
                # be unknown and the deleted adapter left on it until the pool's spec is fixed.
                record.record(by_pod[pod], desired)
            else:  # unknown until answered: a pass cut short (cancelled) must not keep the old record
                record.forget(by_pod[pod])
        # Answered within the wait (a pod with a push in flight gets this one once that one is answered): else it
        # stays unknown (forgotten above), its answer kept for the next pass.
        in_flight = set(self.flights.in_flight(key))  # a push to these is queued, and dropped if theirs is the same
        answers = await self.flights.push(key, {pod: (by_pod[pod], d) for pod, d in plan.pushes.items()}, cut=cut)
        for worker, desired, outcome in answers.values():
            _note_answer(record, refusals, worker, desired, outcome)
        for pod in set(refusals) - {w.pod for w in workers + starting}:
            del refusals[pod]
        if pool is not None:  # pushed again every pass until accepted: Ready says why meanwhile
            plan.pool_status = with_refused_pushes(plan.pool_status, pool.status, refusals, now=stamp)
        for w, view in zip(emptied, released_views, strict=True):
            last = record.last(w)
            if view.reported is not None and not view.reported.adapters and (last is None or not last.adapters):
                record.drop(w)  # holds nothing (told so, or found so): released for good
        backoff.retain({w.url for w in workers})
        for w, view in zip(workers, views, strict=True):
            if w.pod in plan.failing:
                backoff.failing(w.url, now, pushed=w.pod in plan.pushes and w.pod not in in_flight)
            elif view.reported is not None:
                backoff.clear(w.url)
        if draining is not None:
            # Pods it gave adapters to that are not ready cannot be told now; once the pool is gone no pass would
            # reach them when they are ready again, so its finalizer waits for them too (or for their deletion).
            reached_pods = {w.pod for w in workers + emptied}
            plan.not_ready = sorted(m.get("name", "") for m in (p.get("metadata") or {} for p in own + released)
                                    if m.get("name", "") not in reached_pods
                                    and record.may_hold(m.get("name", ""), m.get("uid") or ""))
            plan.draining = (plan.draining or []) + plan.not_ready
            plan.workers_unknown = workers_unknown
        if pool is not None:  # written with the status, read back after a restart
            plan.pool_status["pushedPods"] = record.to_status()
            # Not answered yet (in the background: what they hold is not known meanwhile), said as it is now.
            plan.pool_status["pushing"] = self.flights.in_flight(key)
        if target is None:  # no pool to push for (gone, or invalid): nothing to retry
            self._backoff.pop(key, None)
            if pool_error is None:  # gone: nothing to remember; an invalid pool pushes nothing meanwhile, and
                self.push_records.pop(key, None)  # keeps the pods it pushed to for when it is fixed
        return plan

    def _overdue(self, key: PoolKey, reached: list[Worker], plan: PoolPlan, *, told_later: list[Worker],
                 now: float) -> list[str]:
        """The pods of ``told_later`` that could not be told (``plan.silent``, ``plan.unreachable``) for
        ``unload_grace`` seconds or more: since the last pass that could tell them, else since the first that
        could not."""
        untold = set(plan.silent) | set(plan.unreachable)
        last = self._untold.get(key, {})
        # (pod, uid) -> the last time it could be told, as far as this memory goes (a pod not reached drops out)
        since = {(w.pod, w.uid): last.get((w.pod, w.uid), now) if w.pod in untold else now for w in reached}
        self._untold[key] = since
        return sorted(w.pod for w in told_later if now - since.get((w.pod, w.uid), now) >= self.unload_grace)

    def may_hold(self, key: PoolKey, name: str, pools: Iterable[dict[str, Any]]) -> bool:
        """Whether a pod pool ``key`` reaches may hold adapter ``name`` (``pools``: the pool's bodies), as far as
        this controller knows: the finalizer of a deleted adapter runs the passes of these pools only (and of
        its own pool). Yes while that is not known: no pass of the pool here yet, a pass in flight, the pool
        being deleted, a pod its status.pushedPods names that its push record lacks (another leader pushed to
        it); and when its last pass saw a pod report the adapter, or a pod's last push listed it or is not
        known (not answered; pushed to before a restart). A pod comes to hold an adapter only by a push, which
        its pool's record notes before it is sent, or by a pool taking over a pod another pool filled, which
        that pool's record names."""
        pools = list(pools)
        last, record, lock = self._results.get(key), self.push_records.get(key), self._locks.get(key)
        if last is None or record is None or (lock is not None and lock.locked()):
            return True
        if any((body.get("metadata") or {}).get("deletionTimestamp") for body in pools):
            return True
        if name in last.plan.reported or record.may_hold_adapter(name):
            return True
        known = record.pod_ids()
        return any(pod_id not in known for pod_id in pushed_pod_ids(_status_of(pools)))

    def _recent(self, answer: tuple[float, ReportedState] | None, now: float) -> ReportedState | None:
        """A silent pod's last answer while it is younger than the quiet grace."""
        return answer[1] if answer is not None and now - answer[0] < self.quiet_grace else None

    def last_plan(self, key: PoolKey) -> PoolPlan | None:
        """The pool's last pass's plan (the workers its pinned adapters need, where its copies are); None: none."""
        last = self._results.get(key)
        return None if last is None else last.plan

    def forget(self, key: PoolKey) -> None:
        self.flights.forget(key)
        self._results.pop(key, None)
        self._answers.pop(key, None)
        self._refusals.pop(key, None)
        self._sizes.pop(key, None)
        self._untold.pop(key, None)
        self._backoff.pop(key, None)
        self.push_records.pop(key, None)

    def retain(self, keys: set[PoolKey]) -> None:
        """Keep the memory of these pools only (the live ones): a pool deleted while this replica stood by
        leaves nothing behind."""
        for key in self.known_pools():
            if key in keys:
                continue
            self.forget(key)
            # A pass in flight keeps its lock, and so does a call waiting for it: a lock released, its waiter not
            # woken yet, reads as unlocked, and a new one would let a third call run beside that waiter's pass.
            if key in self._locks and not self._callers.get(key):
                del self._locks[key]

    def known_pools(self) -> list[PoolKey]:
        """The pools this controller holds memory for."""
        return sorted(set(self._results) | set(self._backoff) | set(self.push_records) | set(self._locks)
                      | set(self._untold))


def _note_answer(record: PushRecord, refusals: dict[str, str], worker: Worker, desired: DesiredState,
                 outcome: Outcome) -> None:
    """A pod's answer to the push of ``desired``. Why a pod refused its set (not a stale generation) is kept until
    one is accepted or read (a 409), or the pod leaves, so a pass that could not tell it (no answer) does not flip
    Ready back meanwhile."""
    if not record.knows(worker):  # a pod gone since, or re-created under its name: its answer is nobody's now
        return
    if isinstance(outcome, Refused) and not outcome.stale:
        refusals[worker.pod] = f"HTTP {outcome.status}: {outcome.reason}"
    elif outcome is not None:
        refusals.pop(worker.pod, None)
    # Else refused, or no answer (it may have landed): it stays forgotten, pushed again.
    if outcome:
        record.record(worker, desired)
        log.info("pushed generation %d (%d adapters) to %s", desired.generation, len(desired.adapters), worker.pod)


def _status_of(pools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The status of the pool's object (live or deleting), if any."""
    return next((body.get("status") for body in pools if body.get("status")), None)
