"""Admission fair across tenants, and an adapter starved for a GPU slot holding back only the requests
that would take that slot: never base-model requests, nor another tenant's requests behind it."""

from __future__ import annotations

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from tests.lora_factory import random_weights
from tests.worker.test_scheduler import FakeAdapterPool, _run_step, _sched, _seq

ADAPTER_PROJS = ("q_proj", "v_proj")


def _engine(model_dir, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


def _add_adapter(engine: Engine, key: str, seed: int) -> None:
    engine.adapter_pool.add(key, random_weights(seed, rank=4, projs=ADAPTER_PROJS))


def _serve(engine: Engine, arrivals: dict[int, list[tuple]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Add (request id, prompt, max_tokens, adapter) at their step; returns each request's first-token step
    and its tokens."""
    first, tokens, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt, max_tokens, adapter in arrivals.get(step, []):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                               adapter=adapter)
        for out in engine.step():
            assert out.error is None, out.error
            first.setdefault(out.request_id, step)
            tokens[out.request_id] = out.token_ids
        engine.adapter_pool.wait_idle()  # copies finish between steps: the run is deterministic
        step += 1
        assert step < 500, "not done"
    return first, tokens


def _alone(model_dir, requests: list[tuple]) -> dict[str, list[int]]:
    engine = _engine(model_dir, num_pages=256)
    _add_adapter(engine, "a@1", 1)
    _add_adapter(engine, "x@1", 2)
    return {rid: engine.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                 adapters=[adapter])[0].token_ids for rid, p, n, adapter in requests}


def test_an_adapter_starved_for_a_slot_holds_back_only_requests_that_would_take_it(tiny_llama_dir):
    """One adapter slot, held by three long requests of adapter a. x's request (x in CPU memory) waits for
    the slot past max_adapter_wait_steps. A base-model request arriving then runs at once (it takes no slot);
    a later request of a waits behind x (a new reference to a would keep a from ever going idle); x runs as
    soon as a's requests finish. Every request gets the tokens it gets alone."""
    engine = _engine(tiny_llama_dir, num_pages=64, max_num_seqs=8, max_loras=1, max_adapter_wait_steps=4)
    _add_adapter(engine, "a@1", 1)
    _add_adapter(engine, "x@1", 2)
    long_a = [(f"a{i}", [10 + i] * 6, 30, "a") for i in range(3)]
    x, base, late_a = ("x", [7, 8, 9], 4, "x"), ("base", [5, 6, 7], 4, None), ("a_late", [3, 4], 4, "a")
    first, tokens = _serve(engine, {0: long_a, 2: [x], 12: [base], 14: [late_a]})
    assert first["base"] == 12  # before the fix: once all of a's requests ended (step 30)
    assert first["a_late"] > first["x"] > max(first[rid] for rid, *_ in long_a)
    assert tokens == _alone(tiny_llama_dir, [*long_a, x, base, late_a])
    assert engine.page_pool.num_used("kv") == 0 and engine.requests == {}


def test_a_tenant_flooding_the_queue_does_not_delay_another_tenants_request(tiny_llama_dir):
    """Two seats; adapter a's tenant queues 12 requests, then adapter x's one. x's request takes the next
    free seat, not the one after all of a's."""
    engine = _engine(tiny_llama_dir, num_pages=64, max_num_seqs=2)
    _add_adapter(engine, "a@1", 1)
    _add_adapter(engine, "x@1", 2)
    flood = [(f"a{i}", [10 + i] * 5, 6, "a") for i in range(12)]
    x = ("x", [7, 8, 9], 6, "x")
    first, tokens = _serve(engine, {0: [*flood, x]})
    assert first["x"] <= first["a2"]  # before the fix: after a11's
    assert tokens == _alone(tiny_llama_dir, [*flood, x])


def test_seats_go_round_robin_to_tenants_fcfs_within_each():
    sched, _ = _sched(max_num_seqs=4)
    t1 = [_seq(4, max_tokens=1) for _ in range(6)]
    t2 = [_seq(4, max_tokens=1) for _ in range(2)]
    for s in t1:
        s.tenant = "t1"
        sched.add(s)
    for s in t2:
        s.tenant = "t2"
        sched.add(s)
    batch = _run_step(sched)
    assert [s for s, _ in batch.prefills] == [t1[0], t2[0], t1[1], t2[1]]
    for s, _ in batch.prefills:
        sched.finish(s, "length")
    assert [s for s, _ in _run_step(sched).prefills] == t1[2:6]  # alone, t1 has every seat


def test_the_tenant_with_fewest_running_requests_gets_the_free_seat():
    sched, _ = _sched(max_num_seqs=3)
    busy = [_seq(4) for _ in range(3)]
    for s in busy:
        s.tenant = "busy"
        sched.add(s)
    _run_step(sched)
    more, other = _seq(4), _seq(4)
    more.tenant, other.tenant = "busy", "other"
    sched.add(more)
    sched.add(other)  # arrived later, but its tenant runs nothing
    sched.finish(busy[0], "length")
    assert [s for s, _ in _run_step(sched).prefills] == [other]


def test_a_preempted_sequence_comes_back_before_other_tenants():
    sched, pool = _sched(num_pages=4, max_num_seqs=4)
    old, young = _seq(6), _seq(6)
    old.tenant, young.tenant = "t1", "t1"
    sched.add(old)
    sched.add(young)
    _run_step(sched)  # 2 pages each
    fresh = _seq(2)
    fresh.tenant = "t2"
    sched.add(fresh)
    sched.waiting._served_at["tenant t2"] = -1  # noqa: SLF001 - t2 ranks before t1 by all else: only the preemption puts t1 first
    for _ in range(3):
        batch = _run_step(sched)
        if batch.preempted:
            break
    assert batch.preempted == [young]
    sched.finish(old, "length")
    assert [s for s, _ in _run_step(sched).prefills][0] is young


@pytest.mark.parametrize("num_waiting", [10, 200])
def test_a_step_asks_only_the_head_of_each_adapter_queue(num_waiting):
    """Requests waiting for the same adapter wait behind its first: a step asks the pool once for them, not
    once per request (a step costs O(tenants + admitted), not O(waiting))."""
    adapters = FakeAdapterPool(resident=())
    sched, _ = _sched(adapter_pool=adapters)
    for _ in range(num_waiting):
        sched.add(_seq(3, adapter="cold@1"))
    _run_step(sched)
    assert adapters.asked == ["cold@1"]


def test_preemption_takes_from_the_tenant_holding_the_most_seats(tiny_llama_dir):
    """Ten 16-token pages; acme sends three requests, globex one three steps later, each of 10 + 44 tokens (4
    pages at the end): pages run out. The victims are acme's, never globex's lone request (the youngest,
    which alone was preempted before the fix, twice). Every request gets the tokens it gets alone."""
    engine = _engine(tiny_llama_dir, num_pages=10, block_size=16)
    params = SamplingParams(max_tokens=44, temperature=0, ignore_eos=True)
    arrivals = {0: [(f"acme{i}", [20 + i] * 10, "acme") for i in range(3)], 3: [("globex", [40] * 10, "globex")]}
    seqs, tokens, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt, tenant in arrivals.get(step, []):
            engine.add_request(rid, prompt, params, tenant=tenant)
            seqs[rid] = engine.requests[rid]
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
        step += 1
        assert step < 200, "not done"
    preemptions = {rid: seq.num_preemptions for rid, seq in seqs.items()}
    assert preemptions["globex"] == 0 and sum(preemptions.values()) > 0, preemptions
    alone = _engine(tiny_llama_dir, num_pages=64, block_size=16)
    assert tokens == {rid: alone.generate([p], params)[0].token_ids for reqs in arrivals.values() for rid, p, _ in reqs}
    assert engine.page_pool.num_used("kv") == 0 and engine.requests == {}


def test_a_victim_scheduled_earlier_in_the_step_leaves_the_batch():
    """Pages run out at t2's lone sequence, the youngest: the victim is t1's youngest, already in the step's
    batch; it leaves the batch and t2's sequence runs."""
    sched, pool = _sched(num_pages=5)
    a1, a2, b = _seq(5), _seq(5), _seq(4)
    a1.tenant, a2.tenant, b.tenant = "t1", "t1", "t2"
    sched.add(a1)
    sched.add(a2)
    _run_step(sched)  # 2 pages each
    sched.add(b)
    _run_step(sched)  # b's prompt takes the last page; a1 and a2 decode within their pages
    assert pool.num_free == 0 and sched.running == [a1, a2, b]
    batch = _run_step(sched)  # b's decode needs a page
    assert batch.preempted == [a2] and batch.decodes == [a1, b] and batch.num_tokens == 2
    assert a2.block_table == [] and b.num_preemptions == 0


@pytest.mark.parametrize("shared", [False, True])
def test_where_tenants_share_the_worker_one_runs_at_most_three_quarters_of_the_seats(shared):
    """acme's burst took every seat, with long generations; globex's request, arriving a step later, waited for
    the first of acme's to end (running sequences are not preempted): 70 s to its first token on a CPU worker.
    Where several tenants have keys, a quarter of the seats stays for the others."""
    sched, _ = _sched(max_num_seqs=8, max_num_batched_tokens=512)
    sched.shared = lambda: shared
    for i in range(12):
        seq = _seq(4 + i)
        seq.tenant = "acme"
        sched.add(seq)
    _run_step(sched)
    assert sum(s.tenant == "acme" for s in sched.running) == (6 if shared else 8)
    late = _seq(3)
    late.tenant = "globex"
    sched.add(late)
    _run_step(sched)
    assert (late in sched.running) == shared
