"""TokenCounts: the penalties' per-sequence counts, kept from step to step, equal a count from scratch at every
step, through new sequences, finished ones (rows taken back) and n choices of one prompt."""

from __future__ import annotations

import gc
import random

import torch

from lorafleet.worker.sampler import Sampler, apply_penalties
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence, SequenceStatus
from lorafleet.worker.token_counts import TokenCounts

VOCAB = 40


def _from_scratch(seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(VOCAB)
    for t in seq.output_token_ids:
        counts[t] += 1
    seen = counts > 0
    if seq.params.repetition_penalty != 1.0:
        seen[seq.prompt_token_ids] = True
    return counts, seen


def _check(table: TokenCounts, seqs: list[Sequence], logits: torch.Tensor) -> None:
    rows = table.update(seqs, logits)
    for seq, row in zip(seqs, rows.tolist(), strict=True):
        counts, seen = _from_scratch(seq)
        assert torch.equal(table.output_counts[row], counts)
        assert torch.equal(table.seen[row], seen)


def test_counts_grow_by_each_steps_tokens_and_rows_are_reused_once_finished():
    rng = random.Random(0)
    logits = torch.zeros(1, VOCAB)
    table = TokenCounts()
    kinds = [dict(repetition_penalty=1.2), dict(frequency_penalty=0.5), dict(presence_penalty=1.0)]
    seqs: list[Sequence] = []
    for step in range(60):
        if len(seqs) < 12 and rng.random() < 0.5:  # a new request, its prompt counted once
            seqs.append(Sequence(f"r{step}", [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
                                 SamplingParams(**rng.choice(kinds))))
        for seq in seqs:
            if rng.random() < 0.8:  # a sequence that sat this step out (preempted, waiting) catches up later
                seq.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.choice((1, 1, 1, 3))))
        batch = [s for s in seqs if rng.random() < 0.7]
        if batch:
            _check(table, batch, logits)
        if seqs and rng.random() < 0.2:
            seqs.pop(rng.randrange(len(seqs))).status = SequenceStatus.FINISHED
    assert table.output_counts.shape[0] <= 16  # rows of finished sequences were taken back, not grown past


def test_choices_of_one_prompt_count_their_own_outputs():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    choices = [Sequence(f"c{i}", [1, 2, 3], params) for i in range(3)]
    table = TokenCounts()
    logits = torch.zeros(3, VOCAB)
    for step in range(5):
        for i, seq in enumerate(choices):
            seq.output_token_ids.append((i * 7 + step) % VOCAB)
        _check(table, choices, logits)
    assert table.num_rows == 3


def test_a_step_adds_only_the_new_tokens(monkeypatch):
    rng = random.Random(1)
    seqs = [Sequence(str(i), [rng.randrange(VOCAB) for _ in range(500)], SamplingParams(repetition_penalty=1.3))
            for i in range(4)]
    table = TokenCounts()
    logits = torch.zeros(4, VOCAB)
    table.update(seqs, logits)  # the prompts, once
    scattered = []
    real = table._index
    monkeypatch.setattr(table, "_index", lambda rows, ids: scattered.append(len(ids)) or real(rows, ids))
    for _ in range(3):
        for seq in seqs:
            seq.output_token_ids.append(rng.randrange(VOCAB))
        _check(table, seqs, logits)
    assert scattered == [4, 4, 4]  # one token per sequence and step, never the 500-token prompts again


def test_the_samplers_kept_counts_penalize_as_a_one_off_count_does():
    rng = random.Random(2)
    kinds = [dict(repetition_penalty=1.5), dict(repetition_penalty=0.7, presence_penalty=0.5),
             dict(frequency_penalty=-1.0), {}, dict(frequency_penalty=2.0, presence_penalty=-0.3)]
    seqs = [Sequence(str(i), [rng.randrange(VOCAB) for _ in range(20)], SamplingParams(temperature=0.0, **kinds[i]))
            for i in range(len(kinds))]
    sampler = Sampler()
    for step in range(15):
        logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        fresh = apply_penalties(logits, seqs)  # counted from scratch, as before the counts were kept
        assert torch.equal(apply_penalties(logits, seqs, sampler.token_counts), fresh)
        for seq, (token, _) in zip(seqs, sampler.sample(logits, seqs), strict=True):
            assert token == int(fresh[seqs.index(seq)].argmax())
            seq.output_token_ids.append(token)


