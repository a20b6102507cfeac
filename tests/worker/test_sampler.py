"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.sampler import Sampler
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence

VOCAB = 50


def _seq(seed=None, **kw):
    seq = Sequence("r", [1], SamplingParams(seed=seed, **kw))
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def _logits(n=1, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(4)
    out = Sampler().sample(logits, [_seq(temperature=0.0) for _ in range(4)])
    assert [t for t, _ in out] == logits.argmax(-1).tolist()
    assert all(lp is None for _, lp in out)


def test_top_k_one_is_greedy_even_with_temperature():
    logits = _logits(3, seed=1)
    out = Sampler().sample(logits, [_seq(temperature=1.5, top_k=1) for _ in range(3)])
    assert [t for t, _ in out] == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support():
    logits = _logits(1, seed=2)
    sampler = Sampler(seed=3)
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True).tolist()
    nucleus, mass = set(), 0.0
    for t in order:  # smallest prefix reaching 0.6
        nucleus.add(t)
        mass += probs[t].item()
        if mass >= 0.6:
            break
    seen_k, seen_p = set(), set()
    for _ in range(300):
        seen_k.add(sampler.sample(logits, [_seq(temperature=2.0, top_k=5)])[0][0])
        seen_p.add(sampler.sample(logits, [_seq(top_p=0.6)])[0][0])
    assert seen_k <= top5 and len(seen_k) > 1
    assert seen_p <= nucleus and len(seen_p) >= min(2, len(nucleus))


def test_temperature_follows_the_distribution():
    # Two tokens, logits 0 and log(3): p = 1/4, 3/4. With 2000 seeded draws the share of the likely
    # token lies far from the greedy 100% and from uniform 50%.
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, 0], logits[0, 1] = 0.0, torch.log(torch.tensor(3.0))
    sampler = Sampler(seed=0)
    draws = [sampler.sample(logits, [_seq()])[0][0] for _ in range(2000)]
    share = draws.count(1) / len(draws)
    assert set(draws) <= {0, 1} and 0.65 < share < 0.85


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _logits(4, seed=4)
    alone = [Sampler(seed=9).sample(logits[2:3], [_seq(seed=42)])[0][0] for _ in range(1)]
    seqs = [_seq(), _seq(seed=7), _seq(seed=42), _seq(temperature=0.0)]
    batched = Sampler(seed=123).sample(logits, seqs)[2][0]
    assert alone[0] == batched
    # The same seed gives the same stream of tokens; another seed gives another stream.
    streams = []
    for seed in (42, 42, 43):
        seq = _seq(seed=seed)
        streams.append([Sampler().sample(logits[2:3], [seq])[0][0] for _ in range(20)])
    assert streams[0] == streams[1] != streams[2]


def test_logprobs_of_chosen_and_top_alternatives():
    logits = _logits(2, seed=5)
    out = Sampler().sample(logits, [_seq(temperature=0.0, logprobs=3), _seq(temperature=0.0)])
    token, lp = out[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == token and lp.logprob == pytest.approx(ref[token].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-6)
    assert out[1][1] is None


def test_logprobs_zero_gives_only_the_chosen_token():
    out = Sampler().sample(_logits(1), [_seq(logprobs=0)])
    assert out[0][1].top == [] and out[0][1].token_id == out[0][0]


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=-1),
                                dict(logprobs=21), dict(stop=[""])])
def test_invalid_params_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_tiny_temperature_is_greedy_not_nan(temperature):
    # logits / 1e-38 overflow to inf and softmax gives NaN (argmax then picks token 0); as vLLM, a
    # temperature below 1e-5 samples greedily.
    logits = _logits(3, seed=6)
    out = Sampler().sample(logits, [_seq(temperature=temperature, seed=s) for s in range(3)])
    assert [t for t, _ in out] == logits.argmax(-1).tolist()
