"""Prefix caching: full KV blocks kept when a sequence leaves, found again by the next sequence of the same tenant
and adapter version whose tokens begin the same way; idle kept pages are free pages, given away last."""

from __future__ import annotations

import threading

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.block_manager import BlockManager
from lorafleet.worker.page_pool import PREFIX, PagePool, PagePoolConfig, PagePoolError
from lorafleet.worker.scheduled_batch import ScheduledBatch
from lorafleet.worker.scheduler import Scheduler
from lorafleet.worker.sequence import Sequence
from tests.lora_factory import random_weights
from tests.worker.test_scheduler import BS

PROMPT = list(range(100, 110))  # 10 tokens: two full blocks of 4 kept, found by a sequence of the same 10


def _sched(num_pages=32, **kw):
    pool = PagePool(PagePoolConfig(num_pages=num_pages, page_elems=8))
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(BlockManager(pool, BS, prefix_caching=True), **kw), pool


def _seq(tokens, max_tokens=3, tenant="acme", adapter=None, **params):
    return Sequence(f"r{id(tokens)}", list(tokens), SamplingParams(max_tokens=max_tokens, **params), tenant=tenant,
                    adapter=adapter)


def _run_step(sched):
    """What the engine does after the forward: advance the cache (keeping the blocks it filled), append a token
    for samplers."""
    batch = sched.schedule()
    for seq, n in batch.scheduled:
        seq.num_computed_tokens += n
        sched.block_manager.keep_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(1)
    return batch


def _serve(sched, seq):
    """Run `seq` to its end; returns the tokens its first step computed."""
    sched.add(seq)
    first = None
    while not seq.is_finished:
        batch = _run_step(sched)
        first = first if first is not None else dict((s.seq_id, n) for s, n in batch.scheduled)[seq.seq_id]
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return first


def test_a_prompt_seen_before_computes_only_what_no_kept_block_holds():
    sched, pool = _sched()
    assert _serve(sched, _seq(PROMPT)) == 10
    cache = sched.block_manager.prefix_cache
    assert cache.num_blocks == 3  # 10 prompt tokens + 2 decoded ones computed: three full blocks
    assert pool.num_used("kv") == 0 and pool.num_idle == 3 and pool.num_free == 32
    again = _seq(PROMPT)
    assert _serve(sched, again) == 2  # its first 8 tokens' KV were kept
    assert cache.hit_tokens == 8 and cache.queried_tokens == 20
    # all but the last token: a prompt of exactly two blocks takes only the first
    assert _serve(sched, _seq(PROMPT[:8])) == 4
    pool.check()


@pytest.mark.parametrize("other", ["tenant", "adapter", "version", "tokens", "prompt_logprobs", "salt", "unsalted"])
def test_blocks_are_found_only_by_the_same_tenant_and_adapter_version_for_the_same_tokens(other):
    sched, pool = _sched()
    _serve(sched, _seq(PROMPT, adapter="a@1", cache_salt="user-1" if other == "unsalted" else None))
    kw = {"tenant": "globex" if other == "tenant" else "acme", "adapter": {"adapter": "b@1", "version": "a@2"}.get(
        other, "a@1")}
    if other == "prompt_logprobs":
        kw["prompt_logprobs"] = 1  # needs every position's logits
    if other == "salt":
        kw["cache_salt"] = "user-2"  # vLLM's cache_salt: one tenant's users kept apart
    tokens = [1, *PROMPT[1:]] if other == "tokens" else PROMPT
    assert _serve(sched, _seq(tokens, **kw)) == 10
    pool.check()


def test_requests_with_the_same_cache_salt_share_blocks():
    sched, pool = _sched()
    _serve(sched, _seq(PROMPT, cache_salt="user-1"))
    assert _serve(sched, _seq(PROMPT, cache_salt="user-1")) == 2
    pool.check()


def test_sequences_share_kept_blocks_and_each_grows_its_own():
    sched, pool = _sched()
    _serve(sched, _seq(PROMPT))
    a, b = _seq([*PROMPT, 1, 2]), _seq([*PROMPT, 3])
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    assert a.block_table[:2] == b.block_table[:2] and set(a.block_table[2:]).isdisjoint(b.block_table[2:])
    assert pool.pages_of(PREFIX) == a.block_table[:3] and pool.num_used("kv") == 3 + 1  # a filled a third
    sched.finish(a, "length")
    assert pool.owner_of(b.block_table[0]) == PREFIX  # b still uses them
    sched.finish(b, "length")
    assert pool.num_used("kv") == 0
    pool.check()


