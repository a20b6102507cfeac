"""JSON mode in the sampler (json_guide.py, sampler.py) on a hand-made vocabulary: invalid draws are drawn
again among the valid tokens, the result samples p restricted to them, and the stop tokens wait for a
complete object."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.json_guide import JsonGuide, JsonModeError
from lorafleet.worker.json_vocab import JsonVocab
from lorafleet.worker.sampler import Sampler
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence

TOKENS = [b"{", b"}", b'"', b"a", b" ", b"x]", b"1", b'{"a":1}', None]  # the last one: EOS
EOS = len(TOKENS) - 1
OPEN, CLOSE, QUOTE, A, SPACE, BAD, ONE, WHOLE = range(EOS)


def _sampler() -> Sampler:
    guide = JsonGuide(lambda: JsonVocab(TOKENS), [EOS])
    return Sampler(seed=0, eos_token_ids=[EOS], json_guide=guide)


def _seq(output: list[int], **kw) -> Sequence:
    seq = Sequence("r", [1], SamplingParams(json_object=True, max_tokens=100, **kw))
    seq.output_token_ids = list(output)
    return seq


def _logits(favourite: int, second: int | None = None) -> torch.Tensor:
    logits = torch.zeros(1, len(TOKENS))
    logits[0, favourite] = 10.0
    if second is not None:
        logits[0, second] = 5.0
    return logits


def test_greedy_rows_take_the_best_valid_token():
    sampler = _sampler()
    assert sampler.sample(_logits(BAD, SPACE), [_seq([], temperature=0.0)])[0][0] == SPACE
    assert sampler.sample(_logits(EOS, WHOLE), [_seq([], temperature=0.0)])[0][0] == WHOLE
    assert sampler.sample(_logits(A, CLOSE), [_seq([OPEN], temperature=0.0)])[0][0] == CLOSE
    # Complete: only EOS, whatever the logits say; before, never EOS.
    assert sampler.sample(_logits(SPACE), [_seq([WHOLE], temperature=0.0)])[0][0] == EOS
    assert sampler.sample(_logits(EOS, QUOTE), [_seq([OPEN], temperature=0.0)])[0][0] == QUOTE
    # min_tokens 3: the object may not complete at the second token (EOS could not follow it).
    assert sampler.sample(_logits(CLOSE, SPACE), [_seq([OPEN], temperature=0.0, min_tokens=3)])[0][0] == SPACE
    assert sampler.sample(_logits(CLOSE, SPACE), [_seq([OPEN, SPACE], temperature=0.0, min_tokens=3)])[0][0] == CLOSE


def test_sampled_rows_follow_p_restricted_to_the_valid_tokens():
    sampler = _sampler()
    logits = torch.tensor([[0.0, 1.0, 0.5, 2.0, -0.5, 3.0, 1.5, 0.2, 2.5]])  # inside '{': '}', '"', ' ' valid
    valid = [CLOSE, QUOTE, SPACE]
    p = torch.softmax(logits[0, valid], dim=-1)
    draws = 4000
    counts = torch.zeros(len(TOKENS))
    seqs = [_seq([OPEN]) for _ in range(draws)]
    for token, _ in sampler.sample(logits.expand(draws, -1).contiguous(), seqs):
        counts[token] += 1
    assert counts.sum() == counts[valid].sum()
    assert torch.allclose(counts[valid] / draws, p, atol=0.03), (counts[valid] / draws, p)


def test_top_k_that_leaves_no_valid_token_filters_among_the_valid_ones():
    sampler = _sampler()
    logits = _logits(BAD, EOS)  # top_k=2 keeps only these two, both invalid after '{'
    logits[0, QUOTE] = 1.0
    for seed in range(5):
        seq = _seq([OPEN], temperature=1.0, top_k=2, seed=seed)
        seq.generator = torch.Generator().manual_seed(seed)
        token = sampler.sample(logits, [seq])[0][0]
        assert token in (CLOSE, QUOTE, SPACE)


def test_a_row_that_cannot_go_on_fails_alone():
    sampler = _sampler()
    broken = _seq([BAD])  # an output the object cannot hold (never sampled so: a corrupted state)
    plain = Sequence("p", [1], SamplingParams(temperature=0.0))
    out = sampler.sample(torch.cat([_logits(SPACE), _logits(A)]), [broken, plain])
    assert set(sampler.row_errors) == {0} and isinstance(sampler.row_errors[0], JsonModeError)
    assert out[1][0] == A
    assert sampler.sample(_logits(A), [plain])[0][0] == A and not sampler.row_errors


def test_preempted_sequences_rebuild_or_keep_their_state():
    guide = JsonGuide(lambda: JsonVocab(TOKENS), [EOS])
    seq = _seq([OPEN, QUOTE, A])
    assert guide.state(seq) == ("key", "{")
    seq.output_token_ids.append(QUOTE)
    assert guide.state(seq) == ("colon", "{") and seq.json_state[0] == 4
    seq.json_state = None  # dropped: rebuilt from the output tokens
    assert guide.state(seq) == ("colon", "{")


def test_after_the_object_ignore_eos_takes_whitespace_or_a_stop_token_id_never_eos():
    sampler = _sampler()
    guide = sampler.json_guide
    seq = _seq([WHOLE], temperature=0.0, ignore_eos=True)
    assert sampler.sample(_logits(EOS, A), [seq])[0][0] == SPACE
    assert guide.accepts(seq, SPACE) and not guide.accepts(seq, EOS) and not guide.accepts(seq, A)
    seq.output_token_ids.append(SPACE)
    assert guide.state(seq) == ("done", "") and sampler.sample(_logits(EOS), [seq])[0][0] == SPACE
    stop = _seq([WHOLE], temperature=0.0, ignore_eos=True, stop_token_ids=[ONE])
    assert sampler.sample(_logits(ONE, SPACE), [stop])[0][0] == ONE
    assert sampler.sample(_logits(EOS, SPACE), [_seq([WHOLE], temperature=0.0)])[0][0] == EOS  # as before


@pytest.mark.parametrize("grammar", ["json_object", "schema"])
def test_a_run_of_whitespace_tokens_between_json_tokens_ends(grammar):
    """After MAX_WS_RUN whitespace-only tokens between JSON's tokens the next may not be whitespace only (small
    models loop on indentation); inside a string whitespace is text and stays allowed."""
    from lorafleet.worker.json_guide import MAX_WS_RUN
    from lorafleet.worker.json_schema_grammar import schema_grammar
    from lorafleet.worker.json_vocab import JsonVocab
    from lorafleet.worker.sampling_params import SamplingParams
    from lorafleet.worker.sequence import Sequence

    pieces = ["{", "\n", "  ", "\"a\"", ":", "1", "}", "\"", "x"]
    vocab = JsonVocab([p.encode() for p in pieces] + [None])
    guide = JsonGuide(lambda: vocab, eos_token_ids=[len(pieces)])
    kw = {"json_object": True} if grammar == "json_object" else {"grammar": schema_grammar(
        {"type": "object", "properties": {"a": {"type": ["integer", "string"]}}})}
    seq = Sequence("r", [1], SamplingParams(max_tokens=64, **kw))
    seq.output_token_ids += [0] + [1, 2] * (MAX_WS_RUN // 2 - 1) + [1]  # "{" then MAX_WS_RUN - 1 whitespace tokens
    assert guide.accepts(seq, 1) and not bool(guide.invalid(seq, "cpu")[2])
    seq.output_token_ids.append(2)
    allowed = (~guide.invalid(seq, "cpu")).nonzero().flatten().tolist()
    assert 1 not in allowed and 2 not in allowed and 3 in allowed and not guide.accepts(seq, 1)
    seq.output_token_ids += [3, 4, 7] + [2] * MAX_WS_RUN  # '"a":"' then spaces inside the string: text
    assert guide.accepts(seq, 2) and guide.accepts(seq, 8)
