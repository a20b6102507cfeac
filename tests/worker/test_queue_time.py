"""Queue time: from a request's arrival to its first admission to a batch (Sequence.scheduled_at, set by the
scheduler and kept over preemptions), exported as lorafleet_request_queue_time_seconds{adapter,version} and
vLLM's vllm:request_queue_time_seconds, with vLLM's prefill (first admission to first token) and decode (first
token to the end) times beside them."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from lorafleet.worker import EngineConfig, SamplingParams
from lorafleet.worker.engine import Engine


def test_a_request_is_scheduled_when_it_gets_a_seat_and_keeps_that_time_over_preemptions(tiny_llama_dir):
    """One seat: the second request has no scheduling time while the first runs, and gets one only at the step
    after the first finished. Preempted requests (12 pages for three of 7) keep their first admission's time."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64,
                                 block_size=4, max_num_seqs=1))
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        before = time.monotonic()
        engine.add_request("a", [1, 2, 3], params)
        engine.add_request("b", [1, 2, 4], params)
        seen: dict[str, list[float | None]] = {"a": [], "b": []}
        a_done = None
        while engine.has_unfinished():
            for out in engine.step():
                seen[out.request_id].append(out.scheduled_at)
                if out.request_id == "a" and out.finished:
                    a_done = time.monotonic()
        assert len(seen["a"]) == 5 and len(set(seen["a"])) == 1 and before <= seen["a"][0] <= a_done, seen
        assert len(seen["b"]) == 5 and len(set(seen["b"])) == 1 and seen["b"][0] >= a_done, (seen, a_done)
    finally:
        engine.close()
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=12, block_size=4))
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        for i in (1, 2, 3):
            engine.add_request(f"r{i}", [i] * 8, params)
        times: dict[str, set[float | None]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                times.setdefault(out.request_id, set()).add(out.scheduled_at)
        assert engine.num_preemptions > 0
        assert all(len(t) == 1 and None not in t for t in times.values()) and len(times) == 3, times
    finally:
        engine.close()


def _histograms(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.endswith(("_count", "_sum"))}


async def test_the_worker_exports_queue_prefill_and_decode_times_that_add_up_to_its_latencies(aiohttp_client,
                                                                                              tiny_llama_dir):
    """Over real HTTP, one seat, a streamed request and two plain ones sent at once: each is counted once in
    every series, and per request queue + prefill = time to first token and that + decode = end to end, so the
    sums agree (the scheduler's clock is the request's)."""
    from lorafleet.worker.server import create_app
    from lorafleet.worker.worker_config import WorkerConfig

    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_pages=64, max_num_seqs=1)
    client = await aiohttp_client(create_app(WorkerConfig(engine=config, served_model_name="tiny")))
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    stream = await client.post("/v1/completions", json={**body, "stream": True})
    assert stream.status == 200
    await stream.content.readline()  # the first event: the streamed request holds the seat
    plain = [client.post("/v1/completions", json={**body, "prompt": [1, 2, 3 + i]}) for i in (1, 2)]
    answers = await asyncio.gather(*plain)
    assert [a.status for a in answers] == [200, 200] and b"[DONE]" in await stream.read()
    s = _histograms(await (await client.get("/metrics")).text())
    worker, base = (("model_name", "tiny"),), (("adapter", "__base__"), ("version", ""))
    for name in ("request_queue_time", "request_prefill_time", "request_decode_time", "time_to_first_token",
                 "e2e_request_latency"):
        assert s[(f"vllm:{name}_seconds_count", worker)] == 3, name
    assert s[("lorafleet_request_queue_time_seconds_count", base)] == 3
    queue, prefill, decode = (s[(f"vllm:request_{n}_time_seconds_sum", worker)] for n in ("queue", "prefill", "decode"))
    ttft, e2e = s[("vllm:time_to_first_token_seconds_sum", worker)], s[("vllm:e2e_request_latency_seconds_sum", worker)]
    assert queue > 0 and prefill > 0 and decode > 0
    assert abs(queue + prefill - ttft) < 1e-6 and abs(ttft + decode - e2e) < 1e-6, (queue, prefill, decode, ttft, e2e)
    assert s[("lorafleet_request_queue_time_seconds_sum", base)] == queue
