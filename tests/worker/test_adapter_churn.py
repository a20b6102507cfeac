"""Adapter churn and hot update under load, through the real engine on a tiny Llama.

Churn: 1,000 registered adapters (mixed ranks and module subsets, loaded lazily from a loader
thread), a Zipf-distributed request stream, GPU slots/pages and a CPU tier that hold only a fraction.
After every step the page pool has no leaked or double-owned pages, pinned adapters are resident,
tenant quotas hold; at the end every request finished, and a sample equals the single-adapter
reference (the adapter merged into a plain HF Llama).

Hot update: requests started on v1 finish with v1's outputs, requests after the switch get v2's,
none a mix.
"""

from __future__ import annotations

import random

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig, TenantQuota
from lorafleet.worker.page_pool import PagePool, PagePoolConfig
from tests.lora_factory import PROJS, TINY_DIMS, merged_hf_greedy, random_weights

NUM_ADAPTERS = 1000
NUM_TENANTS = 5
PINNED = ("a0@1", "a500@1")
QUOTA = TenantQuota(max_adapters=3)


def adapter_weights(i: int):
    """Adapter i: rank 2, 4 or 8, a module subset that depends on i (deterministic)."""
    rng = random.Random(i)
    projs = tuple(p for p in PROJS if rng.random() < 0.6) or ("q_proj",)
    return random_weights(10_000 + i, rank=(2, 4, 8)[i % 3], projs=projs, alpha=8.0, std=0.12)


def zipf_stream(num: int, n_items: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(n_items)]
    perm = list(range(n_items))
    rng.shuffle(perm)  # popularity is not the adapter index
    return [perm[k] for k in rng.choices(range(n_items), weights=weights, k=num)]


def make_engine(model_dir, **kw) -> Engine:
    cfg = {"model": str(model_dir), "device": "cpu", "dtype": "float32", "block_size": 16, "num_pages": 400,
           "max_adapter_pages": 110, "max_loras": 12, "max_lora_rank": 8, "max_num_seqs": 16,
           "max_num_batched_tokens": 256, "kernel_backend": "reference", **kw}
    return Engine(EngineConfig(**cfg))


def drive(engine: Engine, arrivals: list[list[tuple]], check) -> dict[str, object]:
    """Add each step's arrivals, step, check invariants; run until all finished."""
    finished = {}
    step = 0
    while step < len(arrivals) or engine.has_unfinished():
        for rid, prompt, params, adapter in arrivals[step] if step < len(arrivals) else ():
            engine.add_request(rid, prompt, params, adapter=adapter)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check()
        if engine.last_batch_size == 0 and engine.has_unfinished() and step >= len(arrivals):
            engine.adapter_pool.wait_idle()  # only adapter loads can unblock the queue
        step += 1
    return finished


def test_churn_1000_adapters_zipf_stream(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    pool = engine.adapter_pool
    pool.config.default_quota = QUOTA
    pool.config.cpu_budget_bytes = 40 * 48_000  # ~40 small adapters stay warm
    for i in range(NUM_ADAPTERS):
        key = f"a{i}@1"
        pool.add(key, loader=lambda i=i: adapter_weights(i), tenant=f"t{i % NUM_TENANTS}", pinned=key in PINNED)
    pool.wait_idle()

    rng = random.Random(7)
    picks = zipf_stream(200, NUM_ADAPTERS, 1.1, seed=3)
    requests = {}
    arrivals: list[list[tuple]] = []
    for n, i in enumerate(picks):
        if n % 6 == 0:
            arrivals.append([])
        adapter = None if n % 10 == 9 else f"a{i}"
        prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 12))]
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
        requests[f"r{n}"] = (prompt, adapter)
        arrivals[-1].append((f"r{n}", prompt, params, adapter))

    def check():
        pool.check()  # pages, slots, layout visibility, refcounts, tenant quotas
        for key in PINNED:
            assert pool.entry(key).resident, f"pinned {key} left the GPU"

    finished = drive(engine, arrivals, check)
    assert len(finished) == len(requests)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 3 for o in finished.values())
    stats = pool.stats()
    assert engine.page_pool.num_used("kv") == 0
    assert all(e["refcount"] == 0 for e in pool.describe())
    assert stats["resident"]["gpu"] <= 12 and stats["bytes"]["cpu"] <= pool.config.cpu_budget_bytes
    assert sum(stats["evictions"]["gpu"].values()) > 30  # the budgets really held only a fraction
    assert stats["hits"]["gpu"] > 0 and stats["misses"]["cpu"] > 0 and stats["load_failures"] == 0
    assert sum(stats["evictions"]["gpu"].values()) >= stats["evictions"]["gpu"].get("quota", 0) > 0

    # A sample (the most popular adapter, rare ones, the base model) equals the single-adapter reference.
    by_adapter = {}
    for rid, (_, adapter) in requests.items():
        by_adapter.setdefault(adapter, rid)
    popular = max(set(picks), key=picks.count)
    sample = [by_adapter[f"a{popular}"], by_adapter[None]] + [by_adapter[a] for a in sorted(
        (a for a in by_adapter if a is not None and a != f"a{popular}"), key=lambda a: int(a[1:]))[:3]]
    for rid in sample:
        prompt, adapter = requests[rid]
        weights = None if adapter is None else adapter_weights(int(adapter[1:]))
        tokens, logprobs = merged_hf_greedy(tiny_llama_dir, weights, prompt, 3)
        out = finished[rid]
        assert out.token_ids == tokens, (rid, adapter)
        assert out.adapter == (None if adapter is None else f"{adapter}@1")
        got = [lp.logprob for lp in out.logprobs]
        assert got == pytest.approx(logprobs, abs=1e-4), (rid, adapter)
    engine.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
