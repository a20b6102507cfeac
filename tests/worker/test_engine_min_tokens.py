"""vLLM's `min_tokens`, `stop_token_ids` and `include_stop_str_in_output` through the engine, on the tiny
random Llama (fp32). A +100 `logit_bias` on EOS makes EOS the greedy choice at every step, so a request
ends at once unless `min_tokens` holds EOS back."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.sampler import Sampler, apply_min_tokens
from lorafleet.worker.sequence import Sequence
from tests.worker.conftest import EOS_ID
from tests.worker.test_engine import _engine, _prompts

MAX_NEW = 24
EOS_FIRST = {EOS_ID: 100.0}  # EOS is the argmax whenever it may be drawn


def _greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_NEW)
    return SamplingParams(temperature=0.0, **kw)


def test_min_tokens_holds_eos_back_until_k_tokens_then_eos_ends_without_text(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = _prompts()[1]
    plain = engine.generate([prompt], _greedy(ignore_eos=True))[0].token_ids
    assert EOS_ID not in plain[:8]
    eager = engine.generate([prompt], _greedy(logit_bias=EOS_FIRST))[0]
    assert eager.token_ids == [EOS_ID] and eager.finish_reason == "stop" and eager.text == ""
    for k in (1, 5, 8):
        out = engine.generate([prompt], _greedy(logit_bias=EOS_FIRST, min_tokens=k))[0]
        # The first k tokens are the model's choices with EOS masked, then EOS ends the request.
        assert out.token_ids == plain[:k] + [EOS_ID] and out.finish_reason == "stop", k
        assert out.text == engine.tokenizer.decode(plain[:k])
    # Sampled requests too; min_tokens == max_tokens: exactly max_tokens tokens, none of them EOS.
    for params in (SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=3, logit_bias=EOS_FIRST, min_tokens=6),
                   _greedy(max_tokens=7, logit_bias=EOS_FIRST, min_tokens=7)):
        out = engine.generate([prompt], params)[0]
        assert EOS_ID not in out.token_ids[: params.min_tokens] and len(out.token_ids) >= params.min_tokens
        assert out.finish_reason == ("stop" if params.min_tokens < params.max_tokens else "length")
    # ignore_eos: EOS is neither a stop token nor masked.
    out = engine.generate([prompt], _greedy(max_tokens=4, logit_bias=EOS_FIRST, min_tokens=2, ignore_eos=True))[0]
    assert out.token_ids == [EOS_ID] * 4


def test_stop_token_ids_end_at_the_first_one_and_min_tokens_masks_them(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = _prompts()[3]
    plain = engine.generate([prompt], _greedy(ignore_eos=True))[0].token_ids
    stop_id = plain[3]
    first = plain.index(stop_id)
    unseen = next(t for t in range(256) if t not in plain)  # a second stop id that never comes up
    out = engine.generate([prompt], _greedy(stop_token_ids=[unseen, stop_id]))[0]
    assert out.token_ids[-1] == stop_id and out.finish_reason == "stop"
    assert out.token_ids[:-1] == plain[:first] and stop_id not in out.token_ids[:-1]
    assert out.text == engine.tokenizer.decode(plain[:first])  # the stop token is not text, like EOS
    kept = engine.generate([prompt], _greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True))[0]
    assert kept.token_ids == out.token_ids and kept.text == engine.tokenizer.decode(plain[: first + 1])
    # min_tokens past the stop id's first occurrence: the id is never drawn before min_tokens tokens.
    k = first + 3
    held = engine.generate([prompt], _greedy(stop_token_ids=[stop_id], min_tokens=k))[0]
    assert stop_id not in held.token_ids[:k] and len(held.token_ids) >= k
    assert held.token_ids[:first] == plain[:first] and held.token_ids[first] != stop_id
    assert held.finish_reason == "length" or held.token_ids.index(stop_id) == len(held.token_ids) - 1


def test_stop_strings_are_not_searched_before_min_tokens(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompt = _prompts()[1]
    plain = engine.generate([prompt], _greedy(ignore_eos=True))[0]
    stop = plain.text[:1]
    assert stop and stop != "\ufffd"
    early = engine.generate([prompt], _greedy(ignore_eos=True, stop=[stop]))[0]
    assert early.finish_reason == "stop" and early.text == "" and len(early.token_ids) == 1
    kept = engine.generate([prompt], _greedy(ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == stop
    held = engine.generate([prompt], _greedy(ignore_eos=True, stop=[stop], min_tokens=6))[0]
    assert len(held.token_ids) >= 6 and held.token_ids == plain.token_ids[: len(held.token_ids)]
    assert held.text.startswith(stop) and plain.text.startswith(held.text)


def test_apply_min_tokens_masks_only_the_rows_below_min_tokens():
    greedy = dict(max_tokens=8, temperature=0.0)
    params = [SamplingParams(**greedy), SamplingParams(**greedy, min_tokens=3, stop_token_ids=[5, 7]),
              SamplingParams(**greedy, min_tokens=3, ignore_eos=True, stop_token_ids=[5]),
              SamplingParams(**greedy, min_tokens=2, stop_token_ids=[5])]
    seqs = [Sequence(str(i), [1, 2], p) for i, p in enumerate(params)]
    seqs[3].output_token_ids = [4, 4]  # already has its min_tokens: not masked
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    logits[:, [5, 9, 7]] += torch.tensor([30.0, 20.0, 10.0])  # the stop tokens lead every row, 5 first
    eos = frozenset({9})
    out = apply_min_tokens(logits, seqs, eos)
    assert torch.isinf(out[1, [5, 7, 9]]).all() and torch.isinf(out[2, 5])
    assert torch.isinf(out).sum() == 4 and out[2, 9] == logits[2, 9]
    assert torch.equal(out[[0, 3]], logits[[0, 3]])  # bit for bit
    assert apply_min_tokens(logits, [seqs[0], seqs[3]], eos) is logits  # nothing to mask: no copy
    tokens = [t for t, _ in Sampler(eos_token_ids=[9]).sample(logits, seqs)]
    assert tokens[1] not in (5, 7, 9) and tokens[2] == 9
    assert tokens[0] == tokens[3] == 5  # unmasked rows: their argmax


MIXED = [_greedy(logit_bias=EOS_FIRST, min_tokens=5), _greedy(), _greedy(ignore_eos=True),
         SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=7, logit_bias=EOS_FIRST, min_tokens=9),
         _greedy(logit_bias=EOS_FIRST, min_tokens=12, frequency_penalty=1.0),
         SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=8, ignore_eos=True, logprobs=2)]


def test_a_mixed_batch_gives_each_request_its_tokens_alone_and_under_preemption(tiny_llama_dir):
    prompts = _prompts()
    engine = _engine(tiny_llama_dir)
    alone = [engine.generate([p], [params])[0].token_ids for p, params in zip(prompts, MIXED, strict=True)]
    for ids, params in zip(alone, MIXED, strict=True):
        assert EOS_ID not in ids[: params.min_tokens] and len(ids) >= params.min_tokens
    assert [ids[-1] for ids, p in zip(alone, MIXED, strict=True) if p.min_tokens] == [EOS_ID] * 3
    assert [o.token_ids for o in engine.generate(prompts, MIXED)] == alone
    # n > 1: choices of one request, each its own sequence counting its own tokens.
    n = [o.token_ids for o in engine.generate([prompts[3]] * 3, [MIXED[3], MIXED[0], MIXED[3]])]
    assert n == [alone[3], engine.generate([prompts[3]], [MIXED[0]])[0].token_ids, alone[3]]
    tight = _engine(tiny_llama_dir, num_pages=16)  # requests get preempted and recomputed
    assert [o.token_ids for o in tight.generate(prompts, MIXED)] == alone
    assert tight.scheduler.num_preemptions > 0
    chunked = _engine(tiny_llama_dir, max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked.generate(prompts, MIXED)] == alone


@pytest.mark.gpu
def test_min_tokens_in_cuda_graph_decode_steps(tiny_llama_dir):
    prompts = _prompts()
    outs = {}
    for graphs in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32", block_size=16,
                                     max_num_seqs=8, pool_bytes=64 << 20, cuda_graphs=graphs))
        outs[graphs] = [o.token_ids for o in engine.generate(prompts, MIXED)]
        assert (engine.runner.graphs is not None and engine.runner.graphs.replays > 5) == graphs
    assert outs[True] == outs[False]
    for ids, params in zip(outs[True], MIXED, strict=True):
        assert EOS_ID not in ids[: params.min_tokens] and len(ids) >= params.min_tokens