def test_rows_of_dropped_sequences_are_reused_cleared_and_another_vocabulary_starts_afresh():
    """A sequence dropped without finishing (its object gone) gives its row back, and the next owner finds it
    cleared; logits of another width (another model) start a new table, and a sequence counted in the old one
    is counted again in full."""
    table = TokenCounts()
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)
    kept = [Sequence(f"k{i}", [1, 2], params) for i in range(7)]
    for seq in kept:
        seq.output_token_ids.extend([3, 3, 4])
    dropped = Sequence("dropped", list(range(30)), params)
    dropped.output_token_ids.extend(range(10, 20))
    _check(table, [*kept, dropped], torch.zeros(8, VOCAB))
    assert table.output_counts.shape[0] == 8
    del dropped
    gc.collect()
    fresh = Sequence("fresh", [5], params)
    fresh.output_token_ids.append(6)
    _check(table, [fresh], logits)  # the dropped one's row, its prompt and outputs gone
    assert table.output_counts.shape[0] == 8
    wider = torch.zeros(1, VOCAB + 8)
    kept[0].output_token_ids.append(VOCAB + 3)
    rows = table.update([kept[0]], wider)
    assert table.num_rows == 1 and table.output_counts.shape == (8, VOCAB + 8)
    assert table.output_counts[rows[0], [3, 4, VOCAB + 3]].tolist() == [2.0, 1.0, 1.0]
    assert table.seen[rows[0]].nonzero().flatten().tolist() == [1, 2, 3, 4, VOCAB + 3]


def test_rows_of_finished_sequences_are_released_at_the_next_step_and_a_bursts_table_shrinks():
    """A burst of penalized requests grows the table; once they finish, the next step releases their rows
    and gives the memory back (down to what the sequences left need), the survivors' counts moved intact."""
    rng = random.Random(3)
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)
    burst = [Sequence(f"b{i}", [rng.randrange(VOCAB) for _ in range(5)], params) for i in range(100)]
    table = TokenCounts()
    for _ in range(2):
        for seq in burst:
            seq.output_token_ids.append(rng.randrange(VOCAB))
        _check(table, burst, torch.zeros(len(burst), VOCAB))
    assert table.output_counts.shape[0] == 128
    survivors = burst[::40]  # rows 0, 40 and 80: two of them sit past the shrunken table's end
    for seq in burst:
        if seq not in survivors:
            seq.status = SequenceStatus.FINISHED
    for seq in survivors:
        seq.output_token_ids.append(rng.randrange(VOCAB))
    _check(table, survivors, torch.zeros(len(survivors), VOCAB))
    assert table.num_rows == len(survivors)  # the finished ones' rows released, not only when one is needed
    assert table.output_counts.shape[0] == table.seen.shape[0] <= 16  # not the burst's 128 rows for ever
    for seq in survivors:
        seq.status = SequenceStatus.FINISHED
    late = Sequence("late", [1, 2], params)
    late.output_token_ids.append(3)
    _check(table, [late], torch.zeros(1, VOCAB))
    assert table.num_rows == 1 and table.output_counts.shape[0] == 8


def test_steps_without_penalties_give_a_finished_bursts_rows_back():
    """After a burst of penalized requests, the steps of requests that set no penalty release the burst's
    rows and shrink the table: the memory does not wait for the next penalized request."""
    params = SamplingParams(frequency_penalty=0.5)
    burst = [Sequence(f"b{i}", [1, 2], params) for i in range(40)]
    sampler_counts = TokenCounts()
    apply_penalties(torch.zeros(len(burst), VOCAB), burst, sampler_counts)
    assert sampler_counts.output_counts.shape[0] == 64
    for seq in burst:
        seq.status = SequenceStatus.FINISHED
    plain = [Sequence("plain", [1, 2], SamplingParams())]
    apply_penalties(torch.zeros(1, VOCAB), plain, sampler_counts)
    assert sampler_counts.num_rows == 0 and sampler_counts.output_counts.shape[0] == 8