def test_pool_churn_invariants_for_every_policy(policy):
    """The pool alone under a Zipf stream with requests that hold their adapter for several steps."""
    pages = PagePool(PagePoolConfig(num_pages=200, page_elems=2048))
    pool = AdapterPool(pages, TINY_DIMS, AdapterPoolConfig(
        max_slots=8, max_rank=8, eviction_policy=policy, cpu_budget_bytes=20 * 48_000, num_load_threads=2,
        default_quota=TenantQuota(max_adapters=3)))
    for i in range(300):
        pool.add(f"a{i}@1", loader=lambda i=i: adapter_weights(i), tenant=f"t{i % 10}", pinned=(i == 0))
    pool.wait_idle()  # the pinned adapter loads at once, without a request
    rng = random.Random(1)
    running: list[tuple[int, int]] = []  # (slot, steps left)
    waiting: list[tuple[str, int]] = []
    for step, i in enumerate(zipf_stream(600, 300, 1.0, seed=5)):
        waiting.append((f"a{i}@1", step))
        still = []
        for key, rid in waiting:
            slot = pool.acquire(key, waiter=rid)
            if slot is None:
                still.append((key, rid))
            else:
                running.append((slot, rng.randrange(1, 6)))
        waiting = still
        running = [(s, n - 1) for s, n in running]
        for s, n in running:
            if n == 0:
                pool.release(s)
        running = [(s, n) for s, n in running if n > 0]
        pool.check()
        assert pool.entry("a0@1").resident
        if len(waiting) > 20:
            pool.wait_idle()
    for s, _ in running:
        pool.release(s)
    pool.check()
    stats = pool.stats()
    assert stats["hits"]["gpu"] > 0 and sum(stats["evictions"]["gpu"].values()) > 0
    pool.close()


def test_hot_update_under_load(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    pool = engine.adapter_pool
    v1 = random_weights(101, rank=8, alpha=8.0, std=0.15)
    v2 = random_weights(202, rank=4, alpha=8.0, std=0.15, projs=("q_proj", "v_proj", "down_proj"))
    pool.add("m@v1", v1)
    pool.load("m@v1")
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(4, 10))] for _ in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    refs = {v: [merged_hf_greedy(tiny_llama_dir, w, p, 6)[0] for p in prompts] for v, w in (("v1", v1), ("v2", v2))}
    assert all(a != b for a, b in zip(refs["v1"], refs["v2"], strict=True))  # the versions are told apart

    outs = {}
    before = [engine.add_request(f"b{k}", prompts[k], params, adapter="m") for k in range(6)]
    for _ in range(2):  # v1 requests are running (prefilled, decoding) when v2 arrives
        for o in engine.step():
            outs[o.request_id] = o
    assert engine.num_running == 6 and not any(o.finished for o in outs.values())  # mid-decode on v1
    pool.add("m@v2", v2)
    during = []
    k = 6
    while pool.resolve("m") != "m@v2":
        # The new version loads beside the old one; until the switch, new requests get v1.
        during.append(engine.add_request(f"d{k}", prompts[k % 12], params, adapter="m"))
        k += 1
        for o in engine.step():
            outs[o.request_id] = o
        pool.poll()
    after = [engine.add_request(f"a{j}", prompts[j], params, adapter="m") for j in range(6, 12)]
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        if engine.last_batch_size == 0 and engine.has_unfinished():
            pool.wait_idle()
    done = {rid: o for rid, o in outs.items() if o.finished}

    def prompt_index(rid):
        return int(rid[1:]) % 12

    for rid in before:
        assert done[rid].adapter == "m@v1" and done[rid].token_ids == refs["v1"][prompt_index(rid)], rid
    for rid in after:
        assert done[rid].adapter == "m@v2" and done[rid].token_ids == refs["v2"][prompt_index(rid)], rid
    for rid in during:  # resolved before the switch: all of v1, never a mix
        version = done[rid].adapter.split("@")[1]
        assert done[rid].token_ids == refs[version][prompt_index(rid)], rid
    pool.check()
    engine.close()
