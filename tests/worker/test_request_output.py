"""OutputTracker (worker/request_output.py): each step's output carries what is new, and everything generated so far
as a view made in O(1) that later steps do not change, a copy once the request finished."""

from __future__ import annotations

import pytest

from lorafleet.worker.request_output import OutputTracker, Prefix
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence, SequenceStatus, TokenLogprob


def test_every_step_s_output_views_what_was_generated_then_without_copying_it():
    """Each step copied every token and logprob generated so far into its output: 33 us a request at 1,500 tokens,
    a cost growing with the output (quadratic over a long one). A step's view stays as it was when later tokens
    come; the finished output holds lists of its own."""
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=100, logprobs=1))
    tracker = OutputTracker()
    tracker.start("r")
    outs = []
    for t in range(5):
        seq.output_token_ids.append(10 + t)
        seq.logprobs.append(TokenLogprob(10 + t, -0.5, []))
        outs.append(tracker.next(seq))
    assert [o.new_token_ids for o in outs] == [[10], [11], [12], [13], [14]]
    assert outs[1].token_ids == [10, 11] and len(outs[1].logprobs) == 2 and outs[1].token_ids[-1] == 11
    assert isinstance(outs[1].token_ids, Prefix) and outs[1].token_ids._items is seq.output_token_ids  # no copy
    assert list(outs[2].token_ids) == [10, 11, 12] and outs[2].token_ids + [0] == [10, 11, 12, 0]
    assert [9] + outs[2].token_ids == [9, 10, 11, 12] and outs[2].token_ids[-1] == 12 == outs[4].token_ids[2]
    with pytest.raises(IndexError):
        outs[1].token_ids[2]  # generated after that step: not in its view
    assert [lp.token_id for lp in outs[3].logprobs] == [10, 11, 12, 13] and outs[0].token_ids == (10,)
    seq.status = SequenceStatus.FINISHED
    last = tracker.next(seq)
    assert type(last.token_ids) is list and last.token_ids == [10, 11, 12, 13, 14]
    assert last.token_ids is not seq.output_token_ids
    seq.output_token_ids.append(99)  # the finished output's lists are its own
    assert last.token_ids == [10, 11, 12, 13, 14] and type(last.logprobs) is list
