"""AsyncEngine: streams from a background engine thread, cancel = abort, errors reach the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.async_engine import AsyncEngine
from lorafleet.worker.engine import EngineError

PROMPTS = [[5, 6, 7], list(range(20, 41)), [9] * 7, [100, 3]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def async_engine(tiny_llama_dir):
    steps = []
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4))
    ae = AsyncEngine(engine, on_step=lambda e: steps.append(e.last_batch_size))
    ae.steps = steps
    await ae.start()
    try:
        yield ae
    finally:
        await ae.stop()


async def _collect(ae, rid, prompt, params=GREEDY, adapter=None):
    outs = [out async for out in ae.generate(rid, prompt, params, adapter)]
    return outs


async def test_concurrent_streams_match_offline(async_engine, tiny_llama_dir):
    results = await asyncio.gather(*(_collect(async_engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
    offline = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4)).generate(PROMPTS, GREEDY)
    for outs, ref in zip(results, offline, strict=True):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == ref.token_ids
    assert async_engine.steps and all(n >= 1 for n in async_engine.steps)  # on_step saw every batch
    await asyncio.wrap_future(async_engine.call(lambda e: e.page_pool.check()))
    assert async_engine.kv_usage == 0.0


async def test_leaving_the_stream_aborts_and_frees_pages(async_engine):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = async_engine.generate("long", PROMPTS[1], long)
    seen = 0
    async for out in stream:
        seen += len(out.new_token_ids)
        if seen >= 2:
            break
    await stream.aclose()
    # Commands run in order in the engine thread: once this call returns, the abort was applied.
    state = await asyncio.wrap_future(async_engine.call(
        lambda e: (dict(e.requests), e.page_pool.num_used("kv"), e.has_unfinished())))
    assert state == ({}, 0, False)


async def test_cancelled_task_aborts(async_engine):
    started = asyncio.Event()

    async def consume():
        async for _ in async_engine.generate("c", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    assert started.is_set(), task.exception()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    state = await asyncio.wrap_future(async_engine.call(lambda e: (len(e.requests), e.page_pool.num_used("kv"))))
    assert state == (0, 0)


async def test_bad_request_raises_in_the_caller(async_engine):
    with pytest.raises(EngineError, match="not registered"):
        await _collect(async_engine, "bad", [1, 2], GREEDY, adapter="missing")
    with pytest.raises(EngineError, match="vocabulary"):
        await _collect(async_engine, "bad2", [10**6])
    # The loop is still healthy.
    outs = await _collect(async_engine, "ok", PROMPTS[3])
    assert outs[-1].finished


async def test_stop_ends_streams_in_flight(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4))
    ae = AsyncEngine(engine)
    await ae.start()
    stream = ae.generate("x", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    await stream.__anext__()
    await ae.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        async for _ in stream:
            pass
    assert not ae.is_running and engine.page_pool.num_used("kv") == 0


async def test_adapter_load_failure_is_raised_to_its_stream_only(async_engine):
    from lorafleet.worker.adapter_entry import AdapterLoadError

    def broken_loader():
        raise OSError("disk read failed")

    await asyncio.wrap_future(async_engine.call(lambda e: e.adapter_pool.add("broken@1", loader=broken_loader)))
    bad = asyncio.create_task(_collect(async_engine, "bad", PROMPTS[0], GREEDY, adapter="broken"))
    good = asyncio.create_task(_collect(async_engine, "good", PROMPTS[2]))
    with pytest.raises(AdapterLoadError, match="disk read failed"):
        await bad
    assert (await good)[-1].finish_reason == "length"
    state = await asyncio.wrap_future(async_engine.call(lambda e: (len(e.requests), e.page_pool.num_used("kv"))))
    assert state == (0, 0)


async def test_idle_engine_makes_a_prefetched_adapter_resident(async_engine, tiny_llama_dir, tmp_path):
    """A warm-up pushed from another thread (the admin API's executor) reaches the GPU tier with no
    request in flight: an idle engine thread still moves adapter loads on."""
    from tests.lora_factory import make_peft_adapter

    path = make_peft_adapter(tiny_llama_dir, tmp_path / "warm", rank=4, seed=1)
    key = await asyncio.wrap_future(async_engine.call(lambda e: e.register_adapter("warm", path)))
    await asyncio.sleep(0)  # let the engine thread go idle before the push
    await asyncio.to_thread(async_engine.engine.adapter_pool.prefetch, key, "gpu")

    def tier():
        return {d["key"]: d["tier"] for d in async_engine.engine.adapter_pool.describe()}[key]

    for _ in range(500):  # readiness poll, bounded (5 s)
        if tier() == "gpu":
            break
        await asyncio.sleep(0.01)
    assert tier() == "gpu"
    assert not async_engine.engine.has_unfinished()


async def test_a_failed_forward_fails_only_its_requests(tiny_llama_dir):
    """One sequence at a time: "bad" runs, "good" waits. A forward of "bad" raises (a kernel fault):
    "bad" gets that error, "good" (in no failed forward) is served in full, and so is a later request."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4, max_num_seqs=1))
    run = engine.runner.run
    fault = RuntimeError("kernel fault")

    def faulty_run(batch):
        if any(s.request_id == "bad" and s.output_token_ids for s, _ in batch.scheduled):
            raise fault
        return run(batch)

    engine.runner.run = faulty_run
    ae = AsyncEngine(engine)
    await ae.start()
    try:
        bad = asyncio.create_task(_collect(ae, "bad", PROMPTS[0]))
        good = asyncio.create_task(_collect(ae, "good", PROMPTS[2]))
        with pytest.raises(RuntimeError, match="kernel fault"):
            await bad
        assert (await good)[-1].finish_reason == "length"
        assert (await _collect(ae, "later", PROMPTS[3]))[-1].finish_reason == "length"
        state = await asyncio.wrap_future(ae.call(lambda e: (len(e.requests), e.page_pool.num_used("kv"))))
        assert state == (0, 0)
    finally:
        await ae.stop()


async def test_a_client_leaving_while_its_request_is_added_does_not_stop_the_engine(async_engine):
    """The caller goes away while the engine thread is adding its request: the request is aborted and
    the engine thread goes on serving (setting the result of the cancelled future must not end it)."""
    engine = async_engine.engine
    adding, proceed = threading.Event(), threading.Event()
    add_request = engine.add_request

    def slow_add_request(*args, **kwargs):
        adding.set()
        proceed.wait(10)
        return add_request(*args, **kwargs)

    engine.add_request = slow_add_request
    task = asyncio.create_task(_collect(async_engine, "gone", PROMPTS[0], SamplingParams(max_tokens=200)))
    assert await asyncio.to_thread(adding.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    engine.add_request = add_request
    proceed.set()
    state = await asyncio.wait_for(asyncio.wrap_future(async_engine.call(
        lambda e: (dict(e.requests), e.page_pool.num_used("kv")))), timeout=10)
    assert state == ({}, 0) and async_engine.is_running
    assert (await _collect(async_engine, "next", PROMPTS[3]))[-1].finished


async def test_a_client_whose_event_loop_closed_does_not_stop_the_engine(async_engine):
    """A stream opened from an event loop that then closes (its client gone without leaving the stream):
    handing that stream its next output must not end the engine thread, which every other stream needs."""
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    def client_in_its_own_loop() -> None:
        loop = asyncio.new_event_loop()

        async def first_output():
            stream = async_engine.generate("gone", PROMPTS[1], long)
            await stream.__anext__()
            return stream  # left open

        loop.run_until_complete(first_output())
        loop.close()

    await asyncio.get_running_loop().run_in_executor(None, client_in_its_own_loop)
    outs = await asyncio.wait_for(_collect(async_engine, "ok", PROMPTS[0]), timeout=60)
    assert outs[-1].finished and async_engine.is_running


async def test_stop_ends_a_request_whose_add_was_still_queued(tiny_llama_dir):
    """A request handed over just before stop() but not yet taken by the engine thread ends with an
    error, as the running ones do, instead of waiting forever for the engine to take it."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4))
    in_step, go_on = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        in_step.set()
        go_on.wait(10)  # the engine thread is inside a step while the next request is handed over
        return step()

    engine.step = held_step
    ae = AsyncEngine(engine)
    await ae.start()
    running = ae.generate("running", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    first = asyncio.create_task(running.__anext__())
    assert await asyncio.to_thread(in_step.wait, 10)
    late = asyncio.create_task(_collect(ae, "late", PROMPTS[3]))
    await asyncio.sleep(0)  # `late` hands its request over, then waits for the engine thread to take it
    stopping = asyncio.create_task(ae.stop())
    await asyncio.sleep(0)  # stop() has asked the thread to end: it leaves after this step
    go_on.set()
    await stopping
    with pytest.raises(RuntimeError, match="stopped"):
        await asyncio.wait_for(late, timeout=30)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await running.aclose()
    assert engine.page_pool.num_used("kv") == 0


async def test_a_call_handed_over_after_stop_fails_instead_of_hanging(async_engine):
    await async_engine.stop()
    with pytest.raises(RuntimeError, match="not running"):
        await asyncio.wait_for(asyncio.wrap_future(async_engine.call(lambda e: e.num_running)), timeout=30)


async def test_an_abort_that_fails_does_not_end_the_engine_thread(async_engine):
    """A client leaves and aborting its request raises (a bug in the bookkeeping): the engine thread
    drops that request and goes on serving the other streams, instead of dying with them all hanging."""
    engine = async_engine.engine
    abort = engine.abort

    def broken_abort(request_id):
        if request_id == "gone":
            raise RuntimeError("broken abort")
        return abort(request_id)

    engine.abort = broken_abort
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    kept = async_engine.generate("kept", PROMPTS[0], long)
    await kept.__anext__()
    gone = async_engine.generate("gone", PROMPTS[1], long)
    await gone.__anext__()
    await gone.aclose()
    rest = await asyncio.wait_for(_collect_rest(kept), timeout=60)  # hung once the thread had died
    assert rest[-1].finish_reason == "length" and async_engine.is_running and async_engine.failure is None


async def test_a_dead_engine_thread_fails_the_streams_in_flight(tiny_llama_dir):
    """The engine thread dies of a bug outside a step: every stream in flight ends with an error at once
    (none waits forever), `failure` says why, and later requests are refused naming it."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4))
    ae = AsyncEngine(engine)
    await ae.start()
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = ae.generate("r", PROMPTS[0], long)
        await stream.__anext__()

        def broken(*_):
            raise RuntimeError("scheduler bug")

        engine.has_unfinished = broken
        with pytest.raises(RuntimeError, match="engine thread died.*scheduler bug"):
            await asyncio.wait_for(_collect_rest(stream), timeout=30)
        assert not ae.is_running and "scheduler bug" in repr(ae.failure)
        with pytest.raises(RuntimeError, match="engine thread died"):
            await _collect(ae, "later", PROMPTS[3])
        with pytest.raises(RuntimeError, match="not running"):
            await asyncio.wait_for(asyncio.wrap_future(ae.call(lambda e: e.num_running)), timeout=30)
    finally:
        await ae.stop()


async def _collect_rest(stream):
    return [out async for out in stream]


async def test_an_idle_engine_does_not_spin_on_an_adapter_that_waits_for_room(tiny_llama_dir, tmp_path):
    """A warm-up its owner's pinned adapter keeps out (the owner's GPU quota is one adapter) stays
    wanted: the idle engine thread looks at it every 0.1 s, as when nothing is pending (it polled every
    5 ms for as long as it waited), and places it once the pin is gone."""
    from lorafleet.worker.adapter_pool_config import TenantQuota
    from tests.lora_factory import make_peft_adapter

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4))
    pool = engine.adapter_pool
    pool.config.tenant_quotas = {"beta": TenantQuota(max_adapters=1)}
    pinned = engine.register_adapter("pinned", make_peft_adapter(tiny_llama_dir, tmp_path / "p", rank=4, seed=1),
                                     tenant="beta", pinned=True)
    other = engine.register_adapter("other", make_peft_adapter(tiny_llama_dir, tmp_path / "o", rank=4, seed=2),
                                    tenant="beta")
    pool.wait_idle()
    polls = []
    poll = pool.poll
    pool.poll = lambda: polls.append(None) or poll()
    ae = AsyncEngine(engine)
    await ae.start()
    try:
        await asyncio.to_thread(pool.prefetch, other, "gpu")
        assert pool.has_pending_loads() and not pool.loads_in_flight()
        polls.clear()
        await asyncio.sleep(0.5)
        assert len(polls) <= 10  # 0.5 s at one look per 0.1 s (100 at 5 ms)
        await asyncio.to_thread(pool.unpin, pinned)
        for _ in range(500):  # readiness poll, bounded (5 s)
            if pool.entry(other).resident:
                break
            await asyncio.sleep(0.01)
        assert pool.entry(other).resident
    finally:
        await ae.stop()


