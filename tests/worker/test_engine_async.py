"""AsyncEngine: streams from a background engine thread, cancel = abort, errors reach the caller."""

from __future__ import annotations

import asyncio

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
