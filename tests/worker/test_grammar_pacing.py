"""Grammar pacing (worker/grammar_pacing.py): guided decodes whose estimated grammar time passes a step's budget
take turns, so one request's costly masks cannot make every tenant's step long; tokens are unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lorafleet.worker import SamplingParams
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.grammar_pacing import DEFAULT_BUILD_S, HALF_LIFE_S, GrammarCosts, pace
from lorafleet.worker.sequence import Sequence
from tests.worker.test_engine import _engine, _prompts


def _rows(*costs: float, tenant: str | None = None) -> list[Sequence]:
    rows = [Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=8, json_object=cost > 0), tenant=tenant)
            for i, cost in enumerate(costs)]
    for row, cost in zip(rows, costs, strict=True):
        row.grammar_cost = cost
    return rows


def own(seq: Sequence) -> float:
    return seq.grammar_cost


def test_rows_within_the_budget_all_go():
    rows = _rows(0.0, 0.01, 0.02, 0.0)
    assert pace(rows, 0.05, own) == (rows, 0)
    assert pace(_rows(0.3, 0.3), 0.0, own)[1] == 0  # 0: no bound


def test_past_the_budget_cheap_rows_go_and_one_costly_row_a_step():
    plain, cheap_a, cheap_b, costly_a, costly_b, costly_c = rows = _rows(0.0, 0.001, 0.002, 0.25, 0.25, 0.25)
    kept, held = pace(rows, 0.1, own)
    assert kept == [plain, cheap_a, cheap_b, costly_a] and held == 2  # in the running order
    assert (costly_b.grammar_waits, costly_c.grammar_waits, costly_a.grammar_waits) == (1, 1, 0)
    # Those left out go first at the next step, in turn; the cheap rows and the plain one go every step.
    assert pace(rows, 0.1, own)[0] == [plain, cheap_a, cheap_b, costly_b]
    assert pace(rows, 0.1, own)[0] == [plain, cheap_a, cheap_b, costly_c]
    assert pace(rows, 0.1, own)[0] == [plain, cheap_a, cheap_b, costly_a]
    assert costly_a.grammar_waits == 0 and costly_b.grammar_waits == 2  # a row that goes waits no more


def test_every_row_moves_on_within_as_many_steps_as_rows_compete():
    rows = _rows(*[0.03 * (1 + i % 4) for i in range(12)])
    last_ran = dict.fromkeys(r.seq_id for r in rows)
    for step in range(60):
        kept, _ = pace(rows, 0.1, own)
        assert sum(r.grammar_cost for r in kept) <= 0.1 + 0.12  # the budget, and one row past it
        for r in kept:
            assert last_ran[r.seq_id] is None or step - last_ran[r.seq_id] <= len(rows)
            last_ran[r.seq_id] = step
    assert all(step - s <= len(rows) for s in last_ran.values())


def test_a_row_is_charged_a_mask_build_where_its_state_has_none_cached():
    """A row's own draws may have been cheap (masks found cached, or none needed) until its state is one no mask
    was built for: a fresh request of a costly grammar got in on a cheap estimate and built its masks in the
    same step as every other. Its estimate now adds a build (its own last, or its grammar's, else its tenant's,
    else DEFAULT_BUILD_S), weighted by how often its draws are refused."""
    uncached: set[int] = set()
    now = [0.0]
    costs = GrammarCosts(lambda seq: seq.seq_id in uncached, clock=lambda: now[0])
    hostile, fresh, other, honest = _rows(1e-4, 1e-4, 1e-4, 1e-4, tenant="globex")
    other.tenant, honest.tenant = "acme", "acme"
    hostile.params.grammar = fresh.params.grammar = SimpleNamespace(key="costly")
    costs.observe(hostile, 0.3, refused=True, built=True)
    assert costs.estimate(hostile) == pytest.approx(1e-4)  # its state's mask is cached: its own draws' cost
    uncached.update((hostile.seq_id, fresh.seq_id, other.seq_id))
    assert costs.estimate(hostile) == costs.estimate(fresh) == pytest.approx(0.3001)  # a new row: refused, as far as known
    assert costs.estimate(other) == pytest.approx(1e-4 + DEFAULT_BUILD_S)  # nothing known of acme's builds
    fresh.params.grammar = SimpleNamespace(key="new pattern")  # another grammar of globex's: its tenant's builds
    assert costs.estimate(fresh) == pytest.approx(0.3001)
    # An honest row whose state is cached is not charged for the costly rows of the same schema.
    honest.params.grammar = hostile.params.grammar
    kept, held = pace([hostile, fresh, honest], 0.05, costs.estimate)
    assert honest in kept and held == 1
    costs.observe(honest, 0.001, refused=False, built=False)
    costs.observe(honest, 0.0, refused=False, built=False)
    assert honest.grammar_cost == pytest.approx(0.0005)  # the larger of the last and half the one before


def test_cheap_builds_beside_costly_ones_do_not_lower_the_grammars_cost():
    """A tenant's cheap rows of the same grammar, building after its costly ones each step, halved the grammar's
    build cost at every build: its costly rows were estimated at a millisecond and all ran in one step. A
    grammar's (and tenant's) cost is the costliest recent build, halving with time, and a row's own builds count."""
    now = [0.0]
    costs = GrammarCosts(lambda seq: True, clock=lambda: now[0])
    costly, cheap = _rows(1e-4, 1e-4, tenant="globex")
    costly.params.grammar = cheap.params.grammar = SimpleNamespace(key="mixed")
    costs.observe(costly, 0.3, refused=True, built=True)
    for _ in range(8):
        costs.observe(cheap, 0.001, refused=True, built=True)
    assert costs.estimate(costly) >= 0.3 and costs.estimate(cheap) >= 0.3
    now[0] += HALF_LIFE_S
    assert costs.estimate(cheap) == pytest.approx(1e-4 + 0.15, rel=1e-3)
    costs.observe(costly, 0.3, refused=True, built=True)
    now[0] += 10 * HALF_LIFE_S
    assert costs.estimate(costly) >= 0.15  # its own builds stay its own