def test_one_adapter_s_failing_forward_fails_only_its_requests(tiny_llama_dir, qv_adapters_dir):
    """A forward fails whenever adapter beta is in it (a kernel refusing its shapes, its weights): the base model's
    and alpha's requests that shared the step are run again without it and give the tokens of a run with no
    fault; beta's end with the error. Beta's forwards failing alone, any number, are its own failure, not the
    device's: the engine does not count them towards --max-failed-forwards."""
    shared = []  # the adapters (None: the base model) of each forward that failed

    def engine_with(faulty: bool) -> Engine:
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4, max_failed_forwards=2))
        for name in ("alpha", "beta"):  # resident before the requests come: all three share the first steps
            engine.adapter_pool.load(engine.register_adapter(name, qv_adapters_dir / name))
        run = engine.runner.run

        def faulty_run(batch):
            if any((s.adapter or "").startswith("beta@") for s, _ in batch.scheduled):
                shared.append({(s.adapter or "").partition("@")[0] for s, _ in batch.scheduled})
                raise RuntimeError("kernel fault in beta's shapes")
            return run(batch)

        if faulty:
            engine.runner.run = faulty_run
        return engine

    prompts, adapters = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]], [None, "alpha", "beta", "alpha"]
    want = engine_with(False).generate(prompts, GREEDY, adapters)
    engine = engine_with(True)
    got = engine.generate(prompts, GREEDY, adapters)
    assert {"", "alpha", "beta"} in shared  # they did share a step
    for i in (0, 1, 3):
        assert got[i].finish_reason == "length" and got[i].token_ids == want[i].token_ids, i
    assert got[2].finish_reason == "error" and "kernel fault in beta's shapes" in got[2].error
    assert engine.forward_failures.in_a_row == 0
    for _ in range(3):  # beta alone, more times than --max-failed-forwards
        (out,) = engine.generate([PROMPTS[2]], GREEDY, ["beta"])
        assert out.finish_reason == "error"
    assert engine.forward_failures.in_a_row == 0 and engine.page_pool.num_used("kv") == 0 and not engine.requests