def test_idle_kept_pages_are_given_away_last_least_recently_used_first():
    """Allocations take plain free pages first, then the idle kept ones, the oldest first; the blocks given away
    are never found again, the others are."""
    sched, pool = _sched(num_pages=8)
    _serve(sched, _seq(PROMPT, max_tokens=1))  # 2 blocks kept
    _serve(sched, _seq([7] * 9, max_tokens=1))  # 2 more, idle after PROMPT's
    assert pool.num_idle == 4 and sched.block_manager.prefix_cache.num_blocks == 4
    big = _seq(list(range(200, 222)), max_tokens=1)  # 6 pages: the 4 plain free ones, then PROMPT's two
    sched.add(big)
    _run_step(sched)
    assert pool.num_idle == 2 and pool.num_used("kv") == 6
    sched.finish(big, "error")  # keeps nothing
    assert _serve(sched, _seq([7] * 9)) == 1
    assert _serve(sched, _seq(PROMPT)) == 10
    pool.check()


def test_a_preempted_sequence_comes_back_from_its_kept_blocks():
    sched, pool = _sched(num_pages=5, max_num_batched_tokens=16)
    a, b = _seq(list(range(1, 9)), max_tokens=20), _seq(list(range(50, 58)), max_tokens=20)
    sched.add(a)
    sched.add(b)
    while not (batch := _run_step(sched)).preempted:
        pass
    victim = batch.preempted[0]
    assert victim.block_table == [] and sched.block_manager.prefix_cache.num_blocks >= 2
    for _ in range(3):
        survivor = next(s for s in (a, b) if s is not victim)
        sched.finish(survivor, "length")
        batch = _run_step(sched)
        if victim in sched.running:
            break
    computed = dict((s.seq_id, n) for s, n in batch.scheduled)[victim.seq_id]
    assert computed < victim.num_tokens  # not all of it again
    pool.check()


def test_what_a_failed_forward_wrote_is_never_kept():
    sched, pool = _sched()
    seq = _seq(PROMPT)
    sched.add(seq)
    sched.schedule()  # its forward fails: nothing computed
    sched.fail([seq], RuntimeError("the forward failed"))
    assert sched.block_manager.prefix_cache.num_blocks == 0 and pool.num_idle == 0 and pool.num_free == 32


def test_the_pool_hands_idle_pages_back_and_forth_and_proves_its_books():
    pool = PagePool(PagePoolConfig(num_pages=4, page_elems=8))
    evicted = []
    pool.on_evict = evicted.append
    a, b = pool.allocate(2, ("kv", 1))
    pool.keep(a)
    assert pool.owner_of(a) == PREFIX and pool.pages_of(("kv", 1)) == [b]
    with pytest.raises(PagePoolError):
        pool.keep(a)  # the cache's already
    pool.idle(a)
    assert pool.num_free == 3 and pool.num_idle == 1 and pool.num_used("kv") == 1
    assert pool.reuse(a) and pool.num_idle == 0 and pool.num_used("kv") == 2
    pool.idle(a)
    taken = pool.allocate(3, ("adapter", "x"))  # two plain free pages, then the idle one
    assert taken[-1] == a and evicted == [a] and not pool.reuse(a)
    pool.free(taken)
    pool.check()


def test_pages_given_away_on_another_thread_are_never_found():
    """An adapter load on its own thread takes idle kept pages (the oldest: the first prompt's) and gives them
    back: the blocks they held are misses from then on, never someone else's page; the others are still found."""
    sched, pool = _sched(num_pages=16)
    for i in range(4):
        _serve(sched, _seq([i] * 9, max_tokens=1))
    assert pool.num_idle == 8
    taker = threading.Thread(target=pool.allocate, args=(10, ("adapter", "x")))  # 8 plain free pages, 2 idle
    taker.start()
    taker.join()
    pool.free(pool.pages_of(("adapter", "x")))
    assert [_serve(sched, _seq([i] * 9, max_tokens=1)) for i in range(4)] == [9, 1, 1, 1]
    pool.check()


