"""Presence, frequency and repetition penalties through the engine, on the tiny random Llama (fp32)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from tests.worker.test_engine import _engine, _prompts

MAX_NEW = 24


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **kw)


def test_a_strong_frequency_or_presence_penalty_stops_the_repeats_greedy_makes(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    plain = engine.generate(prompts, _greedy())
    assert any(len(set(o.token_ids)) < len(o.token_ids) for o in plain), "greedy repeats nothing: a weak test"
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        outs = engine.generate(prompts, _greedy(**kw))
        for out, base in zip(outs, plain, strict=True):
            assert len(set(out.token_ids)) == len(out.token_ids), (kw, out.token_ids)
            # Up to the first repeat of the plain run, nothing was penalized yet: the same tokens.
            first_repeat = next((i for i, t in enumerate(base.token_ids) if t in base.token_ids[:i]), MAX_NEW)
            assert out.token_ids[:first_repeat] == base.token_ids[:first_repeat]
    negative = engine.generate(prompts, _greedy(presence_penalty=-2.0))
    assert sum(len(set(o.token_ids)) for o in negative) < sum(len(set(o.token_ids)) for o in plain)


def test_repetition_penalty_matches_transformers(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    for penalty in (1.5, 0.7):
        outs = engine.generate(prompts, _greedy(repetition_penalty=penalty))
        for p, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([p])
            with torch.no_grad():
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                     repetition_penalty=penalty, pad_token_id=0, eos_token_id=None)
            assert out.token_ids == ref[0, len(p):].tolist(), penalty


MIXED = [_greedy(frequency_penalty=1.0, presence_penalty=0.5), _greedy(), _greedy(repetition_penalty=1.3),
         SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=7, presence_penalty=1.5, ignore_eos=True),
         SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=8, ignore_eos=True),
         _greedy(frequency_penalty=-0.5, repetition_penalty=0.9)]


def test_a_mixed_batch_gives_each_request_its_tokens_alone_and_under_preemption(tiny_llama_dir):
    prompts = _prompts()
    engine = _engine(tiny_llama_dir)
    alone = [engine.generate([p], [params])[0].token_ids for p, params in zip(prompts, MIXED, strict=True)]
    mixed = [o.token_ids for o in engine.generate(prompts, MIXED)]
    assert mixed == alone
    # n > 1: choices of one prompt, each its own sequence with counts of its own.
    n = [o.token_ids for o in engine.generate([prompts[3]] * 3, [MIXED[3], MIXED[0], MIXED[3]])]
    assert n == [alone[3], engine.generate([prompts[3]], [MIXED[0]])[0].token_ids, alone[3]]
    tight = _engine(tiny_llama_dir, num_pages=16)  # requests get preempted and recomputed
    assert [o.token_ids for o in tight.generate(prompts, MIXED)] == alone
    assert tight.scheduler.num_preemptions > 0
    chunked = _engine(tiny_llama_dir, max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked.generate(prompts, MIXED)] == alone


def test_logit_bias_and_min_p_through_the_engine_leave_other_requests_alone(tiny_llama_dir):
    from lorafleet.worker.engine_errors import EngineError

    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    plain = engine.generate(prompts, _greedy())
    banned = {t: -100.0 for o in plain[:2] for t in o.token_ids}
    params = [_greedy(logit_bias=banned), _greedy(logit_bias={42: 100.0}), _greedy(), _greedy(min_p=0.5),
              SamplingParams(max_tokens=MAX_NEW, temperature=1.3, min_p=1.0, seed=1, ignore_eos=True), _greedy()]
    outs = engine.generate(prompts, params)  # one batch
    assert not set(outs[0].token_ids) & set(banned)
    assert outs[1].token_ids == [42] * MAX_NEW
    assert outs[2].token_ids == plain[2].token_ids and outs[5].token_ids == plain[5].token_ids
    assert outs[3].token_ids == plain[3].token_ids  # min_p does not change the greedy choice
    assert outs[4].token_ids == plain[4].token_ids  # min_p 1 keeps only the most likely token
    with pytest.raises(EngineError, match="logit_bias"):
        engine.add_request(None, prompts[0], _greedy(logit_bias={engine.model_config.vocab_size: 1.0}))



@pytest.mark.gpu
def test_penalties_kept_on_the_device_match_with_and_without_cuda_graphs(tiny_llama_dir):
    """The kept counts live on the device: each request gets its tokens alone, in one mixed batch and with
    n > 1, with CUDA-graph decode steps and without."""
    prompts = _prompts()
    outs = {}
    for graphs in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32", block_size=16,
                                     max_num_seqs=8, pool_bytes=64 << 20, cuda_graphs=graphs))
        alone = [engine.generate([p], [params])[0].token_ids for p, params in zip(prompts, MIXED, strict=True)]
        mixed = [o.token_ids for o in engine.generate(prompts, MIXED)]
        n = [o.token_ids for o in engine.generate([prompts[3]] * 3, [MIXED[3], MIXED[0], MIXED[3]])]
        assert mixed == alone and n[0] == n[2] == alone[3]
        assert (engine.runner.graphs is not None and engine.runner.graphs.replays > 5) == graphs
        outs[graphs] = mixed
    assert outs[True] == outs[False]
