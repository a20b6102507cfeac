"""Randomized workloads through a small CPU engine whose page pool the KV cache shares with adapters:
base and adapter requests (several adapters of ranks 1-8, some pinned, some read by a loader), random
prompt lengths, max_tokens, arrivals and aborts, a stream of one tenant's short requests, failed
forwards, pools tight enough that requests preempt each other and adapters are evicted, chunked prefill
on and off. Each seed is one deterministic workload (adapter reads and copies finish between steps).

Checked: every request ends within the step bound; one that fits the pool alone (pinned adapters'
pages taken off) ends with its tokens, the greedy tokens of the request run alone in a roomy engine,
and one that does not is refused with ContextLengthError (at admission, or once its adapter is read); a
failed forward fails only its requests; kv_usage stays in [0, 1]; once its adapter is loaded, a request
is passed over by later arrivals of its own tenant (here its adapter's name, or the base model: later
arrivals of other tenants may go first, by fair share) in at most max_adapter_wait_steps steps (not
counting those its adapter's copy is in flight); at the end no KV page is used, the pools check out and
no adapter is referenced or waited for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.engine_errors import ContextLengthError
from lorafleet.worker.sequence import SequenceStatus
from lorafleet.worker.waiting_queue import fairness_key
from tests.lora_factory import random_weights

BS = 4  # tokens per KV block (one page)
MAX_NEW = 12
ADAPTER_PROJS = ("q_proj", "v_proj")
ADAPTER_RANKS = {"a": 1, "b": 2, "c": 4, "d": 2, "e": 4, "f": 8}
ADAPTER_PAGES = {"a": 1, "b": 2, "c": 4, "d": 2, "e": 4, "f": 7}  # q_proj and v_proj on the tiny model
MAX_STEPS = 3000
NUM_SEEDS = 20
# Prompts are drawn from a fixed set, so that the runs alone (the reference) are shared between seeds.
_PROMPT_RNG = random.Random(1234)
PROMPTS = [[_PROMPT_RNG.randrange(256) for _ in range(n)] for n in (1, 2, 3, 5, 7, 9, 12, 14, 17, 21, 24, 28, 31, 35,
                                                                     38, 41)]


def _weights(name: str):
    return random_weights(ord(name), rank=ADAPTER_RANKS[name], projs=ADAPTER_PROJS, name=name)


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=BS, **kw))


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: list[int]
    adapter: str | None
    max_tokens: int
    arrival: int  # step it is added at
    abort_at: int | None  # step it is aborted at (if still in flight)


@dataclass(slots=True)
class Workload:
    config: dict
    adapters: list[str]
    pinned: list[str]
    loaded_by_reader: list[str]  # registered with a loader (read in a thread on first use), not weights
    requests: list[Request]
    fault_steps: set[int]  # steps whose forward raises: only the requests in it fail


def _workload(seed: int) -> Workload:
    rng = random.Random(seed)
    adapters = rng.sample(sorted(ADAPTER_RANKS), rng.randint(2, 4))
    small = [a for a in adapters if ADAPTER_RANKS[a] <= 4]
    pinned = rng.sample(small, min(len(small), rng.randint(0, 1)))
    config = dict(
        num_pages=rng.choice([12, 16, 20, 24]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        enable_chunked_prefill=rng.random() < 0.5,
        max_loras=rng.randint(len(pinned) + 1, len(adapters) + 1),
        max_loras_per_batch=rng.choice([None, 1, 2]),
        max_adapter_wait_steps=rng.choice([2, 4, 8]),
    )
    requests, arrival = [], 0
    for i in range(rng.randint(6, 14)):
        arrival += rng.choice([0, 0, 1, 2, 5])
        adapter = rng.choice([None, *adapters])
        abort_at = arrival + rng.randint(0, 20) if rng.random() < 0.12 else None
        requests.append(Request(f"r{i}", rng.choice(PROMPTS), adapter, rng.randint(1, MAX_NEW), arrival, abort_at))
    if rng.random() < 0.4:  # a stream of short requests of one tenant, one a step, beside the others
        adapter, start = rng.choice([None, *adapters]), rng.randint(0, 10)
        for i in range(rng.randint(20, 40)):
            requests.append(Request(f"s{i}", rng.choice(PROMPTS[:6]), adapter, rng.randint(1, 3), start + i, None))
    loaded_by_reader = [a for a in adapters if a not in pinned and rng.random() < 0.5]
    fault_steps = set(rng.sample(range(40), rng.randint(1, 2))) if rng.random() < 0.25 else set()
    return Workload(config, adapters, pinned, loaded_by_reader, requests, fault_steps)


def _num_tokens(req: Request, max_model_len: int) -> int:
    """Tokens it generates: max_tokens, unless the context length cuts it short."""
    return min(req.max_tokens, max_model_len - len(req.prompt))


def _fits_alone(req: Request, wl: Workload, max_model_len: int) -> bool:
    """The pages of all its tokens (the last sampled one is never computed) and of its adapter fit in
    what pinned adapters leave of the pool."""
    kv = -(-(len(req.prompt) + _num_tokens(req, max_model_len) - 1) // BS)
    own = 0 if req.adapter is None or req.adapter in wl.pinned else ADAPTER_PAGES[req.adapter]
    return kv + own <= wl.config["num_pages"] - sum(ADAPTER_PAGES[p] for p in wl.pinned)


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    """(prompt, adapter) -> greedy tokens of the request run alone in a roomy engine (cached)."""
    engine = _engine(tiny_llama_dir, num_pages=256)
    for name in ADAPTER_RANKS:
        engine.adapter_pool.add(f"{name}@1", _weights(name))
        engine.adapter_pool.load(f"{name}@1")
        assert len(engine.adapter_pool.entry(f"{name}@1").page_ids) == ADAPTER_PAGES[name]
    cache: dict[tuple, list[int]] = {}
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)

    def tokens(prompt: list[int], adapter: str | None) -> list[int]:
        key = (tuple(prompt), adapter)
        if key not in cache:
            cache[key] = engine.generate([prompt], params, adapters=[adapter])[0].token_ids
        return cache[key]

    yield tokens
    engine.close()


def _serve(engine: Engine, wl: Workload):
    """Run the workload step by step. Returns (finished outputs by request id, None if aborted, the
    ContextLengthError if refused at admission; per request, the steps in which it waited with its adapter
    loaded, and not being copied, while a later arrival of its tenant was admitted; the requests of failed
    forwards)."""
    by_arrival = sorted(wl.requests, key=lambda r: r.arrival)  # stable: the order they are added in
    order = {r.request_id: i for i, r in enumerate(by_arrival)}
    done, overtaken, admitted, faulted = {}, dict.fromkeys(order, 0), set(), set()
    run = engine.runner.run

    def run_or_fault(batch):
        if step in wl.fault_steps:
            faulted.update(s.request_id for s, _ in batch.scheduled)
            raise RuntimeError("injected fault")
        return run(batch)

    engine.runner.run = run_or_fault
    for step in range(MAX_STEPS):
        for req in by_arrival:
            if req.arrival == step:
                params = SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True)
                try:
                    engine.add_request(req.request_id, req.prompt, params, adapter=req.adapter)
                except ContextLengthError as exc:  # it can never fit: refused at admission
                    done[req.request_id] = exc
            if req.abort_at == step and engine.abort(req.request_id):
                done[req.request_id] = None
        seqs = dict(engine.requests)
        ready = [rid for rid, s in seqs.items() if rid not in admitted and _adapter_loaded(engine, s.adapter)]
        outs = engine.step()
        assert 0.0 <= engine.kv_usage <= 1.0, engine.kv_usage
        newly = {rid for rid, s in seqs.items() if rid not in admitted
                 and (s.status is SequenceStatus.RUNNING or s.output_token_ids)}
        admitted |= newly
        for rid in ready:  # a copy in flight holds no one back: those steps do not count
            if rid not in newly and not _adapter_copying(engine, seqs[rid].adapter):
                tenant = fairness_key(seqs[rid])
                overtaken[rid] += any(order[q] > order[rid] and fairness_key(seqs[q]) == tenant for q in newly)
        done.update((out.request_id, out) for out in outs if out.finished)
        engine.adapter_pool.wait_idle()  # copies and reads finish between steps: the run is deterministic
        if step >= by_arrival[-1].arrival and not engine.has_unfinished():
            return done, overtaken, faulted
    pytest.fail(f"not done after {MAX_STEPS} steps: {list(engine.requests.values())}")


def _adapter_loaded(engine: Engine, adapter: str | None) -> bool:
    """Its weights are in CPU memory or on the GPU: only pages or a slot may be missing."""
    if adapter is None:
        return True
    entry = engine.adapter_pool.entry(adapter)
    return entry.on_gpu or (entry.image is not None and entry.fetching is None)


def _adapter_copying(engine: Engine, adapter: str | None) -> bool:
    return adapter is not None and engine.adapter_pool.entry(adapter).copying is not None


def _start(model_dir, wl: Workload) -> Engine:
    engine = _engine(model_dir, **wl.config)
    for name in wl.adapters:
        weights = _weights(name)
        if name in wl.loaded_by_reader:
            engine.adapter_pool.add(f"{name}@1", loader=lambda w=weights: w)
        else:
            engine.adapter_pool.add(f"{name}@1", weights, pinned=name in wl.pinned)
    for name in wl.pinned:
        engine.adapter_pool.load(f"{name}@1")
    return engine


def _run_and_check(engine: Engine, wl: Workload, alone) -> None:
    done, overtaken, faulted = _serve(engine, wl)
    assert set(done) == {r.request_id for r in wl.requests}
    for req in wl.requests:
        out = done[req.request_id]
        if out is None:  # aborted
            continue
        if req.request_id in faulted:
            assert out.error == "injected fault", (req, out)
            continue
        if not _fits_alone(req, wl, engine.max_model_len):
            assert isinstance(out, ContextLengthError) or isinstance(out.exception, ContextLengthError), (req, out)
            continue
        assert not isinstance(out, Exception), (req, out)
        assert (out.finish_reason, out.error) == ("length", None), req
        assert out.token_ids == alone(req.prompt, req.adapter)[: _num_tokens(req, engine.max_model_len)], req
    # Fairness: passed over by its own tenant (for adapter grouping or GPU room) in at most max_adapter_wait_steps
    # steps.
    assert max(overtaken.values()) <= wl.config["max_adapter_wait_steps"], overtaken
    engine.page_pool.check()
    engine.adapter_pool.check()
    assert engine.page_pool.num_used("kv") == 0 and engine.requests == {}
    assert all(d["refcount"] == 0 for d in engine.adapter_pool.describe())
    assert not any(engine.adapter_pool.entry(f"{name}@1").waiters for name in wl.adapters)


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_random_workload_ends_fairly_with_the_tokens_of_each_request_alone(tiny_llama_dir, alone, seed):
    wl = _workload(seed)
    engine = _start(tiny_llama_dir, wl)
    try:
        _run_and_check(engine, wl, alone)
    finally:
        engine.close()