def _engine(model_dir, **kw) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=4, num_pages=64,
                                 **kw))
    for key, seed in (("qa@1", 1), ("qb@1", 2)):  # v_proj: an adapter's KV is its own
        engine.adapter_pool.add(key, random_weights(seed, rank=4, projs=("q_proj", "v_proj")))
    return engine


def test_requests_give_the_same_tokens_from_kept_blocks(tiny_llama_dir):
    """A shared system prompt over the base model and two adapters touching v_proj (their KV differs from the
    base's), requests one after another: the same tokens with kept blocks as without, many of them hits."""
    system = [(7 * j) % 60 + 3 for j in range(23)]
    requests = [(system + [5 + i, 9], adapter) for i in range(3) for adapter in (None, "qa", "qb")]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        engine = _engine(tiny_llama_dir, enable_prefix_caching=caching)
        outputs[caching] = [engine.generate([p], params, adapters=[a])[0].token_ids for p, a in requests]
        cache = engine.block_manager.prefix_cache
        assert cache.hit_tokens >= 6 * 20 if caching else cache is None  # 5 blocks of the system prompt, 6 times
        assert engine.page_pool.num_used("kv") == 0
    assert outputs[True] == outputs[False]


def test_an_adapter_key_registered_again_with_other_weights_finds_none_of_the_old_blocks(tiny_llama_dir):
    """A dropped version is forgotten: the same name@version registered again may carry other weights, so the
    blocks its first registration computed are never found by the second."""
    prompt = [(5 * j) % 50 + 3 for j in range(21)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine = _engine(tiny_llama_dir)
    engine.generate([prompt], params, adapters=["qa"])
    engine.adapter_pool.unregister("qa")
    engine.adapter_pool.add("qa@1", random_weights(9, rank=4, projs=("q_proj", "v_proj")))
    hits = engine.block_manager.prefix_cache.hit_tokens
    got = engine.generate([prompt], params, adapters=["qa"])[0].token_ids
    assert engine.block_manager.prefix_cache.hit_tokens == hits
    fresh = _engine(tiny_llama_dir, enable_prefix_caching=False)
    fresh.adapter_pool.unregister("qa")
    fresh.adapter_pool.add("qa@1", random_weights(9, rank=4, projs=("q_proj", "v_proj")))
    assert got == fresh.generate([prompt], params, adapters=["qa"])[0].token_ids


def test_the_blocks_of_a_dropped_registration_become_plain_free_pages(tiny_llama_dir):
    """Once a registration is dropped nothing finds its blocks again: at the next lookup their idle pages are plain
    free, not kept to be given away after the blocks that may still be hit. The base model's blocks stay."""
    prompt = [(5 * j) % 50 + 3 for j in range(21)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine = _engine(tiny_llama_dir)
    engine.generate([prompt], params, adapters=["qa"])
    engine.generate([prompt], params, adapters=[None])
    cache, pool = engine.block_manager.prefix_cache, engine.page_pool
    kept = cache.num_blocks
    assert kept >= 2 and pool.num_idle == kept
    engine.adapter_pool.unregister("qa")
    engine.generate([prompt[:2]], SamplingParams(max_tokens=1), adapters=[None])  # its lookup drains; it keeps none
    assert cache.num_blocks == pool.num_idle == kept // 2  # the base model's only
    assert len(cache._roots) == 1
    assert engine.generate([prompt], params, adapters=[None])[0].token_ids  # still found
    assert cache.hit_tokens >= 16
    pool.check()


def test_a_tenant_gone_from_the_keys_file_leaves_no_block_to_whoever_gets_its_name():
    """A tenant's name given to another customer in a later keys file found the blocks of the first one's prompts
    (its `cached_tokens` told it what they had sent). Once the name leaves the file its blocks are plain free
    pages; another tenant's stay."""
    sched, pool = _sched()
    _serve(sched, _seq(PROMPT, tenant="acme"))
    _serve(sched, _seq(PROMPT, tenant="globex"))
    cache = sched.block_manager.prefix_cache
    kept = cache.num_blocks
    cache.drop_tenant("acme")
    assert _serve(sched, _seq(PROMPT, tenant="acme")) == 10
    assert _serve(sched, _seq(PROMPT, tenant="globex")) == 2
    assert cache.num_blocks == kept and pool.num_idle == kept  # acme's own again, computed afresh
    pool.check()


def test_a_tenant_gone_while_its_request_runs_leaves_no_block_to_whoever_gets_its_name():
    """As above, with acme's request still running when the name leaves the file: its blocks were in use, so they
    stayed under acme's root, went idle when it finished, and the name's next owner found them."""
    sched, pool = _sched()
    running = _seq(PROMPT, max_tokens=6, tenant="acme")
    sched.add(running)
    _run_step(sched)
    assert running.prefix_blocks  # kept, in use
    sched.block_manager.prefix_cache.drop_tenant("acme")
    while not running.is_finished:
        _run_step(sched)
        if len(running.output_token_ids) >= running.params.max_tokens:
            sched.finish(running, "length")
    assert _serve(sched, _seq(PROMPT, tenant="acme")) == 10  # the new acme computes it all
    assert _serve(sched, _seq(PROMPT, tenant="acme")) == 2  # and keeps its own blocks from then on
    pool.check()


def test_a_request_arriving_while_another_runs_finds_the_blocks_it_filled():
    sched, pool = _sched()
    first = _seq(PROMPT, max_tokens=50)
    sched.add(first)
    _run_step(sched)
    assert len(first.prefix_blocks) == 2 and pool.pages_of(PREFIX) == first.block_table[:2]
    second = _seq([*PROMPT[:8], 1, 2, 3])
    sched.add(second)
    batch = _run_step(sched)
    assert dict((s.seq_id, n) for s, n in batch.scheduled)[second.seq_id] == 3
    assert second.block_table[:2] == first.block_table[:2]
    pool.check()


def test_sequences_that_computed_the_same_blocks_in_one_step_end_up_sharing_them():
    """A request asking for prompt logprobs computes its whole prompt beside one with the same prompt (it never
    waits for kept blocks); after the step its pages for the full blocks are given back and it reads the
    first one's."""
    sched, pool = _sched()
    a, b = _seq(PROMPT, max_tokens=20), _seq(PROMPT, max_tokens=20, prompt_logprobs=1)
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert pool.num_used("kv") == 2 + 1 + 1
    sched.finish(a, "length")
    sched.finish(b, "length")
    assert pool.num_used("kv") == 0 and sched.block_manager.prefix_cache.num_blocks == 2
    pool.check()


def test_engine_requests_arriving_while_others_run_give_the_same_tokens(tiny_llama_dir):
    """Requests sharing a system prompt arrive a few steps apart, each while the earlier ones still decode: they
    find the blocks the earlier ones filled, and give the tokens they give without prefix caching."""
    system = [(11 * j) % 60 + 3 for j in range(18)]
    arrivals = {0: ("a", system + [5], None), 2: ("b", system + [6, 7], None), 3: ("c", system + [5], "qa"),
                5: ("d", system + [8], "qa"), 6: ("e", system + [5], None)}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        engine, tokens, step = _engine(tiny_llama_dir, enable_prefix_caching=caching), {}, 0
        while step <= max(arrivals) or engine.has_unfinished():
            if step in arrivals:
                rid, prompt, adapter = arrivals[step]
                engine.add_request(rid, prompt, params, adapter=adapter)
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
            engine.adapter_pool.wait_idle()
            step += 1
        outputs[caching] = tokens
        if caching:  # b, d and e each found the 16 tokens of 4 full blocks an earlier one still running filled
            assert engine.block_manager.prefix_cache.hit_tokens == 3 * 16
        assert engine.page_pool.num_used("kv") == 0
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("first_scores", [False, True])
def test_requests_sharing_a_prompt_admitted_together_compute_it_once(first_scores):
    """Three requests with one long prompt arrive together (a request's `n` choices, a burst): the first computes
    it, the others wait for the step that fills its blocks and take them, computing only their last partial
    block, instead of all three computing all of it. A first that asks for prompt logprobs keeps its blocks
    too."""
    sched, pool = _sched(max_num_batched_tokens=64)
    prompt = list(range(300, 330))  # 30 tokens: 7 full blocks, 28 tokens kept by the first
    seqs = [_seq(prompt, **({"prompt_logprobs": 1} if first_scores and i == 0 else {})) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    computed = 0
    while not all(s.is_finished for s in seqs):
        batch = _run_step(sched)
        computed += sum(n for s, n in batch.prefills)
        for s in seqs:
            if len(s.output_token_ids) >= 3 and not s.is_finished:
                sched.finish(s, "length")
    assert computed == 30 + 2 * 2
    pool.check()


def test_no_request_waits_for_blocks_another_computes_again_that_are_kept_already():
    """A request asking for prompt logprobs computes its whole prompt though its blocks are kept. A request whose
    lookup finds those blocks waited for the step that computed them again (and so did those of its tenant queued
    behind it, even unrelated ones, at every chunk of a chunked prompt); they go in the same step."""
    sched, pool = _sched(num_pages=64, max_num_batched_tokens=100)
    prompt = list(range(100, 180))  # 80 tokens: 20 blocks
    _serve(sched, _seq(prompt, max_tokens=1))
    scorer, again, unrelated = _seq(prompt, max_tokens=1, prompt_logprobs=1), _seq(prompt, max_tokens=1), _seq([1, 2, 3])
    for seq in (scorer, again, unrelated):
        sched.add(seq)
    batch = _run_step(sched)
    assert [s for s, _ in batch.scheduled] == [scorer, again, unrelated]
    assert again.num_cached_tokens == 76
    pool.check()


def test_engine_choices_of_one_prompt_sent_together_give_the_same_tokens(tiny_llama_dir):
    """Four seeded choices of one prompt added together (as the server adds a request's `n`): the first computes
    the prompt, the others take its blocks a step later; each samples the tokens it samples without caching."""
    prompt = [(13 * j) % 60 + 3 for j in range(30)]
    outs = {}
    for caching in (True, False):
        engine, tokens = _engine(tiny_llama_dir, enable_prefix_caching=caching), {}
        for i in range(4):
            engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
        outs[caching] = tokens
        if caching:
            assert engine.block_manager.prefix_cache.hit_tokens == 3 * 28  # 7 blocks of 4, all but the last token
    assert outs[True] == outs[False]


def test_a_head_short_of_pages_is_counted_as_such_whatever_kept_blocks_it_found():
    """A queue head that finds kept blocks but not the rest of its pages let them go idle again: counted among
    the free pages, they made its shortage look met, it was never counted as waiting for pages, and another
    tenant's small requests overtook it for ever."""
    sched, pool = _sched(num_pages=16, max_adapter_wait_steps=4)
    prompt = list(range(100, 124))
    _serve(sched, _seq([*prompt, 1], max_tokens=1))  # 6 blocks kept
    hogs = [_seq([60 + i] * 14, max_tokens=100) for i in range(2)]
    for hog in hogs:
        sched.add(hog)
    _run_step(sched)
    head = _seq([*prompt, *range(200, 210)], max_tokens=1)  # 9 blocks: 6 kept, 3 more than the pool has
    sched.add(head)
    for _ in range(6):
        sched.add(_seq([9, 8, 7], max_tokens=1, tenant="globex"))
        for seq, _n in _run_step(sched).scheduled:
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
    assert head.block_table == [] and sched.waiting._page_waits.get(head.seq_id, 0) == 6  # noqa: SLF001
    pool.check()


def test_only_admissions_count_their_lookups():
    """A head that cannot be admitted looks its blocks up at every step: only the admission that ran counts,
    once, in vllm:prefix_cache_queries and _hits."""
    sched, pool = _sched(num_pages=10)
    _serve(sched, _seq(PROMPT, max_tokens=1))
    cache = sched.block_manager.prefix_cache
    hog = _seq(list(range(1, 25)), max_tokens=100)  # 6 of the 8 plain free pages, then some
    sched.add(hog)
    _run_step(sched)
    before = (cache.queried_tokens, cache.hit_tokens)
    again = _seq([*PROMPT, *range(400, 420)])  # needs 8 pages: waits for the hog
    sched.add(again)
    for _ in range(5):
        _run_step(sched)
    assert (cache.queried_tokens, cache.hit_tokens) == before and again.block_table == []
    sched.finish(hog, "length")
    _run_step(sched)
    assert (cache.queried_tokens - before[0], cache.hit_tokens - before[1]) == (30, 8)


def test_without_chunking_a_prompt_that_found_kept_blocks_runs_its_rest_whole():
    """Unchunked, a prompt that found kept blocks looked as if its prefill had begun and was cut to its tenant's
    share; the rest, which fits the step, now runs in one piece."""
    sched, pool = _sched(max_num_batched_tokens=16, enable_chunked_prefill=False)
    _serve(sched, _seq(list(range(100, 109)), max_tokens=1))
    again = _seq([*range(100, 108), *range(300, 308)], max_tokens=1)
    sched.add(again)
    for tenant in ("globex", "initech"):
        sched.add(_seq([5, 6, 7, 8, 9], max_tokens=1, tenant=tenant))
    batch = _run_step(sched)
    assert dict((s.seq_id, n) for s, n in batch.scheduled).get(again.seq_id) == 8


def test_a_sequence_that_keeps_nothing_leaves_no_trie_behind():
    sched, pool = _sched()
    for i in range(20):
        _serve(sched, _seq([i, i + 1], max_tokens=1, adapter=f"a{i}@1"))  # shorter than a block
    assert sched.block_manager.prefix_cache._roots == {}  # noqa: SLF001


def test_the_index_of_a_steps_prefills_follows_appends_top_ups_and_removals():
    """A waiting head is compared only with the step's prefills of its trie that begin with its first block, found
    through an index of the step's prefills: one added after the index was built is found, a chunk topped up in
    place is seen at its new length, and one taken out of the step (preempted) shifts the others' positions
    without any of them being lost or mistaken for another."""
    sched, _ = _sched()
    cache = sched.block_manager.prefix_cache
    prompt = list(range(200, 220))  # 5 blocks
    filler, head = _seq(prompt), _seq(prompt)
    other_tenant, unrelated = _seq(prompt, tenant="globex"), _seq(list(range(500, 520)))
    short = _seq(prompt[:BS - 1])  # shorter than a block: never indexed, but it holds a position
    batch = ScheduledBatch()
    batch.add(other_tenant, 20)
    batch.add(short, BS - 1)
    batch.add(unrelated, 20)
    assert not cache.filled_by_another(head, batch)  # the index is built: none is of head's trie and tokens
    batch.add(filler, BS - 1)
    assert not cache.filled_by_another(head, batch)  # appended, indexed: its chunk fills no block yet
    batch.grow(3, 3)  # topped up in place
    assert cache.filled_by_another(head, batch)
    assert batch.remove(other_tenant) == 20 and batch.remove(unrelated) == 20
    assert cache.filled_by_another(head, batch)  # now first: found at its new position
    assert not cache.filled_by_another(filler, batch)  # never itself
    batch.remove(filler)
    assert not cache.filled_by_another(head, batch)
    batch.add(_seq(prompt[:BS]), BS)  # a prompt of exactly one block fills it
    assert cache.filled_by_another(head, batch)


def test_a_head_past_its_share_waits_for_the_block_a_chunk_topped_up_in_the_same_step_fills():
    """A running prompt's chunk fills no block when the step's first heads are checked; the tokens no tenant took
    then top it up so that it fills one; a head of its tenant with the same prompt, admitted after the shares
    are lifted, waits a step for that block instead of computing it beside."""
    sched, pool = _sched(num_pages=64, max_num_batched_tokens=5)
    prompt = list(range(200, 209))  # 9 tokens
    filler = _seq(prompt, max_tokens=2)
    sched.add(filler)
    _run_step(sched)
    assert filler.num_computed_tokens == 5  # mid-block: the block it fills next ends at 8
    sched.max_num_batched_tokens = 13  # 5 tenants: a share of 2 each
    head, other = _seq(prompt, max_tokens=2), _seq(list(range(300, 305)), max_tokens=2, tenant="globex")
    for seq in (head, other, *[_seq([500 + i], max_tokens=2, tenant=f"t{i}") for i in range(3)]):
        sched.add(seq)
    chunks = {s.seq_id: n for s, n in sched.schedule().prefills}
    assert chunks[filler.seq_id] == 4  # 2 of its share, 2 topped up: it fills tokens 4 to 8
    assert other.seq_id in chunks and head.seq_id not in chunks
    pool.check()
