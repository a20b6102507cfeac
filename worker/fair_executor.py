"""FairExecutor: the adapter loader threads, shared between tenants by turns.

A thread pool takes its jobs first come, first served: a tenant that asks for fifty cold adapters at once
(a batch job, a warm-up) would keep every loader thread busy, and a request of another tenant for one cold
adapter would wait behind all fifty. Here each job belongs to a group (the tenant whose request asked for it;
a warm-up's: its adapter's owner) and waits in that group's queue; a free thread takes the next job of the
group served longest ago (or never), so
another tenant's load waits for at most one job per group ahead of it. Loads a request waits for (urgent) go before warm-ups
(`promote` moves a queued warm-up ahead once a request asks for it), but every `BACKGROUND_EVERY`th
job started is a warm-up when one waits: a steady stream of cold loads for requests never keeps a pinned or
warm version off the GPU for good.

Turns alone do not help a tenant whose load waits while every thread runs another tenant's slow reads (a
stalled mount, a huge file): it would wait for one of them to end. So a load a request waits for, of a
group with no job running, starts at once on one of `spare_threads` more threads when the others are all busy:
one tenant's slow reads never hold another tenant's request, up to `spare_threads` tenants at a time. Jobs on
spares count apart: the threads' turns (the warm-ups' share, a busy group's next job) go on as without them.

Jobs run on `num_threads` (+ the spares) daemon threads, never more at once (`_DaemonThreads`: a read hung on
a dead mount holds neither `shutdown` nor the interpreter's exit, as ThreadPoolExecutor's threads, joined at
exit, would: the worker stops on SIGTERM whatever its loads do); a queued job's Future may be
cancelled (it is skipped); `shutdown` cancels every job still queued. A thread's `initializer` runs before
its first job: if it raises, that job fails with its error (ThreadPoolExecutor would break the whole pool).
A job's Future is completed, or cancelled, outside this executor's lock, on a loader thread or the caller's:
its callbacks may take other locks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

_Queues = dict[str, deque[list]]  # group -> its jobs, each [Future, fn] (fn None: cancelled while queued)
BACKGROUND_EVERY = 4  # with both lanes queued, one job in this many goes to a warm-up
_MAX_REMEMBERED = 4096  # groups whose last turn is remembered (the oldest are forgotten: they go first anyway)


class _DaemonThreads:
    """Up to `size` daemon threads, started as jobs come, that run the jobs handed to `submit` in turn."""

    def __init__(self, size: int, name: str) -> None:
        self._size, self._name = size, name or "loader"
        self._jobs: SimpleQueue = SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a job
        self._queued = 0  # jobs not taken yet
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader threads are shut down")
            self._jobs.put((fn, args))
            self._queued += 1
            if self._queued > self._idle and len(self._threads) < self._size:  # no thread free to take it
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._queued -= job is not None
            if job is None:
                return
            fn, args = job
            fn(*args)
            del job, fn, args  # an idle thread holds nothing of its last job (its Future's result: an image)

    def shutdown(self, wait: bool) -> None:
        with self._lock:
            self._closed, threads = True, list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for thread in threads:
                thread.join()


class FairExecutor:
    def __init__(self, num_threads: int, *, spare_threads: int = 0, thread_name_prefix: str = "",
                 initializer: Callable[..., object] | None = None, initargs: tuple = ()) -> None:
        self._pool = _DaemonThreads(num_threads + spare_threads, thread_name_prefix)
        self._init = (initializer, initargs)
        self._ready = threading.local()  # whether this thread's initializer ran
        self._num_threads = num_threads
        self._spare_threads = spare_threads
        self._lock = threading.Lock()
        self._urgent: _Queues = {}  # group -> its jobs a request waits for
        self._background: _Queues = {}  # group -> its other jobs (warm-ups, prefetches)
        self._queued_background: dict[Future, str] = {}  # a background job's Future -> its group
        self._queued: dict[Future, list] = {}  # every queued job's Future -> its [Future, fn] entry
        self._turns = 0  # jobs started
        self._last_turn: dict[str, int] = {}  # group -> the number of its last job started
        self._running = 0
        self._running_by_group: dict[str, int] = {}  # groups with jobs running -> how many
        self._on_spares = 0  # of the jobs running, those started on a spare thread
        self._closed = False

    def submit(self, group: str, fn: Callable[[], Any], *, urgent: bool = True) -> Future:
        """Queue `fn` for `group`; its Future is done when it has run (or is cancelled while queued)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit a load after shutdown")
            job = [future, fn]
            (self._urgent if urgent else self._background).setdefault(group, deque()).append(job)
            self._queued[future] = job
            if not urgent:
                self._queued_background[future] = group
            refused = self._dispatch()
        _fail(refused)
        future.add_done_callback(self._forget_cancelled)
        return future

    def _forget_cancelled(self, future: Future) -> None:
        """A job cancelled while queued lets go of its function now, with what it holds (a request's body), not
        when its turn would have come; its entry stays in its queue, skipped then (no scan of the queue: thousands
        of warm-ups cancelled at once cost that many steps, not their square)."""
        if future.cancelled():
            with self._lock:
                self._queued_background.pop(future, None)
                job = self._queued.pop(future, None)
                if job is not None:
                    job[1] = None

    def promote(self, future: Future) -> None:
        """A request now waits for the queued job of `future`: it goes before every warm-up (its group's
        turn among the urgent ones). Nothing for a job already running, done, or urgent."""
        with self._lock:
            group = self._queued_background.pop(future, None)  # asked every step while a load waits: O(1) then
            if group is None:
                return
            queue = self._background[group]
            job = next(job for job in queue if job[0] is future)
            queue.remove(job)
            if not queue:
                del self._background[group]
            self._urgent.setdefault(group, deque()).append(job)

    def queued(self) -> int:
        with self._lock:
            return len(self._queued)

    def _dispatch(self) -> list[tuple[Future, BaseException]]:
        """Start queued jobs while a thread is free (the lock held): the urgent lane's first, each time of
        the group whose last job started longest ago (a group never served, or forgotten, first). Returns the
        jobs the thread pool refused (the interpreter exiting), to fail once the lock is released."""
        refused: list[tuple[Future, BaseException]] = []
        while True:
            # The threads by turns first (warm-ups' share and a busy group's next job included), as if there
            # were no spares; those count apart, so jobs on spares never hold the turns back.
            spare = self._running - self._on_spares >= self._num_threads
            if not spare:
                lane = self._urgent or self._background
                if self._urgent and self._background and self._turns % BACKGROUND_EVERY == BACKGROUND_EVERY - 1:
                    lane = self._background
                groups = lane.keys()
            elif self._on_spares < self._spare_threads:  # a spare thread: see the module doc
                lane = self._urgent
                groups = [g for g in lane if g not in self._running_by_group]
            else:
                return refused
            if not groups:
                return refused
            group = min(groups, key=lambda g: self._last_turn.get(g, -1))
            queue = lane[group]
            future, fn = queue.popleft()
            self._queued.pop(future, None)
            if not queue:
                del lane[group]
            self._queued_background.pop(future, None)
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            self._turns += 1
            self._last_turn[group] = self._turns
            if len(self._last_turn) > _MAX_REMEMBERED:
                for old in sorted(self._last_turn, key=self._last_turn.__getitem__)[:_MAX_REMEMBERED // 2]:
                    del self._last_turn[old]
            try:
                self._pool.submit(self._run, group, spare, future, fn)
            except RuntimeError as exc:  # shut down (only after _closed)
                refused.append((future, exc))
                continue
            self._running += 1
            self._on_spares += spare
            self._running_by_group[group] = self._running_by_group.get(group, 0) + 1

    def _run(self, group: str, spare: bool, future: Future, fn: Callable[[], Any]) -> None:
        try:
            initializer, initargs = self._init
            if initializer is not None and not getattr(self._ready, "done", False):
                initializer(*initargs)
                self._ready.done = True
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the Future, as ThreadPoolExecutor does
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            # An exception's traceback holds this frame: without these, the Future (holding the exception) and
            # the job's inputs (a request's body) would wait in a reference cycle for the garbage collector.
            future = fn = result = None  # noqa: F841
            with self._lock:
                self._running -= 1
                self._on_spares -= spare
                if self._running_by_group[group] == 1:
                    del self._running_by_group[group]
                else:
                    self._running_by_group[group] -= 1
                refused = [] if self._closed else self._dispatch()
            _fail(refused)

    def shutdown(self, wait: bool = True) -> None:
        """Cancel the jobs still queued and stop; `wait`: until the running ones have returned."""
        with self._lock:
            self._closed = True
            queued = [future for lane in (self._urgent, self._background) for q in lane.values() for future, _ in q]
            self._urgent, self._background, self._queued_background, self._queued = {}, {}, {}, {}
        for future in queued:  # outside the lock: their callbacks may take others
            future.cancel()
        self._pool.shutdown(wait=wait)


def _fail(refused: list[tuple[Future, BaseException]]) -> None:
    for future, exc in refused:
        future.set_exception(exc)
