"""Scheduler and adapter pool together in the engine: adapters share the page pool with the KV cache,
and no tenant's adapter may fail or starve another tenant's requests (nor be starved by them)."""

from __future__ import annotations

import re
import threading

import pytest

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from tests.lora_factory import random_weights

ADAPTER_PROJS = ("q_proj", "v_proj")  # at rank 4 on the tiny model: 4 pages of 4-token KV blocks


def _engine(model_dir, **kw) -> Engine:
    kw.setdefault("num_pages", 16)
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


def _add_adapter(engine: Engine, key: str = "x@1", loader=None, seed: int = 0) -> None:
    weights = random_weights(seed, rank=4, projs=ADAPTER_PROJS)
    if loader is None:
        engine.adapter_pool.add(key, weights)
    else:
        engine.adapter_pool.add(key, loader=lambda: loader(weights))


def _assert_all_free(engine: Engine) -> None:
    engine.page_pool.check()
    assert engine.page_pool.num_used("kv") == 0
    assert not engine.has_unfinished() and engine.requests == {}
    assert all(d["refcount"] == 0 for d in engine.adapter_pool.describe())


def _expected_and_tight_engine(model_dir, prompts, params) -> tuple[list[list[int]], Engine]:
    """The tokens of (base, x) requests for `prompts` from an engine with room to spare, and an engine of 16
    pages with x@1 resident on 4 of them."""
    roomy = _engine(model_dir, num_pages=40)
    _add_adapter(roomy)
    expected = [o.token_ids for o in roomy.generate(prompts, params, adapters=[None, "x"])]
    engine = _engine(model_dir)
    _add_adapter(engine)
    engine.adapter_pool.load("x@1")
    return expected, engine


def test_a_queued_request_holding_an_adapter_does_not_fail_a_request_that_fits_the_pool_alone(tiny_llama_dir):
    """16 pages; adapter x resident on 4 of them. A 45-token base request takes the other 12; x's request,
    behind it, takes a reference on x but finds no KV page and waits. When the base request outgrows 12
    pages it preempts itself, and x cannot give it pages while the queued request holds x. That request
    must run first and give x back: the base request (63 tokens at most, what the pool holds) must not
    fail with CapacityError, and recomputing it must not change its tokens."""
    prompts = [[3] * 45, [4, 5, 6]]
    params = SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)
    expected, engine = _expected_and_tight_engine(tiny_llama_dir, prompts, params)
    assert engine.page_pool.num_used("adapter") == 4
    outs = engine.generate(prompts, params, adapters=[None, "x"])
    assert [(o.finish_reason, o.error) for o in outs] == [("length", None), ("length", None)]
    assert [o.token_ids for o in outs] == expected
    assert outs[0].num_preemptions >= 1
    _assert_all_free(engine)


