"""JSON mode's vocabulary table (json_vocab.py) is built once in a worker thread, never by the engine's
thread: a JSON-mode request waits for it before the engine sees it, and the other requests keep decoding
meanwhile. A failed build fails the JSON-mode requests with an error that says so, not the engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.async_engine import AsyncEngine
from lorafleet.worker.json_constraint import START, advance
from lorafleet.worker.json_guide import JsonGuide, JsonModeError
from lorafleet.worker.json_vocab import JsonVocab

PLAIN = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
JSON = SamplingParams(max_tokens=10, temperature=1.0, seed=3, json_object=True)
PROMPT = [5, 6, 7]
LIVENESS_S = 60  # only bounds a hang: a build on the engine thread would stall the plain request forever


class GatedBuild:
    """A build function that records its threads and blocks until released (or raises `error`)."""

    def __init__(self, build, error: Exception | None = None) -> None:
        self.build, self.error = build, error
        self.started, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __call__(self) -> JsonVocab:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        if not self.release.wait(LIVENESS_S):
            raise TimeoutError("the test never released the build")
        if self.error is not None:
            raise self.error
        return self.build()


@pytest.fixture
async def gated(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), num_pages=64, block_size=4, dtype="float32"))
    guide = engine.sampler.json_guide
    gate = GatedBuild(guide._build_vocab)
    guide._build_vocab = gate
    ae = AsyncEngine(engine)
    await ae.start()
    try:
        yield ae, gate
    finally:
        gate.release.set()  # never leave a thread waiting on the gate, whatever failed
        await ae.stop()


async def _collect(ae, rid, params, prompt=PROMPT):
    return [out async for out in ae.generate(rid, prompt, params)]


async def test_plain_requests_decode_while_json_requests_wait_for_the_table(gated):
    ae, gate = gated
    waiting = [asyncio.create_task(_collect(ae, f"json-{i}", JSON)) for i in range(3)]
    plain = await asyncio.wait_for(_collect(ae, "plain", PLAIN), LIVENESS_S)
    assert plain[-1].finished and len(plain[-1].token_ids) == PLAIN.max_tokens
    assert not any(t.done() for t in waiting)
    assert await asyncio.to_thread(gate.started.wait, LIVENESS_S)
    assert gate.threads == ["json-vocab"]  # one build, shared, off the engine thread
    state = await asyncio.wrap_future(ae.call(lambda e: (dict(e.requests), e.sampler.json_guide.is_ready)))
    assert state == ({}, False)  # the engine has not seen the JSON-mode requests yet
    waiting[0].cancel()  # a caller that leaves does not cancel the others' build
    gate.release.set()
    outs = await asyncio.wait_for(asyncio.gather(*waiting[1:]), LIVENESS_S)
    guide = ae.engine.sampler.json_guide
    for stream in outs:
        final = stream[-1]
        assert final.finished and final.finish_reason in ("stop", "length")
        ids = final.token_ids[:-1] if final.finish_reason == "stop" else final.token_ids
        assert advance(START, b"".join(guide.vocab.token_bytes(t) for t in ids)) is not None
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    await _collect(ae, "json-late", JSON)  # built: no second build
    assert gate.threads == ["json-vocab"] and ae.is_running


async def test_a_failed_build_fails_json_requests_with_a_clear_error_not_the_engine(gated):
    ae, gate = gated
    gate.error = RuntimeError("tokenizer broke")
    gate.release.set()
    for rid in ("json-a", "json-b"):  # each request tries again
        with pytest.raises(JsonModeError, match="JSON mode is unavailable.*tokenizer broke"):
            await asyncio.wait_for(_collect(ae, rid, JSON), LIVENESS_S)
    assert gate.threads == ["json-vocab", "json-vocab"]
    assert ae.is_running and ae.failure is None
    plain = await _collect(ae, "plain", PLAIN)
    assert len(plain[-1].token_ids) == PLAIN.max_tokens
    gate.error = None
    outs = await _collect(ae, "json-ok", JSON)
    assert outs[-1].finished and outs[-1].finish_reason != "error"


def test_prepare_builds_once_for_concurrent_callers_and_vocab_waits_for_it():
    gate = GatedBuild(lambda: JsonVocab([b"{", b"}", None]))
    guide = JsonGuide(gate, [2])
    first, second = guide.prepare(), guide.prepare()
    assert first is second and not guide.is_ready
    assert not first.cancel()  # shared: no caller can cancel it
    gate.release.set()
    vocab = guide.vocab  # waits for the build in flight rather than starting another
    assert first.result(LIVENESS_S) is vocab and guide.is_ready and gate.threads == ["json-vocab"]
    assert guide.prepare().result() is vocab and gate.threads == ["json-vocab"]
