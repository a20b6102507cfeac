"""A step's tokens shared among tenants: decodes first, then each tenant's prompt chunks held to an even share of
what is left, the unused rest to the held chunks (no token of a step is lost to the rule)."""

from __future__ import annotations

from lorafleet.worker.sequence import SequenceStatus
from tests.worker.test_scheduler import FakeAdapterPool, _run_step, _sched, _seq
from tests.worker.test_scheduler_fairness import _add_adapter, _alone, _engine, _serve


def _of(tenant, n, **kw):
    seq = _seq(n, **kw)
    seq.tenant = tenant
    return seq


def _tokens(batch):
    return {seq.request_id: n for seq, n in batch.scheduled}


def test_a_tenants_long_prompt_does_not_hold_back_another_tenants_short_one():
    """acme's 40-token prompt, older, took every step's 8 tokens until its end: globex's 3-token prompt waited
    five steps for its first token. It now runs in the next step, acme's chunk taking the rest."""
    sched, _ = _sched(max_num_batched_tokens=8)
    long = _of("acme", 40)
    sched.add(long)
    _run_step(sched)
    short = _of("globex", 3)
    short.request_id = "short"
    sched.add(short)
    batch = _run_step(sched)
    assert _tokens(batch) == {"short": 3, "r40": 5} and short.output_token_ids == [1]


def test_a_tenants_prompts_do_not_starve_another_tenants_decodes():
    """acme's long prompts, older, came first in the step and took every token: globex's running request got
    no decode until they were done. Decodes go first now, and prompts share what they leave."""
    sched, _ = _sched(max_num_batched_tokens=8)
    for i in range(3):
        sched.add(_of("acme", 30 + i))
    sched.add(_of("globex", 2, max_tokens=6))
    globex = sched.waiting.heads("tenant globex")[0][1]
    steps = 0
    while globex.status is not SequenceStatus.FINISHED:
        batch = _run_step(sched)
        steps += 1
        assert batch.num_tokens == 8
        if len(globex.output_token_ids) == 6:
            sched.finish(globex, "length")
    assert steps <= 7  # its prompt, then a decode in each step
    assert any(s.num_uncomputed_tokens > 1 for s in sched.running)  # acme's prompts are not done yet


def test_an_even_share_of_prompt_tokens_for_each_tenant():
    sched, _ = _sched(max_num_batched_tokens=12)
    for tenant, n in (("acme", 20), ("acme", 21), ("globex", 22), ("initech", 23)):
        sched.add(_of(tenant, n))
    batch = _run_step(sched)
    assert _tokens(batch) == {"r20": 4, "r22": 4, "r23": 4}


def test_tokens_a_tenant_cannot_use_go_to_the_others():
    """globex's request waits for its adapter's load: acme's prompt is held to half the step, then takes the
    rest (the step is as long as before)."""
    adapters = FakeAdapterPool(resident=())
    sched, _ = _sched(max_num_batched_tokens=8, adapter_pool=adapters)
    sched.add(_of("acme", 30))
    sched.add(_of("globex", 3, adapter="cold@1"))
    assert _tokens(_run_step(sched)) == {"r30": 8}


def test_without_chunking_a_whole_prompt_is_not_held_to_its_tenants_share():
    """Two tenants, 10 tokens: acme's 6-token prompt cannot be chunked to its share of 5, so it runs whole
    (held to the share it would wait for ever); globex's waits for the next step."""
    sched, _ = _sched(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add(_of("acme", 6))
    sched.add(_of("globex", 7))
    assert _tokens(_run_step(sched)) == {"r6": 6}
    assert _tokens(_run_step(sched)) == {"r6": 1, "r7": 7}


def test_tenants_sharing_a_step_get_the_tokens_each_gets_alone(tiny_llama_dir):
    """Chunks cut to shares and topped up keep every request's KV right: acme's two long prompts and globex's
    short one, arriving between their chunks, give the tokens each gives alone, globex's first token early."""
    engine = _engine(tiny_llama_dir, num_pages=64, max_num_batched_tokens=16)
    _add_adapter(engine, "a@1", 1)
    _add_adapter(engine, "x@1", 2)
    long = [(f"a{i}", [(7 * i + j) % 50 + 3 for j in range(60)], 5, "a") for i in range(2)]
    short = ("x", [5, 6, 7], 5, "x")
    first, tokens = _serve(engine, {0: long, 1: [short]})
    assert first["x"] <= 2 < first["a0"]
    assert tokens == _alone(tiny_llama_dir, [*long, short])
    assert engine.page_pool.num_used("kv") == 0


def test_a_share_kept_for_a_tenant_whose_request_cannot_start_is_not_lost():
    """globex's request waits for its adapter's load: its share of the step went unused, and acme, held to the
    other half, admitted fewer prompts (12 of 16 tokens). Once no other tenant can take more, acme's waiting
    prompts take the rest."""
    adapters = FakeAdapterPool(resident=())
    sched, _ = _sched(max_num_batched_tokens=16, adapter_pool=adapters)
    for i in range(4):
        sched.add(_of("acme", 12 + i))
    sched.add(_of("globex", 4, adapter="cold@1"))
    batch = _run_step(sched)
    assert batch.num_tokens == 16 and "cold@1" in adapters.asked  # globex's admission was tried: its load goes on


def test_what_another_tenant_leaves_goes_to_a_tenants_older_running_prompt_first():
    """acme's running prompt is held to half the step; globex's request cannot start (its adapter's load). The
    half globex leaves went to acme's younger waiting prompt, admitted past its share, ahead of the older one
    (FCFS within a tenant); the older takes it now."""
    adapters = FakeAdapterPool(resident=())
    sched, _ = _sched(max_num_batched_tokens=16, adapter_pool=adapters)
    older = _of("acme", 60)
    sched.add(older)
    _run_step(sched)
    sched.add(_of("acme", 61))
    sched.add(_of("globex", 4, adapter="cold@1"))
    assert _tokens(_run_step(sched)) == {"r60": 16}
