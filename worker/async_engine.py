"""AsyncEngine: the Engine driven by one background thread, consumed from asyncio.

    async_engine = AsyncEngine(engine)
    await async_engine.start()
    async for out in async_engine.generate("req-1", prompt, params, adapter="sql"):
        ...                      # one RequestOutput per step that produced tokens; the last is finished
    await async_engine.stop()

Only the engine thread touches the scheduler: requests and aborts travel through a thread-safe queue
and are applied between steps; outputs travel back with `call_soon_threadsafe`. Leaving the `async
for` early (client gone, task cancelled) aborts the request, which frees its KV pages and adapter
reference at the next step boundary. A JSON-mode request first waits, in its caller's event loop, for JSON
mode's table of the vocabulary (json_guide.py), built once in a worker thread: the engine thread never
builds it, so the other requests keep decoding meanwhile. Should the thread die of a bug outside a step (a failed step
only fails its requests), or after `max_failed_forwards` failed forwards in a row (a broken device:
worker/forward_failures.py), `failure` says why and every stream in flight ends with an error at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from lorafleet.worker.engine import Engine, EngineError, Prompt
from lorafleet.worker.fair_executor import FairExecutor
from lorafleet.worker.request_output import RequestOutput
from lorafleet.worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.005  # nothing runnable but requests wait (e.g. on an adapter load): poll again soon
_IDLE_CHECK_S = 0.1  # no request at all: look for adapter loads started by other threads this often


class AsyncEngine:
    def __init__(self, engine: Engine, *, on_step: Callable[[Engine], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called in the engine thread after every step that ran a batch
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams
        self._preparer: FairExecutor | None = None  # grammars prepared one at a time, tenants by turns (_prepare)
        self.num_steps = 0
        self.failure: BaseException | None = None  # what ended the engine thread, if not stop()

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._preparer = FairExecutor(1, thread_name_prefix="grammar-prepare")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the loop; requests still running end with an error."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._lock:  # no request or call is handed over after this without being refused
            self._stop.set()
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        if self._preparer is not None:
            self._preparer.shutdown(wait=False)  # a prepare still queued: its request ends with "the engine stopped"
        with self._lock:
            streams, self._streams = self._streams, {}
        self._fail_streams(streams, RuntimeError("the engine stopped"))  # and what was handed over after the thread's last look
        self.engine.close()

    def _fail_streams(self, streams: dict, error: BaseException) -> None:
        """Refuse the commands still queued, abort these streams' requests and end each stream with `error`."""
        self._refuse_commands(error)
        for rid, (loop, q) in streams.items():
            self._abort_quietly(rid)
            _post(loop, q.put_nowait, error)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    # ---- requests -----------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as steps produce them. Raises EngineError (bad request), JsonModeError
        (JSON mode unavailable) or a GrammarError / RegexError (its grammar's first mask past its bounds) before
        the first output; the request's failure (AdapterLoadError,
        CapacityError); RuntimeError if the engine stops or fails. `tenant`: whose request it is, for the
        scheduler's fairness across tenants (None: its adapter's name stands for it)."""
        if self.failure is not None:
            raise RuntimeError(f"the engine thread died: {self.failure!r}")
        if not self.is_running:
            raise RuntimeError("the engine is not running (call start() first)")
        if params is not None and params.json_object:
            await self._json_vocab_ready()  # raises JsonModeError when the table cannot be built
            await self._prepare(params, tenant if tenant is not None else adapter or "")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the engine stopped")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = (loop, q)
            self._commands.put(("add", request_id, prompt, params, adapter, tenant, added))
        self._wake.set()
        finished = False
        try:
            await asyncio.wrap_future(added)  # raises the engine's validation error, if any
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.finish_reason == "error":  # e.g. AdapterLoadError: the caller maps it to a status
                    raise item.exception or RuntimeError(item.error)
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _json_vocab_ready(self) -> None:
        guide = self.engine.sampler.json_guide  # None without a tokenizer: the engine refuses JSON mode then
        if guide is not None and not guide.is_ready:
            await asyncio.wrap_future(guide.prepare())

    async def _prepare(self, params: SamplingParams, tenant: str) -> None:
        """`_prepare_now(params)` on the one prepare thread, in `tenant`'s turn: each holds the interpreter lock the
        engine's steps need too, so they run one at a time, and a tenant's many costly grammars (a first mask may
        take seconds) delay another tenant's guided request by at most one prepare of each tenant ahead of it,
        not by all of them. A request that leaves while its prepare is queued is not prepared."""
        preparer = self._preparer
        try:
            job = preparer.submit(tenant, lambda: self._prepare_now(params))
        except (AttributeError, RuntimeError):  # stopped (shut down, or never started) since generate() looked
            raise RuntimeError("the engine stopped") from None
        try:
            await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.cancelled() and self._stop.is_set() and not (task is not None and task.cancelling()):
                raise RuntimeError("the engine stopped") from None  # cancelled by stop(), not by its caller
            raise
        finally:
            job = None  # its error's traceback holds this frame: no reference cycle through it

    def _prepare_now(self, params: SamplingParams) -> None:
        """Before the request joins the batch: a grammar of fixed texts (guided_choice) that this vocabulary cannot
        write is a bad request now, not a failure midway (a vocabulary with a token for every byte writes
        anything; 64 KB of choices: 0.3 s on a 49k vocabulary); a grammar's pattern tries and first mask are
        built here, not in the engine's step (past a mask's bounds: its GrammarError)."""
        check = getattr(params.grammar, "unspellable", None)
        guide = self.engine.sampler.json_guide
        if guide is not None and params.grammar is not None:
            guide.vocab.prepare(params.grammar, params.min_tokens <= 1)
        if check is not None and guide is not None:
            choice = check(*guide.vocab.spellings)
            if choice is not None:
                raise EngineError(f"this model's vocabulary cannot write the choice {choice!r} (no sequence of its "
                                  "tokens spells it)")

    def abort(self, request_id: str) -> None:
        """Abort from any thread; applied before the next step."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run `fn(engine)` in the engine thread between steps (e.g. to change adapters)."""
        done: Future = Future()
        with self._lock:
            if self._stop.is_set():
                done.set_exception(RuntimeError("the engine is not running: it stopped"))
                return done
            self._commands.put(("call", fn, done))
        self._wake.set()
        return done

    # ---- state for metrics --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    @property
    def last_batch_size(self) -> int:
        return self.engine.last_batch_size

    @property
    def last_batch_adapters(self) -> int:
        return self.engine.last_batch_adapters

    def adapters_in_use(self) -> tuple[list[str], list[str]]:
        """(adapter names of running requests, of waiting ones), for vllm:lora_requests_info."""
        sched = self.engine.scheduler
        running = sorted({s.adapter.split("@")[0] for s in list(sched.running) if s.adapter})
        waiting = sorted({s.adapter.split("@")[0] for s in list(sched.waiting) if s.adapter})
        return running, waiting

    # ---- the engine thread --------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, rid, prompt, params, adapter, tenant, added = cmd
                with self._lock:
                    wanted = rid in self._streams  # the caller may have gone before we got here
                # Running, the future can no longer be cancelled by a caller leaving meanwhile (setting
                # the result of a cancelled one would raise here and end this thread).
                if not wanted or not added.set_running_or_notify_cancel():
                    added.cancel()
                    continue
                try:
                    self.engine.add_request(rid, prompt, params, adapter=adapter, tenant=tenant)
                except Exception as exc:
                    added.set_exception(exc)
                else:
                    added.set_result(rid)
            elif kind == "abort":
                self._abort_quietly(cmd[1])  # one request's broken abort must not end the thread
            elif kind == "call":
                _, fn, done = cmd
                if not done.set_running_or_notify_cancel():  # the caller gave up on it
                    continue
                try:
                    done.set_result(fn(self.engine))
                except Exception as exc:
                    done.set_exception(exc)

    def _refuse_commands(self, exc: Exception) -> None:
        """After the thread ended: end what it never took (a caller would wait forever for it)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "abort":
                self._abort_quietly(cmd[1])
                continue
            done = cmd[-1]
            if done.set_running_or_notify_cancel():
                done.set_exception(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            _post(loop, _put_all, items)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug outside a step: nothing would ever answer the streams again
            log.critical("the engine thread died; failing every request in flight", exc_info=exc)
            self.failure = exc
            with self._lock:  # as stop(): no request or call is handed over after this
                self._stop.set()
                streams, self._streams = self._streams, {}
            self._fail_streams(streams, RuntimeError(f"the engine thread died: {exc!r}"))

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._apply_commands()
            if not engine.has_unfinished():
                # No request, but warm-ups or prefetches (pushed from other threads) may be moving
                # adapters towards the GPU: keep them going, or an idle worker would never make a
                # `warm` adapter resident.
                pool = engine.adapter_pool
                if pool.has_pending_loads():
                    pool.poll()
                    # Adapters that wait only for room (a pinned owner's quota, every slot pinned) are looked at
                    # every _IDLE_CHECK_S, not every 5 ms for as long as they wait: room comes back with an unpin
                    # or an eviction, not with time.
                    self._wake.wait(_IDLE_WAIT_S if pool.loads_in_flight() else _IDLE_CHECK_S)
                else:
                    self._wake.wait(_IDLE_CHECK_S)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug must not hang every client: fail what is in flight
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(exc)
                continue
            self.num_steps += 1
            if engine.last_batch_size and self.on_step is not None:
                try:
                    self.on_step(engine)
                except Exception:
                    log.exception("on_step callback failed")
            if outputs:
                self._deliver(outputs)
            outputs = None  # not kept alive while idle: the last step's logprobs and texts are a user's content
            engine.forward_failures.check()  # forwards failing in a row end the thread as a bug would
            if not engine.last_batch_size:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams = dict(self._streams)
        for rid, (loop, q) in streams.items():
            self._abort_quietly(rid)
            _post(loop, q.put_nowait, RuntimeError(f"engine step failed: {exc}"))
        for rid in list(self.engine.requests):
            self._abort_quietly(rid)

    def _abort_quietly(self, rid: str) -> None:
        """Abort after a failed step: the step may have left a request half-moved (in neither queue), and
        an abort that fails too must not end this thread, which every other stream needs."""
        seq = self.engine.requests.get(rid)  # Engine.abort drops it before it finishes it
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("aborting %s after a failed step failed; dropping it", rid)
            self.engine.requests.pop(rid, None)
            self.engine.outputs.forget(rid)
            if seq is None:
                return
            with contextlib.suppress(Exception):  # no KV pages left behind
                self.engine.scheduler.block_manager.free(seq)
            pool = self.engine.adapter_pool
            if seq.adapter is not None:  # no reference or hold on its version left behind
                with contextlib.suppress(Exception):
                    if seq.adapter_slot is not None:
                        pool.release(seq.adapter_slot, tenant=seq.tenant)
                    pool.abandon(seq.adapter, seq.seq_id)


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Hand `fn(*args)` to a client's event loop; one closed meanwhile (its client is gone) drops it
    instead of raising in the engine thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        log.debug("a stream's event loop closed before its output arrived; dropped")


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