@pytest.mark.parametrize("retire", ["replaced", "unregistered"])
def test_a_queued_request_on_a_replaced_version_goes_ahead_of_a_request_that_needs_its_pages(tiny_llama_dir,
                                                                                             retire):
    """As above, but x@1 is replaced (or unregistered) while its request waits, preempted: a replaced version
    cannot be let go and taken again, so its request must run ahead of the base request (and finish on x@1)
    to free x@1's pages. Waiting behind it, the base request failed with CapacityError after 100 steps."""
    prompts = [[3] * 30, [4, 5, 6]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected, engine = _expected_and_tight_engine(tiny_llama_dir, prompts, params)
    engine.add_request("base", prompts[0], params, tenant="t2")
    engine.add_request("lora", prompts[1], params, adapter="x", tenant="t1")
    lora, retired, done = engine.requests["lora"], False, {}
    for _ in range(100_000):  # steps with an adapter copy in flight run nothing: how many, the copy's time says
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not retired and lora.status.name == "WAITING" and lora.output_token_ids:  # preempted, holding x@1
            if retire == "replaced":
                _add_adapter(engine, "x@2", seed=1)  # current once resident; x@1 retires, its request keeps it
                engine.adapter_pool.make_current("x@2")
            else:
                engine.unregister_adapter("x")
            retired = True
        if not engine.has_unfinished():
            break
    assert retired
    assert {k: (o.finish_reason, o.error) for k, o in done.items()} == {"base": ("length", None),
                                                                       "lora": ("length", None)}
    assert [done["base"].token_ids, done["lora"].token_ids] == expected  # lora finished on x@1
    assert done["base"].num_preemptions >= 1 or done["lora"].num_preemptions >= 1


def _serve_with_steady_traffic(engine: Engine, *, adapter_request_at: int, max_steps: int, on_step=None,
                               others_adapter: str | None = None):
    """Keep three other requests (of `others_adapter`) queued every step, so that they take every KV page
    (and adapter slot) that comes back; add one request for adapter x at step `adapter_request_at`.
    Returns (step x's request finished or None, other requests finished meanwhile)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    num_added, others_done = 0, 0
    for step in range(max_steps):
        if engine.num_waiting < 3:
            engine.add_request(f"b{num_added}", [1 + num_added % 200] * 6, params, adapter=others_adapter)
            num_added += 1
        if step == adapter_request_at:
            engine.add_request("lora", [7, 8, 9], params, adapter="x")
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished and out.request_id == "lora":
                return step, others_done
            others_done += out.finished
        if on_step is not None:
            on_step(step)
        if engine.last_batch_size == 0:  # as generate(): nothing ran, only adapter loads and copies can move
            engine.adapter_pool.wait_idle()
    return None, others_done


@pytest.mark.parametrize("lacks", ["pages", "slot"])
def test_a_loaded_adapter_waiting_for_room_is_not_starved_by_a_stream_of_requests(tiny_llama_dir, lacks):
    """Other requests keep arriving and take every KV page finished ones give back (pages: base-model
    requests in a 16-page pool, x needs 4 free pages), or keep the only adapter slot busy (slot: requests
    of adapter a, one slot). x, loaded, never found room. After max_adapter_wait_steps its request is
    no longer overtaken, so the room comes back to x and it runs; the others keep being served."""
    if lacks == "pages":
        engine, others = _engine(tiny_llama_dir, max_adapter_wait_steps=4), None
    else:
        engine, others = _engine(tiny_llama_dir, num_pages=64, max_loras=1, max_adapter_wait_steps=4), "a"
        _add_adapter(engine, "a@1", seed=1)
    _add_adapter(engine)
    done_at, others_done = _serve_with_steady_traffic(engine, adapter_request_at=5, max_steps=200,
                                                    others_adapter=others)
    assert done_at is not None, "the adapter's request was starved"
    assert others_done > 0
    for rid in list(engine.requests):
        engine.abort(rid)
    _assert_all_free(engine)


def test_an_adapter_still_loading_holds_no_other_request_back(tiny_llama_dir):
    """While x's weights are still being read (far longer than max_adapter_wait_steps steps), requests of
    other tenants keep being admitted, and steps take no longer than usual (a step that waited on the load a
    while each time ran as many of them, only slower); once read, x's request is served."""
    import statistics
    import time

    loaded = threading.Event()
    engine = _engine(tiny_llama_dir, max_adapter_wait_steps=4)
    _add_adapter(engine, loader=lambda weights: loaded.wait(30) and weights)
    admitted, ended = [], [time.perf_counter()]

    def on_step(step):
        admitted.append(engine.last_batch_size)
        ended.append(time.perf_counter())
        if step == 40:
            loaded.set()

    done_at, others_done = _serve_with_steady_traffic(engine, adapter_request_at=0, max_steps=300, on_step=on_step)
    assert all(admitted[:40]), "a step ran nothing while the adapter loaded"
    during = [b - a for a, b in zip(ended[:40], ended[1:41], strict=True)]
    after = [b - a for a, b in zip(ended[41:], ended[42:], strict=False)]
    assert statistics.median(during) < max(0.05, 5 * statistics.median(after)), (during, after)
    assert others_done >= 10
    assert done_at is not None and done_at > 40
    for rid in list(engine.requests):
        engine.abort(rid)
    _assert_all_free(engine)


@pytest.mark.parametrize("max_num_batched_tokens", [64, 8])
def test_a_request_outgrowing_what_pinned_adapters_leave_ends_instead_of_looping(tiny_llama_dir,
                                                                                max_num_batched_tokens):
    """16 pages; a 45-token request growing to 63 tokens needs all 16, and a push pins an adapter of 4 pages
    after it was admitted. It ends by length with the tokens it wrote (it can never fit: its context shrank)
    once it outgrows the 12 left, without waiting for the stuck bound, also when prefilled in chunks: those
    fit up to the page it then preempts itself for, so readmitting it chunk by chunk would loop forever."""
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=max_num_batched_tokens)
    engine.add_request("big", [3] * 45, SamplingParams(max_tokens=18, temperature=0, ignore_eos=True))
    engine.adapter_pool.add("p@1", random_weights(0, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    done = []
    for _ in range(50):
        done += [o for o in engine.step() if o.finished]
        if done:
            break
    assert [o.finish_reason for o in done] == ["length"] and done[0].error is None
    assert len(done[0].token_ids) == 12 * 4 + 1 - 45  # those the 12 pages left hold, and the last one sampled
    _assert_all_free(engine)


def test_kv_usage_counts_the_pages_the_kv_cache_could_have(tiny_llama_dir):
    """KV usage (metrics, the sidecar's report, the autoscaler's signal) is KV pages over those the KV cache
    could hold now: free pages and idle adapters' count, pinned adapters' do not, so a pool whose pinned
    adapters hold a quarter of the pages still reads 1.0 once the KV cache fills the rest."""
    engine = _engine(tiny_llama_dir)  # 16 pages of 4-token blocks
    engine.adapter_pool.add("p@1", random_weights(0, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    _add_adapter(engine, "x@1", seed=1)
    engine.adapter_pool.load("x@1")  # idle: reclaimable
    assert engine.page_pool.num_used("adapter") == 8 and engine.kv_usage == 0.0
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("r", [3] * 16, params)
    engine.step()  # prefill: 4 KV pages of the 12 the KV cache could have (4 free, 4 of idle x)
    assert engine.page_pool.num_used("kv") == 4 and engine.kv_usage == pytest.approx(4 / 12)
    engine.add_request("big", [5] * 27, params)
    engine.step()  # r's 17th token and big's 27: 8 more pages, x gives its 4 to the KV cache; the pinned adapter's stay
    assert engine.page_pool.num_used("adapter") == 4 and engine.kv_usage == 1.0


def _run_until_done(engine: Engine, max_steps: int) -> list:
    """Step (adapter copies done between steps) until nothing is left; the finished outputs in order."""
    finished = []
    for _ in range(max_steps):
        finished += [o for o in engine.step() if o.finished]
        engine.adapter_pool.wait_idle()
        if not engine.has_unfinished():
            return finished
    raise AssertionError(f"not done after {max_steps} steps: {list(engine.requests.values())}")


def test_requests_waiting_for_the_adapter_in_the_way_do_not_overtake_a_request_starved_for_room(tiny_llama_dir):
    """One adapter slot, one sequence at a time. e0 takes the slot for e (copy in flight); x's request, behind
    it, finds no slot; e1..e8, behind x, wait for e's copy, and so keep e from being evicted. Whenever nothing
    ran, one of them overtook x's request, until all had run. After max_adapter_wait_steps skips no more may:
    with nothing running, they let go of e, and x takes the slot."""
    engine = _engine(tiny_llama_dir, num_pages=64, max_loras=1, max_num_seqs=1, max_adapter_wait_steps=2)
    _add_adapter(engine, "e@1", seed=1)
    _add_adapter(engine)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("e0", [1, 2], params, adapter="e")
    engine.add_request("x", [7, 8, 9], params, adapter="x")
    for i in range(1, 9):
        engine.add_request(f"e{i}", [1, 2], params, adapter="e")
    finished = _run_until_done(engine, max_steps=200)
    assert [o.error for o in finished] == [None] * 10
    order = [o.request_id for o in finished]
    overtakers = order[1:order.index("x")]  # e0 came first
    assert len(overtakers) <= engine.config.max_adapter_wait_steps, order
    # Requests that let go of e and took it again are one GPU lookup each (the autoscaler's hit rate).
    stats = engine.adapter_pool.stats()
    assert stats["hits"].get("gpu", 0) + stats["misses"].get("gpu", 0) == 10, stats
    _assert_all_free(engine)


@pytest.mark.parametrize("size_known", [True, False])
def test_a_request_whose_adapter_never_finds_room_fails_instead_of_waiting_forever(tiny_llama_dir, size_known):
    """8 pages, 4 held by a pinned adapter: a rank-8 adapter (7 pages) can never be placed, though it fits
    the pool. Its request is refused with ContextLengthError (not retryable): at admission when the adapter is
    in memory, else once it is read, within max_adapter_wait_steps, not the stuck bound. A base request is
    served."""
    from lorafleet.worker.engine_errors import ContextLengthError

    engine = _engine(tiny_llama_dir, num_pages=8, max_adapter_wait_steps=2)
    engine.adapter_pool.add("p@1", random_weights(0, rank=4, projs=ADAPTER_PROJS), pinned=True)
    engine.adapter_pool.load("p@1")
    weights = random_weights(1, rank=8, projs=ADAPTER_PROJS)
    engine.adapter_pool.add("big@1", weights if size_known else None, loader=None if size_known else lambda: weights)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    refusal = "cannot run: .* its adapter big@1 takes 7 and pinned adapters take 4, leaving 0"
    if size_known:
        with pytest.raises(ContextLengthError, match=refusal):
            engine.add_request("lora", [7, 8, 9], params, adapter="big")
    else:
        engine.add_request("lora", [7, 8, 9], params, adapter="big")
    engine.add_request("base", [1, 2, 3], params)
    finished = _run_until_done(engine, max_steps=20)
    outcome = {o.request_id: (o.finish_reason, type(o.exception)) for o in finished}
    assert outcome.pop("base") == ("length", type(None))
    if not size_known:
        assert outcome.pop("lora") == ("error", ContextLengthError)
        assert re.search(refusal, next(o.error for o in finished if o.request_id == "lora"))
    assert outcome == {}
    assert not engine.adapter_pool.entry("big@1").waiters
    _assert_all_free(engine)


def test_an_adapter_pinned_ones_leave_no_room_for_under_the_ceiling_fails_at_once(tiny_llama_dir):
    """--max-adapter-pages 8 with a pinned adapter on 4 of them: one of 7 pages can never be placed. It
    stayed wanted with no error; the scheduler, once it had waited its steps, admitted no one else (another
    tenant's base requests included) until everything running finished and 100 more steps passed, then
    failed it blaming --max-loras, with 15 slots free."""
    engine = _engine(tiny_llama_dir, num_pages=64, max_adapter_pages=8, max_adapter_wait_steps=4, max_num_seqs=4)
    pool = engine.adapter_pool
    pool.add("p@1", random_weights(0, rank=4, projs=ADAPTER_PROJS), pinned=True)
    pool.load("p@1")
    pool.add("big@1", random_weights(1, rank=8, projs=ADAPTER_PROJS))
    assert len(pool.entry("p@1").page_ids) + pool.entry("big@1").image.num_pages > 8
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("lora", [7, 8, 9], params, adapter="big", tenant="t1")
    for i in range(6):
        engine.add_request(f"b{i}", [1, 2, 3], params, tenant="t2")
    done = {}
    for step in range(1000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (step, out.error)
        pool.wait_idle()
        if not engine.has_unfinished():
            break
    assert "pinned adapters hold 4 of the 8 pages adapters may use" in done.pop("lora")[1]
    assert len(done) == 6 and all(error is None for _, error in done.values())
    assert max(step for step, _ in done.values()) < 45  # two rounds of 20 tokens on 4 seats: nobody held back
    _assert_all_free(engine)


def test_a_stuck_request_does_not_wait_forever_while_adapters_trade_the_only_slot(tiny_llama_dir):
    """One GPU slot, two queued adapter requests and a base request that fits only with no adapter on the GPU.
    Letting go of adapters for the stuck one made the two adapters trade the slot every step, a copy always in
    flight; while steps with a copy in flight did not count, nobody ever finished (a copy per step)."""
    import time

    engine = _engine(tiny_llama_dir, max_loras=1)
    copier = engine.adapter_pool._copier

    class SlowCopies:  # each copy takes 50 ms: steps see it in flight, as the trade needs, on any machine
        def __init__(self, executor) -> None:
            self.executor = executor

        def submit(self, fn, *args):
            return self.executor.submit(lambda: (time.sleep(0.05), fn(*args))[1])

    copier.executor = SlowCopies(copier.executor)
    _add_adapter(engine, "x@1", seed=1)
    _add_adapter(engine, "y@1", seed=2)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("r1", [4, 5, 6], params, adapter="x", tenant="t1")
    engine.add_request("r2", [4, 5, 7], params, adapter="y", tenant="t2")
    engine.add_request("s", [3] * 49, params, tenant="t0")  # 13 of 16 pages
    deadline, done = time.monotonic() + 60, {}
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.finish_reason, out.error)
        if not engine.last_batch_size:
            time.sleep(0.005)  # the engine thread's idle wait
    assert done == {"r1": ("length", None), "r2": ("length", None), "s": ("length", None)}
    _assert_all_free(engine)


def test_a_new_version_of_a_pinned_adapter_takes_its_pages_under_the_ceiling(tiny_llama_dir):
    """--max-adapter-pages 8, p@1 pinned on 4 of them, its new version p@2 needs 7: it fits only in p@1's
    place. It stayed wanted with no error (pages were thought to come back), and its requests failed."""
    engine = _engine(tiny_llama_dir, num_pages=64, max_adapter_pages=8, max_adapter_wait_steps=4, max_num_seqs=4)
    pool = engine.adapter_pool
    pool.add("p@1", random_weights(0, rank=4, projs=ADAPTER_PROJS), pinned=True)
    pool.load("p@1")
    old_pages = len(pool.entry("p@1").page_ids)
    pool.add("p@2", random_weights(1, rank=8, projs=ADAPTER_PROJS), pinned=True)  # a push's new version
    assert old_pages + pool.entry("p@2").image.num_pages > 8
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("new", [7, 8, 9], params, adapter="p@2")
    finished = _run_until_done(engine, max_steps=200)
    assert [(o.request_id, o.finish_reason, o.error) for o in finished] == [("new", "length", None)]
    assert pool.resolve("p") == "p@2" and pool.entry("p@2").resident
    _assert_all_free(engine)


@pytest.mark.parametrize("tenants", ["one", "five"])
def test_each_request_that_finds_its_adapter_off_the_gpu_is_a_miss(tiny_llama_dir, tenants):
    """The autoscaler's hit rate: five requests queued for one cold adapter all wait for its load, so all five
    are GPU misses, however many tenants send them (the scheduler reaches those behind the first once it is
    loaded: counted then, they were hits, and a worker loading for every burst read 0.8-0.9). Those arriving
    once it is resident are hits; and a pool whose one slot two adapters take in turn misses every time."""
    engine = _engine(tiny_llama_dir, num_pages=64, max_num_seqs=8, max_loras=1)
    _add_adapter(engine, "cold@1", seed=1)
    _add_adapter(engine, "other@1", seed=2)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def burst(adapter: str, n: int) -> tuple[int, int]:
        before = engine.adapter_pool.stats()
        for i in range(n):
            engine.add_request(None, [1, 2, 3], params, adapter=adapter,
                               tenant="acme" if tenants == "one" else f"t{i}")
        _run_until_done(engine, max_steps=100)
        after = engine.adapter_pool.stats()
        return tuple(after[k].get("gpu", 0) - before[k].get("gpu", 0) for k in ("hits", "misses"))

    assert burst("cold", 5) == (0, 5)
    engine.add_request("keeps-it", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0), adapter="cold")
    assert engine.adapter_pool.stats()["hits"]["gpu"] == 1  # resident as it arrived
    _run_until_done(engine, max_steps=10)
    for _ in range(2):  # one slot, taken in turn: every request waits for a load
        assert burst("other", 4) == (0, 4)
        assert burst("cold", 4) == (0, 4)
    _assert_all_free(engine)


def test_a_request_without_a_seat_in_the_batch_starts_its_adapters_load_at_once(tiny_llama_dir):
    """max_loras_per_batch=1, taken by t1's request on x: t2's request for cold y gets no seat for
    max_adapter_wait_steps steps, but y's read starts as it arrives, so that y is on the GPU when the seat frees
    instead of its load starting only then; both finish with their own tokens."""
    prompts = [[4, 5, 6], [7, 8, 9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    roomy = _engine(tiny_llama_dir, num_pages=40)
    _add_adapter(roomy, "x@1", seed=1)
    _add_adapter(roomy, "y@1", seed=2)
    expected = [o.token_ids for o in roomy.generate(prompts, params, adapters=["x", "y"])]
    engine = _engine(tiny_llama_dir, num_pages=40, max_loras_per_batch=1, max_adapter_wait_steps=1000)
    _add_adapter(engine, "x@1", seed=1)
    engine.adapter_pool.load("x@1")
    _add_adapter(engine, "y@1", loader=lambda w: w, seed=2)
    engine.add_request("x", prompts[0], params, adapter="x", tenant="t1")
    engine.step()
    engine.add_request("y", prompts[1], params, adapter="y", tenant="t2")
    engine.step()
    y = engine.adapter_pool.entry("y@1")
    assert y.fetching is not None or y.image is not None, "y's load waits for a seat"
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [outs[r].token_ids for r in ("x", "y")] == expected
    _assert_all_free(engine)
