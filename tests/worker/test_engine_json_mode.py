"""JSON mode (`SamplingParams(json_object=True)`) through the engine on the tiny random Llama (fp32, one
token per byte). A random model wanders, so whatever holds here holds because of the constraint; a +100
`logit_bias` on EOS makes EOS the choice whenever it may be drawn, which tests that it may be drawn only
once the object is complete."""

from __future__ import annotations

import codecs
import json
from dataclasses import replace

import pytest

from lorafleet.worker import SamplingParams
from lorafleet.worker.json_constraint import START, advance, is_complete
from lorafleet.worker.json_guide import JsonModeError
from tests.worker.conftest import EOS_ID
from tests.worker.test_engine import _engine, _prompts

EOS_FIRST = {EOS_ID: 100.0}
MAX_NEW = 40


def _json(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_NEW)
    return SamplingParams(json_object=True, **kw)


def _mixed_params(n: int, **kw) -> list[SamplingParams]:
    """Greedy and sampled rows, half of them eager to end (EOS biased)."""
    return [_json(temperature=0.0 if i % 3 == 0 else 1.0, seed=i, logit_bias=EOS_FIRST if i % 2 else None, **kw)
            for i in range(n)]


def _body(engine, out) -> bytes:
    """The output's bytes, without a final stop token."""
    ids = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
    return b"".join(engine.sampler.json_guide.vocab.token_bytes(t) for t in ids)


def _check(engine, outs, params) -> int:
    """Every output is a JSON object's prefix; a stopped one a whole object. Returns how many stopped."""
    stopped = 0
    for out, p in zip(outs, params, strict=True):
        body = _body(engine, out)
        state = advance(START, body)
        assert state is not None, out.text
        codecs.getincrementaldecoder("utf-8")().decode(body)  # well-formed UTF-8 (a last character may be cut)
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == EOS_ID and is_complete(state)
            assert isinstance(json.loads(out.text), dict)
            assert EOS_ID not in out.token_ids[:-1]
            stopped += 1
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens and not is_complete(state)
    return stopped


