"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs, penalties, logit_bias, min_p."""

from __future__ import annotations

import random

import pytest
import torch

from lorafleet.worker import sampler as sampler_module
from lorafleet.worker.sampler import (
    Sampler,
    _processed_probs,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
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
                                dict(logprobs=21), dict(stop=[""]), dict(presence_penalty=2.01),
                                dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0),
                                dict(repetition_penalty=-1.0), dict(repetition_penalty=float("inf")),
                                dict(repetition_penalty=float("nan")), dict(presence_penalty=float("nan")),
                                dict(min_p=-0.1), dict(min_p=1.01), dict(logit_bias={-1: 1.0}),
                                dict(logit_bias={3: 100.5}), dict(logit_bias={3: float("nan")})])
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


def _reference_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row, token by token: vLLM's order (repetition over prompt and output, then frequency, then presence)."""
    p, row = seq.params, logits.clone()
    counts: dict[int, int] = {}
    for t in seq.output_token_ids:
        counts[t] = counts.get(t, 0) + 1
    for t in set(seq.prompt_token_ids) | set(seq.output_token_ids):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, c in counts.items():
        row[t] = row[t] - p.frequency_penalty * c
        row[t] = row[t] - p.presence_penalty
    return row


def _history_seq(rng: random.Random, vocab: int, **kw) -> Sequence:
    seq = _seq(**kw)
    seq.prompt_token_ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    seq.output_token_ids = [rng.randrange(vocab // 4) for _ in range(rng.randrange(0, 30))]  # repeats likely
    return seq


PENALTIES = [{}, dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(repetition_penalty=1.3),
             dict(repetition_penalty=0.6), dict(presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.8),
             dict(frequency_penalty=-1.0)]


@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_a_per_sequence_reference(seed):
    rng = random.Random(seed)
    seqs = [_history_seq(rng, VOCAB, temperature=0.0, **rng.choice(PENALTIES)) for _ in range(12)]
    seqs[0].params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    seqs[0].output_token_ids = []  # no output yet: nothing to penalize
    logits = _logits(len(seqs), seed=seed)
    got = apply_penalties(logits.clone(), seqs)
    for i, seq in enumerate(seqs):
        ref = _reference_penalties(logits[i], seq)
        if seq.params.has_penalties:
            torch.testing.assert_close(got[i], ref, rtol=0, atol=1e-6)
        else:
            assert torch.equal(got[i], logits[i])  # untouched, bit for bit
    assert torch.equal(got[0], logits[0])
    out = Sampler().sample(logits, seqs)
    assert [t for t, _ in out] == [int(_reference_penalties(logits[i], s).argmax()) for i, s in enumerate(seqs)]


def test_a_batch_without_penalties_is_left_alone():
    logits = _logits(3, seed=7)
    seqs = [_seq(temperature=0.0), _seq(seed=1), _seq(top_k=5, seed=2)]
    assert apply_penalties(logits, seqs) is logits


def test_penalties_change_the_greedy_choice_as_expected():
    logits = torch.zeros(1, VOCAB)
    logits[0, :4] = torch.tensor([5.0, 4.5, 4.0, -1.0])
    prompt, output = [3, 9], [0, 0, 0, 1]

    def greedy(**kw) -> int:
        seq = _seq(temperature=0.0, **kw)
        seq.prompt_token_ids, seq.output_token_ids = list(prompt), list(output)
        return Sampler().sample(logits, [seq])[0][0]

    assert greedy() == 0
    assert greedy(presence_penalty=1.2) == 2  # 0 and 1 both seen: 3.8, 3.3 < 4.0
    assert greedy(presence_penalty=0.6) == 0  # 4.4 > 4.0 > 3.9
    assert greedy(frequency_penalty=0.4) == 1  # 5 - 1.2 = 3.8, 4.5 - 0.4 = 4.1 > 4.0
    assert greedy(presence_penalty=-2.0) == 0 and greedy(frequency_penalty=-0.5) == 0  # negative: repeat more
    assert greedy(repetition_penalty=1.3) == 2  # 5 / 1.3 = 3.85, 4.5 / 1.3 = 3.46 < 4.0 (prompt token 3 stays < 0)
    assert greedy(repetition_penalty=0.5) == 0  # r < 1 favours the seen tokens
    logits[0, 3] = 4.9  # a prompt token: repetition penalizes it, frequency and presence do not
    assert greedy(repetition_penalty=1.3) == 2 and greedy(presence_penalty=2.0) == 3


def test_negative_logits_are_multiplied_by_the_repetition_penalty():
    logits = torch.tensor([[-1.0, -2.0, 0.0, -1.5]])
    seq = _seq(temperature=0.0, repetition_penalty=2.0, logprobs=2)
    seq.prompt_token_ids = [2, 0]
    got = apply_penalties(logits, [seq])
    assert got.tolist() == [[-2.0, -2.0, 0.0, -1.5]]
    token, lp = Sampler().sample(logits, [seq])[0]
    assert token == 2
    # Logprobs stay those of the model's raw distribution, as without penalties.
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item(), abs=1e-6)


def test_penalties_leave_other_rows_bit_identical_when_sampling():
    logits = _logits(4, seed=8)
    plain = [_seq(seed=s, top_p=0.9, logprobs=2) for s in range(4)]
    alone = Sampler().sample(logits, plain)
    mixed = [*plain]
    penalized = _seq(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.5)
    penalized.output_token_ids = list(range(VOCAB // 2))
    mixed[1] = penalized
    for s in range(4):
        if s != 1:
            plain[s].generator.manual_seed(s)
    out = Sampler().sample(logits, mixed)
    for i in (0, 2, 3):
        assert out[i][0] == alone[i][0]
        assert out[i][1].logprob == alone[i][1].logprob and out[i][1].top == alone[i][1].top
    assert out[1][0] == int(_reference_penalties(logits[1], penalized).argmax())


def _reference_min_p(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """One row: the tokens min_p keeps after temperature (probability >= min_p * the largest)."""
    probs = torch.softmax(logits / temperature, -1)
    return probs >= min_p * probs.max()


def test_logit_bias_is_added_to_the_raw_logits_of_the_rows_that_set_it():
    rng = random.Random(0)
    biases = [None, {3: -100.0}, {0: 2.5, 49: -0.5, 7: 100.0}, None, {rng.randrange(VOCAB): rng.uniform(-100, 100)
                                                                      for _ in range(20)}]
    seqs = [_seq(temperature=0.0, logit_bias=b) for b in biases]
    logits = _logits(len(seqs), seed=10)
    got = apply_logit_bias(logits.clone(), seqs)
    for i, b in enumerate(biases):
        ref = logits[i].clone()
        for t, v in (b or {}).items():
            ref[t] += v
        assert torch.equal(got[i], ref)
    assert apply_logit_bias(logits, [_seq(), _seq(temperature=0.0)]) is logits


def test_logit_bias_comes_before_the_penalties_and_moves_the_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, :3] = torch.tensor([5.0, 4.0, 3.0])

    def greedy(**kw) -> tuple[int, float]:
        seq = _seq(temperature=0.0, logprobs=0, **kw)
        seq.prompt_token_ids, seq.output_token_ids = [0], []
        token, lp = Sampler().sample(logits, [seq])[0]
        return token, lp.logprob

    assert greedy()[0] == 0
    assert greedy(logit_bias={0: -100.0})[0] == 1
    assert greedy(logit_bias={2: 100.0})[0] == 2
    # Bias first, then the repetition penalty (token 0 is in the prompt): (5 + 2) / 2 = 3.5 < 4, so token 1;
    # the penalty first would give 5 / 2 + 2 = 4.5 > 4, token 0.
    assert greedy(logit_bias={0: 2.0}, repetition_penalty=2.0)[0] == 1
    # Logprobs stay those of the model's raw distribution.
    assert greedy(logit_bias={2: 100.0})[1] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item(), abs=1e-6)


def test_min_p_keeps_what_a_reference_keeps_and_leaves_other_rows_alone():
    logits = _logits(6, seed=11)
    params = [SamplingParams(temperature=t, min_p=m, top_k=k) for t, m, k in
              ((1.0, 0.0, 0), (0.7, 0.1, 0), (1.5, 0.3, 0), (1.0, 0.0, 5), (1.0, 1.0, 0), (0.5, 0.05, 3))]
    got = _processed_probs(logits, params)
    without = _processed_probs(logits, [SamplingParams(temperature=p.temperature, top_k=p.top_k) for p in params])
    for i, p in enumerate(params):
        if p.min_p == 0.0:
            assert torch.equal(got[i], without[i])  # bit for bit
            continue
        keep = _reference_min_p(logits[i], p.temperature, p.min_p)
        if p.top_k:
            keep &= logits[i] >= logits[i].topk(p.top_k).values[-1]
        assert torch.equal(got[i] > 0, keep)
        ref = torch.softmax(logits[i] / p.temperature, -1) * keep
        torch.testing.assert_close(got[i], ref / ref.sum(), rtol=0, atol=1e-6)
    assert (got[4] > 0).sum() == 1  # min_p 1: only the most likely token


def test_min_p_restricts_sampling_but_not_the_greedy_choice():
    logits = _logits(1, seed=12)
    keep = _reference_min_p(logits[0], 2.0, 0.2)
    sampler = Sampler(seed=5)
    seen = {sampler.sample(logits, [_seq(temperature=2.0, min_p=0.2)])[0][0] for _ in range(300)}
    assert seen <= set(keep.nonzero().flatten().tolist()) and len(seen) > 1
    assert Sampler().sample(logits, [_seq(temperature=0.0, min_p=0.9)])[0][0] == int(logits.argmax())


def test_rows_without_logit_bias_or_min_p_are_bit_identical_in_a_mixed_batch():
    logits = _logits(6, seed=13)

    def plain() -> list[Sequence]:
        return [_seq(seed=s, top_p=0.9, logprobs=2) if s % 2 else _seq(temperature=0.0, logprobs=1) for s in range(6)]

    alone = Sampler().sample(logits, plain())
    mixed = plain()
    mixed[1] = _seq(seed=101, min_p=0.2, logit_bias={0: 5.0})
    mixed[2] = _seq(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0})
    mixed[3] = _seq(seed=103, min_p=0.5)
    out = Sampler().sample(logits, mixed)
    for i in (0, 4, 5):
        assert out[i][0] == alone[i][0]
        assert out[i][1].logprob == alone[i][1].logprob and out[i][1].top == alone[i][1].top
    assert out[2][0] != int(logits[2].argmax())
    assert out[3][0] in _reference_min_p(logits[3], 1.0, 0.5).nonzero().flatten().tolist()


def test_min_tokens_and_logit_bias_tensors_kept_over_steps_follow_the_batch():
    """The sampler reuses the last step's index tensors while the same sequences sample in the same rows;
    whenever a row changes (a sequence joins, leaves, moves or passes min_tokens) they are built again."""
    rng = random.Random(3)
    biases = [None, {3: -100.0, 7: 2.0}, {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(10)}, {0: 50.0}]
    seqs = [_seq(temperature=0.0, logit_bias=biases[i % 4], min_tokens=i % 5, max_tokens=20, stop_token_ids=[i])
            for i in range(8)]
    sampler, eos = Sampler(eos_token_ids=[9]), frozenset({9})
    for step in range(12):
        batch = rng.sample(seqs, rng.randrange(1, len(seqs))) if step % 3 else seqs[:5]
        logits = _logits(len(batch), seed=step)
        one_off = apply_logit_bias(apply_min_tokens(logits, batch, eos), batch)
        kept = apply_min_tokens(logits, batch, eos, sampler._min_tokens_index)
        kept = apply_logit_bias(kept, batch, sampler._logit_bias_index)
        assert torch.equal(kept, one_off)
        for seq, (token, _) in zip(batch, sampler.sample(logits, batch), strict=True):
            assert token == int(one_off[batch.index(seq)].argmax())
            seq.output_token_ids.append(token)


def test_kept_index_tensors_are_rebuilt_for_other_sequences_in_the_same_rows():
    """Same rows, same number of sequences, but other sequences (other options): nothing of the last step's
    tensors is reused."""
    sampler, eos = Sampler(eos_token_ids=[9]), frozenset({9})
    first = [_seq(temperature=0.0, logit_bias={1: 5.0}, min_tokens=3, stop_token_ids=[2]) for _ in range(2)]
    then = [_seq(temperature=0.0, logit_bias={4: -5.0}, min_tokens=3, stop_token_ids=[6], ignore_eos=True)
            for _ in range(2)]
    logits = _logits(2)
    for batch in (first, then, first):
        kept = apply_min_tokens(logits, batch, eos, sampler._min_tokens_index)
        kept = apply_logit_bias(kept, batch, sampler._logit_bias_index)
        assert torch.equal(kept, apply_logit_bias(apply_min_tokens(logits, batch, eos), batch))


def test_a_top_p_one_row_keeps_its_whole_distribution_beside_rows_that_cut():
    # With a vocabulary of Llama's size, float32 cumulative sums reach 1 before the tail ends: a row asking
    # top_p 1 lost its tail tokens (and was renormalised) once another row of the batch set top_p < 1.
    torch.manual_seed(3)
    logits = torch.randn(4, 32000) * 3
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (1.0, 0.5, 1.0, 0.9)]
    mixed = _processed_probs(logits, params)
    alone = _processed_probs(logits, [SamplingParams(temperature=1.0)] * 4)
    for i in (0, 2):
        assert torch.equal(mixed[i], alone[i])  # bit for bit: nothing dropped, nothing rescaled
        assert bool((mixed[i] > 0).all())
    assert (mixed[1] > 0).sum() < 32000 and (mixed[3] > 0).sum() < 32000
    torch.testing.assert_close(mixed[1].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("kw", [{"top_p": 1e-50}, {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300},
                                {"repetition_penalty": 1e-30, "temperature": 1e-4}])
def test_parameters_beyond_float32_still_draw_a_likely_token(kw):
    """A top_p that is 0 in float32 keeps the most likely token (vLLM's top-p always keeps one), and penalties
    that are 0 or inf in float32, or that overflow the logits, draw among the top tokens: never a NaN row, whose
    draw fell on token 0 every step."""
    torch.manual_seed(0)
    logits = torch.randn(2, 64) * 3
    logits[:, 0] = -30.0  # token 0: the least likely
    params = SamplingParams(max_tokens=4, temperature=kw.pop("temperature", 1.0), seed=5, **kw)
    seqs = [Sequence("a", [7, 9], params), Sequence("b", [3], params)]
    for seq in seqs:
        seq.generator = torch.Generator().manual_seed(1)
    tokens = [t for t, _ in Sampler().sample(apply_penalties(logits.clone(), seqs), seqs)]
    assert 0 not in tokens, tokens
    if "top_p" in kw:  # one token left: the most likely
        assert tokens == logits.argmax(dim=-1).tolist()


def _sorted_reference(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Top-k, then top-p, by sorting whole rows: their definition, one row at a time."""
    rows = []
    for row, p in zip(logits, params, strict=True):
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            row = row.masked_fill(row < row.sort(descending=True).values[p.top_k - 1], float("-inf"))
        probs = torch.softmax(row, -1)
        if p.top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            drop = ordered.cumsum(0) - ordered >= p.top_p
            drop[0] = False
            probs = probs.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), 0.0)
            probs = probs / probs.sum()
        rows.append(probs)
    return torch.stack(rows)


@pytest.mark.parametrize("spread", ["peaked", "flat", "ties"])
def test_top_k_and_top_p_keep_what_sorting_whole_rows_keeps(spread):
    """Top-k takes the k-th logit from a top-k of the largest k asked for, and top-p sorts only the most probable
    tokens where they reach top_p (else the whole row): the tokens kept and their probabilities are those of
    sorting each whole row, for peaked and flat rows, rows mixing top-k, top-p, both and neither, and tied
    logits (of which a sort keeps either: the same values are kept)."""
    gen = torch.Generator().manual_seed(7)
    vocab = 5000  # more than the 1024 tokens top-p sorts first
    logits = torch.randn(12, vocab, generator=gen) * {"peaked": 6.0, "flat": 0.05, "ties": 1.0}[spread]
    if spread == "ties":
        logits = logits.round()  # a few distinct values, each held by many tokens
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              ((1.0, 0, 0.9), (0.7, 40, 1.0), (1.3, 0, 1.0), (1.0, 50, 0.8), (0.5, 4999, 0.95), (1.0, 1, 0.5),
               (2.0, 0, 0.999), (1.0, 3000, 0.3), (0.8, 0, 1e-6), (1.0, 0, 0.5), (1.0, 10, 1.0), (1.0, 0, 1.0))]
    ref = _sorted_reference(logits, params)
    alone = torch.cat([_processed_probs(logits[i:i + 1], [p]) for i, p in enumerate(params)])
    for got in (_processed_probs(logits, params), alone):
        for i in range(len(params)):
            if spread == "ties":
                torch.testing.assert_close(got[i].sort().values, ref[i].sort().values, rtol=1e-6, atol=1e-9)
            else:
                assert torch.equal(got[i] > 0, ref[i] > 0), i
                torch.testing.assert_close(got[i], ref[i], rtol=1e-6, atol=1e-9)
    kept = (got > 0).sum(dim=-1).tolist()
    assert kept[11] == vocab and (spread == "ties" or (kept[1], kept[5]) == (40, 1))  # neither; top-k alone; k 1
    if spread != "ties":  # top-p 0.9 alone: found in the first 1024 tokens, or not (the whole row sorted)
        assert (kept[0] < 1024) == (spread == "peaked")


def test_only_rows_whose_most_probable_tokens_do_not_reach_top_p_are_sorted_whole(monkeypatch):
    """Top-p sorts a row's 1024 most probable tokens; a row where they do not reach top_p (a flat one) is sorted
    whole, alone: the rows beside it keep bit for bit what they get without it, tied tokens at the cut
    included, so a seeded request draws the same token whatever shares its batch."""
    sorted_rows = []
    real = sampler_module._sorted_drop
    monkeypatch.setattr(sampler_module, "_sorted_drop", lambda probs, *a: sorted_rows.append(len(probs)) or real(probs, *a))
    gen = torch.Generator().manual_seed(3)
    vocab = 5000
    peaked = torch.randn(6, vocab, generator=gen) * 6
    peaked[5, :4] = peaked[5].max() + 1  # four tokens tied first: top_p 0.3 cuts among them
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in
              ((0, 0.9), (0, 1.0), (40, 1.0), (0, 1e-50), (50, 0.8), (0, 0.3))]
    flat = torch.randn(1, vocab, generator=gen) * 0.05
    alone = _processed_probs(peaked, params)
    assert sorted_rows == []  # every row's first tokens reach its top_p
    beside = _processed_probs(torch.cat([peaked, flat]), [*params, SamplingParams(temperature=1.0, top_p=0.9)])
    assert sorted_rows == [1]  # the flat row alone
    assert torch.equal(beside[:6], alone)
    assert (alone[3] > 0).sum() == 1 and (alone[1] > 0).sum() == vocab  # top_p 1e-50: one token; 1: all
    draws = []
    for rows, ps in ((peaked[5:6], params[5:6]), (torch.cat([peaked[5:6], flat]), [params[5], SamplingParams(top_p=0.9)])):
        seqs = [_seq(seed=11, top_p=p.top_p) for p in ps]
        draws.append(Sampler().sample(rows, seqs)[0][0])
    assert draws[0] == draws[1] < 4


class _Guide:
    """JSON mode's guide reduced to its answers: the tokens each request may draw."""

    def __init__(self, valid: dict[str, list[int]]) -> None:
        self.valid = valid

    def needs_mask(self, seq) -> bool:
        return False

    def accepts(self, seq, token: int) -> bool:
        return token in self.valid[seq.request_id]

    def invalid(self, seq, device) -> torch.Tensor:
        mask = torch.ones(VOCAB, dtype=torch.bool, device=device)
        mask[self.valid[seq.request_id]] = False
        return mask


def _json_seq(rid: str, seed=None, **kw):
    seq = Sequence(rid, [1], SamplingParams(json_object=True, seed=seed, **kw))
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def test_refused_json_rows_draw_again_among_their_valid_tokens_together_as_alone():
    """Rows whose token the guide refuses draw again among their valid tokens, all at once: a greedy row takes its
    best valid token, or its first valid one when every valid token's logit is -inf; a sampled row its race over
    the valid tokens, or where top-k left none of them, the same draw among them filtered alone (here all but
    certainly the best valid token). Each row draws what it draws alone; an accepted row keeps its token."""
    logits = _logits(12, seed=21)
    logits[1, [7, 9]] = float("-inf")
    logits[2:10, [2, 4, 6, 8]] = 5.0  # four equally likely valid tokens: seeds differ in what they draw
    logits[10, [12, 13, 14, 41]] = torch.tensor([-20.0, -20.0, 10.0, 29.0])  # top-k 2 leaves none of 12-14 valid
    logits[:, 40] = 30.0  # what each draws first: refused, but by the last row
    valid = {"greedy": [3, 5, 11], "dead": [9, 7], "top_k": [12, 13, 14], "kept": [40],
             **{f"s{i}": [2, 4, 6, 8] for i in range(8)}}
    seqs = lambda: [_json_seq("greedy", temperature=0.0), _json_seq("dead", temperature=0.0),  # noqa: E731
                    *[_json_seq(f"s{i}", seed=100 + i) for i in range(8)], _json_seq("top_k", seed=4, top_k=2),
                    _json_seq("kept", seed=5)]
    batch = Sampler(json_guide=_Guide(valid)).sample(logits, seqs())
    alone = [Sampler(json_guide=_Guide(valid)).sample(logits[i:i + 1], [s])[0] for i, s in enumerate(seqs())]
    tokens = [t for t, _ in batch]
    assert tokens == [t for t, _ in alone]
    assert tokens[0] == max(valid["greedy"], key=lambda t: logits[0, t])
    assert tokens[1] == 7  # every valid logit -inf: the first valid token
    assert set(tokens[2:10]) <= {2, 4, 6, 8} and len(set(tokens[2:10])) > 1
    assert tokens[10] == 14 and tokens[11] == 40


def test_a_refused_json_row_whose_redraw_fails_ends_its_own_request_only():
    """The refused rows draw again together; when that fails (here one row's mask has the wrong length), they
    draw one at a time, and only the row that fails lands in row_errors."""
    class Broken(_Guide):
        def invalid(self, seq, device) -> torch.Tensor:
            mask = super().invalid(seq, device)
            return mask[:-1] if seq.request_id == "bad" else mask

    logits = _logits(3, seed=22)
    logits[:, 40] = 30.0  # refused by all three
    valid = {"a": [3, 5], "bad": [4], "b": [6, 7]}
    sampler = Sampler(json_guide=Broken(valid))
    out = sampler.sample(logits, [_json_seq("a", temperature=0.0), _json_seq("bad", temperature=0.0),
                                  _json_seq("b", seed=1)])
    assert set(sampler.row_errors) == {1}
    assert out[0][0] == max(valid["a"], key=lambda t: logits[0, t]) and out[2][0] in valid["b"]