def test_an_honest_row_whose_draws_fit_is_charged_little_for_an_uncached_state():
    """A build happens only when the drawn token is refused: an honest row's draws mostly fit its grammar, and
    charging it a whole build at every uncached state held honest schema rows back (421 turns waited by 64
    rows whose real grammar work was 27 ms). Its charge is weighted by its refusal rate."""
    costs = GrammarCosts(lambda seq: True, clock=lambda: 0.0)
    (row,) = _rows(1e-4)
    row.params.grammar = SimpleNamespace(key="schema")
    costs.observe(row, 0.005, refused=True, built=True)
    assert costs.estimate(row) == pytest.approx(1e-4 + 0.25 * 0.005 + 0.75 * 0.005)  # a new row: as refused
    for _ in range(10):
        costs.observe(row, 1e-4, refused=False, built=False)
    assert costs.estimate(row) < 1e-4 + 0.06 * 0.005


def test_a_grammars_first_mask_is_built_before_its_request_joins_the_batch():
    """prepare() (a request's thread, before the engine's step) builds the tries and the first state's mask: the
    request's first draw, at the end of its prompt, which no estimate paces, builds none."""
    from lorafleet.worker.json_vocab import JsonVocab
    from lorafleet.worker.regex_grammar import RegexGrammar

    vocab = JsonVocab([bytes([c]) for c in range(97, 123)] + [b"ab", b"zz"])
    grammar = RegexGrammar("[a-m]+z")
    vocab.prepare(grammar)
    assert vocab.has_mask(grammar.start, True, grammar) and vocab.num_built == 1
    vocab.mask(grammar.start, True, grammar)
    assert vocab.num_built == 1


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="max_grammar_seconds_per_step must be >= 0"):
        EngineConfig(max_grammar_seconds_per_step=-1.0)