def test_outputs_are_json_object_prefixes_and_stopped_ones_parse(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompts = _prompts() * 2
    params = _mixed_params(len(prompts))
    outs = engine.generate(prompts, params)
    assert _check(engine, outs, params) >= 2
    # EOS at +100 is drawn the moment it may be: right after the token that completes the object.
    for out, p in zip(outs, params, strict=True):
        if p.logit_bias and out.finish_reason == "stop":
            assert not is_complete(advance(START, _body(engine, out)[:-1]))


def _braces_first(engine) -> dict[int, float]:
    """EOS first, then '{' and '}' whenever they may come: greedy rows write `{}` and end."""
    (open_id,), (close_id,) = (engine.tokenizer.encode(c, add_special_tokens=False) for c in "{}")
    return {**EOS_FIRST, open_id: 30.0, close_id: 30.0}


def test_a_complete_object_only_takes_stop_tokens(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = _prompts()[1]
    ended = engine.generate([prompt], _json(temperature=0.0, logit_bias=_braces_first(engine)))[0]
    assert ended.finish_reason == "stop" and ended.text == "{}" and len(ended.token_ids) == 3
    # ignore_eos: EOS would end nothing, so after the object only JSON's trailing whitespace may come.
    out = engine.generate([prompt], _json(temperature=0.0, logit_bias=_braces_first(engine), ignore_eos=True,
                                          max_tokens=len(ended.token_ids) + 3))[0]
    assert out.token_ids[:2] == ended.token_ids[:2] and out.finish_reason == "length" and len(out.token_ids) == 6
    assert EOS_ID not in out.token_ids and json.loads(out.text) == {} and not out.text[2:].strip(" \t\n\r")
    # A stop token id ends a complete object like EOS; before that it is never drawn.
    stop_id = ord("x")
    out = engine.generate([prompt], _json(temperature=1.0, seed=5, logit_bias={stop_id: 8.0},
                                          stop_token_ids=[stop_id], max_tokens=80))[0]
    assert stop_id not in out.token_ids[:-1]
    assert out.finish_reason == "length" or is_complete(advance(START, _body(engine, out)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_pads_a_complete_object_with_whitespace_not_eos(tiny_llama_dir, temperature):
    """ignore_eos asks for max_tokens tokens: after the object they are JSON's trailing whitespace, so the
    output stays one JSON text and no EOS id lands in it; a stop token id still ends the request."""
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    bias = _braces_first(engine)
    params = [_json(temperature=temperature, seed=i, logit_bias=bias, ignore_eos=True, max_tokens=12)
              for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 12 and EOS_ID not in out.token_ids
        assert isinstance(json.loads(out.text), dict), out.text
        body = _body(engine, out)
        end = len(body.rstrip(b" \t\n\r"))
        assert is_complete(advance(START, body[:end])) and end < len(body)
    stop = _json(temperature=temperature, seed=1, logit_bias=bias, ignore_eos=True, stop_token_ids=[EOS_ID],
                 max_tokens=12)
    out = engine.generate([prompts[0]], stop)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS_ID and json.loads(out.text) == {}


def test_min_tokens_keeps_the_object_open_until_it_may_end(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = _prompts()[2]
    for k in (1, 2, 4, 9):
        params = _json(temperature=0.0, logit_bias=_braces_first(engine), min_tokens=k)
        out = engine.generate([prompt], params)[0]
        assert _check(engine, [out], [params]) == 1
        # `{}` unless min_tokens holds the '}' back: then the object completes at token k, and EOS follows.
        assert len(out.token_ids) == max(k, 2) + 1, out.text


def test_unconstrained_rows_are_bit_identical_and_raw_logprobs_unchanged(tiny_llama_dir):
    # Blocks a run keeps were computed in other chunks than a later run computes them in, so the later run's
    # last bits differ (as chunked prefill's do): bit identity between runs is checked without prefix caching.
    engine = _engine(tiny_llama_dir, enable_prefix_caching=False)
    prompts = _prompts()
    # ignore_eos everywhere: every row runs its 12 tokens, so each batch below keeps its shape at every step
    plain = [SamplingParams(max_tokens=12, temperature=t, seed=i, logprobs=3, presence_penalty=0.5 * (i % 2),
                            ignore_eos=True)
             for i, t in enumerate([0.0, 1.0, 0.8, 0.0, 1.0, 1.0][: len(prompts)])]
    json_params = [_json(max_tokens=12, temperature=0.0 if i % 3 == 0 else 1.0, seed=i, logprobs=3, ignore_eos=True)
                   for i in range(len(prompts))]
    doubled = [p for p in prompts for _ in (0, 1)]
    mixed = engine.generate(doubled, [p for pair in zip(plain, json_params, strict=True) for p in pair])
    assert all(o.finish_reason == "length" for o in mixed)
    # The same batch with the JSON rows' constraint off: the plain rows must not see a bit of difference.
    free = [replace(p, json_object=False) for p in json_params]
    alone = engine.generate(doubled, [p for pair in zip(plain, free, strict=True) for p in pair])[0::2]
    for a, m in zip(alone, mixed[0::2], strict=True):
        assert m.token_ids == a.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in m.logprobs] == \
               [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs]
    assert [o.token_ids for o in engine.generate(prompts, plain)] == [o.token_ids for o in alone]
    # A JSON row's logprobs are the model's: its first step's alternatives are the unconstrained row's.
    for a, j in zip(alone, mixed[1::2], strict=True):
        assert j.logprobs[0].top == a.logprobs[0].top
        assert len(j.logprobs) == len(j.token_ids)


def test_seeds_repeat_whatever_the_batch(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    params = [_json(temperature=1.0, top_p=0.9, top_k=40, seed=7 + i, repetition_penalty=1.2) for i in range(len(prompts))]
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    alone = engine.generate([prompts[2]], params[2])[0]
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert alone.token_ids == first[2].token_ids
    _check(engine, first, params)


@pytest.mark.parametrize("config", [{"num_pages": 12}, {"max_num_batched_tokens": 5}])
def test_preemption_and_chunked_prefill_keep_outputs(tiny_llama_dir, config):
    prompts = _prompts()
    params = _mixed_params(len(prompts), max_tokens=16)  # the longest prompt (30) still fits 12 pages of 4
    ref = _engine(tiny_llama_dir).generate(prompts, params)
    engine = _engine(tiny_llama_dir, **config)
    outs = engine.generate(prompts, params)
    if "num_pages" in config:
        assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    _check(engine, outs, params)


def test_n_choices_differ_and_all_hold(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    params = [_json(temperature=1.0, seed=100 + j, logit_bias=EOS_FIRST) for j in range(6)]
    outs = engine.generate([_prompts()[0]] * 6, params)
    _check(engine, outs, params)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_a_failing_row_fails_only_its_request(tiny_llama_dir, monkeypatch):
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()[:3]
    params = [_json(temperature=0.0, max_tokens=8), SamplingParams(max_tokens=8, temperature=0.0),
              _json(max_tokens=8, seed=3)]
    ref = engine.generate(prompts, params)
    guide = engine.sampler.json_guide
    state = guide.state

    def broken(seq):
        if seq.request_id == "bad":
            raise JsonModeError("JSON mode: test failure")
        return state(seq)

    monkeypatch.setattr(guide, "state", broken)
    for rid, prompt, p in zip(("bad", "plain", "ok"), prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].finish_reason == "error" and "test failure" in done["bad"].error
    assert done["plain"].token_ids == ref[1].token_ids and done["ok"].token_ids == ref[2].token_ids
    assert engine.page_pool.num_used("kv") == 0


@pytest.mark.gpu
def test_json_mode_in_cuda_graph_decode_steps(tiny_llama_dir):
    """The forward is replayed from a graph; sampling, and so the constraint, runs on its logits after it."""
    prompts = _prompts()
    params = _mixed_params(len(prompts)) + [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)]
    _eager_and_graphs(tiny_llama_dir, prompts + prompts[:1], params, lambda e, outs: _check(e, outs[:-1], params[:-1]))


def _eager_and_graphs(model_dir, prompts, params, check) -> None:
    """The batch run eagerly and from CUDA graphs: the same tokens, and check(engine, outputs) >= 1 each time."""
    from lorafleet.worker import Engine, EngineConfig

    outs = {}
    for graphs in (False, True):
        engine = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", block_size=16,
                                     max_num_seqs=8, pool_bytes=64 << 20, cuda_graphs=graphs))
        outs[graphs] = engine.generate(prompts, params)
        assert (engine.runner.graphs is not None and engine.runner.graphs.replays > 5) == graphs
        assert check(engine, outs[graphs]) >= 1
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]


SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "bc"]}, "n": {"type": "integer"},
                                           "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
          "required": ["k", "n"]}