def test_a_broken_device_is_found_out_by_traffic_of_one_adapter_at_a_time(tiny_llama_dir, qv_adapters_dir):
    """Every forward fails (a lasting CUDA error), and each step carries one adapter's requests only (light load,
    or one adapter per tenant): a probe forward without adapters fails too, so those failures are the device's
    and the engine turns unhealthy after --max-failed-forwards, instead of failing every request for ever with
    /healthz green."""
    from lorafleet.worker.forward_failures import EngineUnhealthy

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4, max_failed_forwards=2))
    for name in ("alpha", "beta"):
        engine.adapter_pool.load(engine.register_adapter(name, qv_adapters_dir / name))

    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner.model.forward = broken
    for i, name in enumerate(("alpha", "beta")):
        (out,) = engine.generate([PROMPTS[i]], GREEDY, [name])
        assert out.finish_reason == "error"
    assert engine.forward_failures.in_a_row == 2
    with pytest.raises(EngineUnhealthy, match="illegal memory access"):
        engine.forward_failures.check()


def test_a_request_a_failed_step_left_half_moved_is_aborted_with_nothing_left_behind(tiny_llama_dir,
                                                                                     qv_adapters_dir):
    """A failed step left a running request out of the scheduler's running list (its status still says
    running): aborting it after the failure gives back its KV pages and its adapter reference, so the pages
    are not lost for good and the adapter can still leave the GPU."""
    from lorafleet.worker.async_engine import AsyncEngine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4))
    engine.adapter_pool.load(engine.register_adapter("alpha", qv_adapters_dir / "alpha"))
    engine.add_request("r1", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), adapter="alpha")
    seq = engine.requests["r1"]
    while seq.num_computed_tokens == 0:
        engine.step()
    assert engine.page_pool.num_used("kv") > 0 and engine.adapter_pool.describe()[0]["refcount"] == 1
    engine.scheduler.running.remove(seq)  # half-moved
    AsyncEngine(engine)._abort_quietly("r1")
    assert "r1" not in engine.requests and engine.page_pool.num_used("kv") == 0
    assert engine.adapter_pool.describe()[0]["refcount"] == 0