def _recorded(engine) -> list[list[Sequence]]:
    """Each step's decodes, recorded as the engine's scheduler hands them out."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append(list(batch.decodes))
        return batch

    engine.scheduler.schedule = recording
    return steps


def test_guided_rows_take_turns_and_keep_their_tokens(tiny_llama_dir):
    """Every guided decode estimated past the budget (1 s against 0.1): one goes a step, in turn, while the plain
    request decodes at every step. Greedy and seeded rows write the same tokens as with no bound."""
    prompts = _prompts()[:4]
    params = [SamplingParams(max_tokens=12, json_object=True, temperature=0.0),
              SamplingParams(max_tokens=12, json_object=True, temperature=1.0, seed=7),
              SamplingParams(max_tokens=12, json_object=True, temperature=0.8, seed=8),
              SamplingParams(max_tokens=12, temperature=0.0)]
    free = _engine(tiny_llama_dir, max_grammar_seconds_per_step=0.0)
    paced = _engine(tiny_llama_dir, max_grammar_seconds_per_step=0.1)
    paced.scheduler.grammar_estimate = lambda seq: 1.0
    steps = _recorded(paced)
    want = free.generate(prompts, params)
    got = paced.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    guided = [[s for s in decodes if s.params.json_object] for decodes in steps]
    assert max(len(g) for g in guided) == 1
    assert paced.scheduler.num_grammar_deferrals > 0 and free.scheduler.num_grammar_deferrals == 0
    # The sampler told the draws that built a mask (JSON mode's, the requests' tenant's) from those that did not.
    builds = free.sampler.grammar_costs._builds
    assert builds.keys() == {("grammar", "json_object"), ("tenant", "base")} and all(seconds > 0 for seconds, _ in builds.values())
    # The plain request decoded at every step until it ended: its 11 decodes in its first 11 steps with decodes.
    plain = [i for i, decodes in enumerate(steps) if any(not s.params.json_object for s in decodes)]
    assert plain == list(range(plain[0], plain[0] + 11))


async def test_metrics_count_the_turns_waited(aiohttp_client, tiny_llama_dir):
    """Three JSON-mode requests taking turns (each estimated past the budget): /metrics reports the turns the
    scheduler made them wait."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    from lorafleet.worker.app_keys import ENGINE
    from lorafleet.worker.server import create_app
    from lorafleet.worker.worker_config import WorkerConfig

    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_pages=64,
                          max_grammar_seconds_per_step=0.1)
    client = await aiohttp_client(create_app(WorkerConfig(engine=config, served_model_name="tiny")))
    engine = client.app[ENGINE]
    engine.engine.scheduler.grammar_estimate = lambda seq: 1.0  # every guided decode past the budget
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, json_object=True)
    await asyncio.wrap_future(engine.call(lambda e: e.generate(_prompts()[:3], params)))
    text = await (await client.get("/metrics")).text()
    s = {m.name: m.value for fam in text_string_to_metric_families(text) for m in fam.samples}
    assert s["lorafleet_guided_decodes_deferred_total"] == engine.engine.scheduler.num_grammar_deferrals >= 9


@pytest.mark.gpu
def test_guided_rows_taking_turns_in_cuda_graph_decode_steps(tiny_llama_dir):
    """Decode steps replayed from graphs hold fewer rows while guided ones take turns (other batch sizes, other
    graphs): the same tokens as an eager run with no bound."""
    from lorafleet.worker import Engine

    prompts = _prompts()[:4]
    params = [SamplingParams(max_tokens=16, json_object=True, temperature=0.0),
              SamplingParams(max_tokens=16, json_object=True, temperature=1.0, seed=3),
              SamplingParams(max_tokens=16, json_object=True, temperature=0.7, seed=4),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]
    outs = {}
    for graphs, budget in ((False, 0.0), (True, 0.1)):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32", block_size=16,
                                     max_num_seqs=8, pool_bytes=64 << 20, cuda_graphs=graphs,
                                     max_grammar_seconds_per_step=budget))
        engine.scheduler.grammar_estimate = lambda seq: 1.0  # past the budget where there is one
        outs[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        assert (engine.scheduler.num_grammar_deferrals > 0) == graphs
        assert (engine.runner.graphs is not None and engine.runner.graphs.replays > 5) == graphs
    assert outs[True] == outs[False]


@pytest.mark.parametrize(("pages", "num", "prompt", "max_tokens"), [(5, 5, 4, 8), (5, 5, 3, 8), (4, 5, 3, 8)])
def test_under_kv_pressure_taking_turns_leaves_no_step_empty(pages, num, prompt, max_tokens):
    """Rows were held before the step's preemptions: the row kept could be the one preempted for pages, and the
    step ran nothing while held rows waited (3 empty steps of 36 here). Now the rows held are chosen among
    those the step kept once its preemptions are made."""
    from lorafleet.worker.block_manager import BlockManager
    from lorafleet.worker.page_pool import PagePool, PagePoolConfig
    from lorafleet.worker.scheduler import Scheduler

    sched = Scheduler(BlockManager(PagePool(PagePoolConfig(num_pages=pages, page_elems=8)), 4), max_num_seqs=8,
                      max_num_batched_tokens=64, max_grammar_seconds_per_step=0.05)
    sched.min_stuck_s = 0.0
    for i in range(num):
        sched.add(Sequence(f"r{i}", list(range(prompt)), SamplingParams(max_tokens=max_tokens, json_object=True)))
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.failed.clear()
        steps += 1
        assert steps < 500
        assert not batch.is_empty or not (sched.running or sched.waiting), f"step {steps} ran nothing"
        for seq, k in batch.scheduled:
            seq.num_computed_tokens += k
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(1)
                seq.grammar_cost = 0.3  # each row's draws cost past the budget
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq, "length")
    assert sched.num_grammar_deferrals > 0


