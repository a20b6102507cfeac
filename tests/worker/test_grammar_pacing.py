"""Grammar pacing (worker/grammar_pacing.py): guided decodes whose estimated grammar time passes a step's budget
take turns, so one request's costly masks cannot make every tenant's step long; tokens are unchanged."""

from __future__ import annotations

import pytest

from lorafleet.worker import SamplingParams
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.grammar_pacing import observe, pace
from lorafleet.worker.sequence import Sequence
from tests.worker.test_engine import _engine, _prompts


def _rows(*costs: float) -> list[Sequence]:
    rows = [Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=8)) for i in range(len(costs))]
    for row, cost in zip(rows, costs, strict=True):
        row.grammar_cost = cost
    return rows


def test_rows_within_the_budget_all_go():
    rows = _rows(0.0, 0.01, 0.02, 0.0)
    assert pace(rows, 0.05) == (rows, 0)
    assert pace(rows, None) == (rows, 0)


def test_past_the_budget_cheap_rows_go_and_one_costly_row_a_step():
    plain, cheap_a, cheap_b, costly_a, costly_b, costly_c = rows = _rows(0.0, 0.001, 0.002, 0.25, 0.25, 0.25)
    kept, held = pace(rows, 0.1)
    assert kept == [plain, cheap_a, cheap_b, costly_a] and held == 2  # in the running order
    assert (costly_b.grammar_waits, costly_c.grammar_waits, costly_a.grammar_waits) == (1, 1, 0)
    # Those left out go first at the next step, in turn; the cheap rows and the plain one go every step.
    assert pace(rows, 0.1)[0] == [plain, cheap_a, cheap_b, costly_b]
    assert pace(rows, 0.1)[0] == [plain, cheap_a, cheap_b, costly_c]
    assert pace(rows, 0.1)[0] == [plain, cheap_a, cheap_b, costly_a]


def test_every_row_moves_on_within_as_many_steps_as_rows_compete():
    rows = _rows(*[0.03 * (1 + i % 4) for i in range(12)])
    last_ran = dict.fromkeys(r.seq_id for r in rows)
    for step in range(60):
        kept, _ = pace(rows, 0.1)
        assert sum(r.grammar_cost for r in kept) <= 0.1 + 0.12  # the budget, and one row past it
        for r in kept:
            assert last_ran[r.seq_id] is None or step - last_ran[r.seq_id] <= len(rows)
            last_ran[r.seq_id] = step
    assert all(step - s <= len(rows) for s in last_ran.values())


def test_the_estimate_follows_the_measures():
    (row,) = _rows(0.0)
    observe(row, 0.2)
    assert row.grammar_cost == 0.2
    observe(row, 0.001)  # a mask found cached: the costly draw is remembered for a few draws
    assert row.grammar_cost == pytest.approx(0.1)
    observe(row, 0.001)
    observe(row, 0.001)
    assert row.grammar_cost == pytest.approx(0.025)
    observe(row, 0.3)
    assert row.grammar_cost == 0.3


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
    """A budget of 0 s: every guided decode is past it, so one goes a step, in turn, while the plain requests
    decode at every step. Greedy and seeded rows write the same tokens as with no bound."""
    prompts = _prompts()[:4]
    params = [SamplingParams(max_tokens=12, json_object=True, temperature=0.0),
              SamplingParams(max_tokens=12, json_object=True, temperature=1.0, seed=7),
              SamplingParams(max_tokens=12, json_object=True, temperature=0.8, seed=8),
              SamplingParams(max_tokens=12, temperature=0.0)]
    free = _engine(tiny_llama_dir, max_grammar_seconds_per_step=None)
    paced = _engine(tiny_llama_dir, max_grammar_seconds_per_step=0.0)
    steps = _recorded(paced)
    want = free.generate(prompts, params)
    got = paced.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    guided = [[s for s in decodes if s.params.json_object] for decodes in steps]
    assert max(len(g) for g in guided) == 1
    assert paced.scheduler.num_grammar_deferrals > 0 and free.scheduler.num_grammar_deferrals == 0
    # The plain request decoded at every step until it ended: its 11 decodes in its first 11 steps with decodes.
    plain = [i for i, decodes in enumerate(steps) if any(not s.params.json_object for s in decodes)]
    assert plain == list(range(plain[0], plain[0] + 11))


async def test_metrics_count_the_turns_waited(aiohttp_client, tiny_llama_dir):
    """Three JSON-mode requests taking turns (a budget of 0 s): /metrics reports the turns the scheduler made
    them wait."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    from lorafleet.worker.app_keys import ENGINE
    from lorafleet.worker.server import create_app
    from lorafleet.worker.worker_config import WorkerConfig

    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_pages=64,
                          max_grammar_seconds_per_step=0.0)
    client = await aiohttp_client(create_app(WorkerConfig(engine=config, served_model_name="tiny")))
    engine = client.app[ENGINE]
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
    for graphs, budget in ((False, None), (True, 0.0)):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32", block_size=16,
                                     max_num_seqs=8, pool_bytes=64 << 20, cuda_graphs=graphs,
                                     max_grammar_seconds_per_step=budget))
        outs[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        assert (engine.scheduler.num_grammar_deferrals > 0) == graphs
        assert (engine.runner.graphs is not None and engine.runner.graphs.replays > 5) == graphs
    assert outs[True] == outs[False]