def test_seeded_requests_draw_the_same_tokens_when_a_failed_step_is_run_again(tiny_llama_dir, qv_adapters_dir,
                                                                               monkeypatch):
    """A step's sampler fails after its draws (the logprobs' [N, V] rows: CUDA out of memory) and each adapter's
    requests run again alone, where they fit: seeded requests give the tokens of a run with no fault (their
    generators do not draw twice for one token)."""
    import torch

    import lorafleet.worker.sampler as sampler_module

    def engine() -> Engine:
        e = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4))
        e.adapter_pool.load(e.register_adapter("alpha", qv_adapters_dir / "alpha"))
        return e

    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True, logprobs=0)
              for i in range(len(PROMPTS))]
    adapters = [None, "alpha", None, "alpha"]
    want = engine().generate(PROMPTS, params, adapters)
    raw, failed = sampler_module.raw_logprobs, []

    def out_of_memory_for_the_whole_step(logits, tokens, k):
        if logits.shape[0] > 2:  # the whole step's rows; each adapter's two fit
            failed.append(logits.shape[0])
            raise torch.OutOfMemoryError("CUDA out of memory")
        return raw(logits, tokens, k)

    monkeypatch.setattr(sampler_module, "raw_logprobs", out_of_memory_for_the_whole_step)
    got = engine().generate(PROMPTS, params, adapters)
    assert failed  # steps were run again, adapter by adapter
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.finish_reason == "length" and g.token_ids == w.token_ids, i