def test_a_new_row_starts_from_its_grammars_refusal_rate():
    """Every new row counted as refused until its own draws said otherwise: after one slow build of their schema,
    32 honest rows went one a step for most of a run (1702 turns waited over 85 steps, against 24 unpaced). A
    row's first draw now starts from its grammar's rate; one of a grammar never seen, as refused."""
    costs = GrammarCosts(lambda seq: True, clock=lambda: 0.0)
    old, new, stranger = _rows(1e-4, 1e-4, 1e-4)
    stranger.tenant = "globex"  # nothing known of its tenant's builds either
    old.params.grammar = new.params.grammar = SimpleNamespace(key="schema")
    stranger.params.grammar = SimpleNamespace(key="unseen")
    costs.observe(old, 0.1, refused=True, built=True)
    for _ in range(40):
        costs.observe(old, 1e-4, refused=False, built=False)
    assert costs.estimate(new) < 1e-4 + 0.2 * 0.1  # no draw yet: its grammar's rate
    costs.observe(new, 1e-4, refused=False, built=False)
    assert new.grammar_refusals < 0.2
    assert costs.estimate(stranger) == pytest.approx(1e-4 + DEFAULT_BUILD_S)


async def test_prepares_take_turns_between_tenants(tiny_llama_dir):
    """Grammars are prepared one at a time (each holds the interpreter lock the engine's steps need), but by
    tenants' turns: a tenant's queue of costly prepares holds another tenant's guided request for at most the
    one running, and a request that leaves while queued is never prepared."""
    import asyncio
    import threading

    from lorafleet.worker.async_engine import AsyncEngine
    from lorafleet.worker.regex_grammar import RegexGrammar

    engine = _engine(tiny_llama_dir)
    ae = AsyncEngine(engine)
    await ae.start()
    order, names, release, running = [], {}, threading.Event(), threading.Event()
    try:
        await asyncio.wait_for(asyncio.wrap_future(engine.sampler.json_guide.prepare()), 60)
        vocab = engine.sampler.json_guide.vocab
        prepare = vocab.prepare

        def gated(grammar, may_complete=True):
            order.append(names[id(grammar)])
            running.set()
            assert release.wait(60), "the test never released the prepare"
            prepare(grammar, may_complete)

        vocab.prepare = gated

        async def request(rid: str, tenant: str):
            grammar = RegexGrammar(f"{rid}[a-z]*")
            names[id(grammar)] = rid
            params = SamplingParams(max_tokens=2, temperature=0.0, grammar=grammar)
            return [out async for out in ae.generate(rid, _prompts()[0], params, tenant=tenant)]

        first = asyncio.create_task(request("a", "busy"))
        assert await asyncio.to_thread(running.wait, 60)
        queued = [asyncio.create_task(request(rid, "busy")) for rid in ("b", "c", "d")]
        await asyncio.sleep(0)  # queued in order
        other = asyncio.create_task(request("z", "other"))
        leaving = asyncio.create_task(request("y", "leaves"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert ae._preparer.queued() == 5  # b, c, d, z and y wait their turns
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        for _ in range(1000):  # the cancellation reaches the queued job through a callback on this loop
            if ae._preparer.queued() == 4:
                break
            await asyncio.sleep(0.001)
        assert ae._preparer.queued() == 4  # y's job left its queue: it is never prepared
        release.set()
        outs = await asyncio.wait_for(asyncio.gather(first, *queued, other), 60)
        assert all(stream[-1].finished for stream in outs)
        assert order[:2] == ["a", "z"]  # the other tenant next, before the busy one's queue
        assert sorted(order) == list("abcdz")  # "y" left while queued: not prepared
    finally:
        release.set()
        await ae.stop()