def _schema_batch(prompts: list[list[int]]) -> list[SamplingParams]:
    """Schema rows (EOS biased, room to finish) beside JSON-mode and unconstrained rows in one batch."""
    from lorafleet.worker.json_schema_grammar import schema_grammar

    grammar = schema_grammar(SCHEMA)
    out = []
    for i in range(len(prompts)):
        kind = ({"grammar": grammar}, {"json_object": True}, {})[i % 3]
        eager = i % 3 == 0 or i % 4 < 2
        out.append(SamplingParams(max_tokens=4 * MAX_NEW if i % 3 == 0 else MAX_NEW, temperature=0.0 if i % 2 else 1.0,
                                  seed=i, logit_bias=EOS_FIRST if eager else None, **kind))
    return out


def _check_schema_rows(engine, outs, params) -> int:
    """Each schema row's output is a prefix of a value SCHEMA takes, and a stopped one such a value."""
    stopped = 0
    for out, p in zip(outs, params, strict=True):
        if p.grammar is None:
            continue
        state = p.grammar.advance(p.grammar.start, _body(engine, out))
        assert state is not None, out.text
        if out.finish_reason == "stop":
            value = json.loads(out.text)
            assert p.grammar.is_complete(state) and value["k"] in ("a", "bc") and isinstance(value["n"], int)
            stopped += 1
    return stopped


def test_schema_rows_hold_in_a_batch_with_json_mode_and_plain_rows(tiny_llama_dir):
    """Each row follows its own grammar; a row's tokens do not depend on its neighbours (seeded)."""
    engine = _engine(tiny_llama_dir)
    prompts = _prompts() * 2
    params = _schema_batch(prompts)
    outs = engine.generate(prompts, params)
    assert _check_schema_rows(engine, outs, params) >= 1
    _check(engine, [o for o, p in zip(outs, params, strict=True) if p.json_object and p.grammar is None],
           [p for p in params if p.json_object and p.grammar is None])
    alone = [engine.generate([prompts[i]], params[i])[0] for i in range(0, len(prompts), 3)]
    assert [o.token_ids for o in alone] == [outs[i].token_ids for i in range(0, len(prompts), 3)]


@pytest.mark.gpu
def test_schema_rows_in_cuda_graph_decode_steps(tiny_llama_dir):
    prompts = _prompts() * 2
    params = _schema_batch(prompts)
    _eager_and_graphs(tiny_llama_dir, prompts, params, lambda e, outs: _check_schema_rows(e, outs, params))


def test_a_request_failing_at_its_first_step_leaves_no_block_kept(tiny_llama_dir, monkeypatch):
    """The last blocks of a sequence that failed are not kept for later requests (prefix_cache.py): a row failing in
    the step that computed its prompt left those blocks kept."""
    engine = _engine(tiny_llama_dir)
    guide = engine.sampler.json_guide
    monkeypatch.setattr(guide, "state", lambda seq: (_ for _ in ()).throw(JsonModeError("JSON mode: test failure")))
    engine.add_request("bad", list(range(3, 20)), _json(max_tokens=4))
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert done["bad"].finish_reason == "error" and engine.block_manager.prefix_cache.num_blocks == 0
