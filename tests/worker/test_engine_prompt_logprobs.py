"""vLLM's `prompt_logprobs` through the engine, on the tiny random Llama (fp32): each prompt token's logprob
given the tokens before it (and the top k, and its rank) equals transformers' (or PEFT's, with an adapter)
log_softmax over the prompt, alone, in a batch, under chunked prefill and under preemption; other requests
of the batch are not changed by a bit."""

from __future__ import annotations

import weakref

import pytest
import torch

from lorafleet.worker import SamplingParams
from lorafleet.worker import prompt_logprobs as prompt_logprobs_module
from lorafleet.worker.sequence import Sequence, SequenceStatus
from tests.worker.test_engine import _engine, _prompts, record_prefill_chunks

MAX_NEW = 6
TOL = 1e-4


def _greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_NEW)
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def hf_prompt_logprobs(model, prompts) -> list[torch.Tensor]:
    """Per prompt, alone: log_softmax of the model's logits at each prompt position [len, V] (row p predicts
    token p + 1)."""
    out = []
    for p in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[0]
        out.append(torch.log_softmax(logits.float(), -1))
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_ref(hf_model):
    return hf_prompt_logprobs(hf_model, _prompts())


def _assert_matches(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for pos, lp in enumerate(lps[1:], 1):
        row = ref[pos - 1]
        assert lp.token_id == prompt[pos]
        assert abs(lp.logprob - row[prompt[pos]].item()) < TOL, pos
        # rank: 1 + the tokens more likely (vLLM's count of logprobs >= the token's), up to near-ties
        assert (row > lp.logprob + TOL).sum().item() + 1 <= lp.rank <= (row >= lp.logprob - TOL).sum().item()
        assert len(lp.top) == k
        assert [t for t, _ in lp.top] == row.topk(k).indices.tolist()
        for tok, val in lp.top:
            assert abs(val - row[tok].item()) < TOL


def test_prompt_logprobs_match_transformers_alone_and_in_a_batch(tiny_llama_dir, hf_ref):
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    for k in (0, 3):
        for prompt, ref in zip(prompts, hf_ref, strict=True):
            _assert_matches(engine.generate([prompt], _greedy(prompt_logprobs=k))[0], prompt, ref, k)
    outs = engine.generate(prompts, [_greedy(prompt_logprobs=k) for k in (2, 0, 5, 20, 1, 3)])
    for out, prompt, ref, k in zip(outs, prompts, hf_ref, (2, 0, 5, 20, 1, 3), strict=True):
        _assert_matches(out, prompt, ref, k)
    assert engine.generate([prompts[0]], _greedy())[0].prompt_logprobs is None  # off unless asked for


def test_prompt_logprobs_are_computed_in_slices(tiny_llama_dir, hf_ref, monkeypatch):
    """A long prompt's rows go through the LM head a slice at a time; slices of 4 rows give the same tokens
    and ranks (the values up to the float rounding of a GEMM of another shape)."""
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    whole = engine.generate(prompts, _greedy(prompt_logprobs=4))
    monkeypatch.setattr(prompt_logprobs_module, "SLICE_ROWS", 4)
    sliced = engine.generate(prompts, _greedy(prompt_logprobs=4))
    for a, b, prompt, ref in zip(whole, sliced, prompts, hf_ref, strict=True):
        _assert_matches(b, prompt, ref, 4)
        assert [(x.token_id, [t for t, _ in x.top], x.rank) for x in b.prompt_logprobs[1:]] == [
            (x.token_id, [t for t, _ in x.top], x.rank) for x in a.prompt_logprobs[1:]]


def test_chunked_prefill_fills_each_position_once_and_the_first_output_has_them_all(tiny_llama_dir, hf_ref):
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=5)
    chunks = record_prefill_chunks(engine)
    prompts = _prompts()
    outs = engine.generate(prompts, _greedy(prompt_logprobs=3))
    assert chunks, "no prompt was split into chunks"
    for out, prompt, ref in zip(outs, prompts, hf_ref, strict=True):
        _assert_matches(out, prompt, ref, 3)
    # Streamed: the first output with a token carries every prompt token's entry.
    engine.add_request("long", prompts[3], _greedy(prompt_logprobs=1))
    steps = 0
    while not (outs := engine.step()):  # the prompt's chunks: no output until the first token
        steps += 1
    assert steps >= 5 and len(outs) == 1 and outs[0].new_token_ids
    first = outs[0]
    _assert_matches(first, prompts[3], hf_ref[3], 1)
    while engine.has_unfinished():
        engine.step()


def test_a_preempted_and_recomputed_prompt_keeps_one_entry_per_token(tiny_llama_dir, hf_ref):
    prompts = _prompts()
    engine = _engine(tiny_llama_dir, num_pages=12)  # requests get preempted and recomputed
    outs = engine.generate(prompts, _greedy(prompt_logprobs=2, max_tokens=16))
    assert engine.scheduler.num_preemptions > 0 and any(o.num_preemptions for o in outs)
    for out, prompt, ref in zip(outs, prompts, hf_ref, strict=True):
        _assert_matches(out, prompt, ref, 2)
    # Chunked and preempted together.
    tight = _engine(tiny_llama_dir, num_pages=12, max_num_batched_tokens=7)
    outs = tight.generate(prompts, _greedy(prompt_logprobs=2, max_tokens=16))
    assert tight.scheduler.num_preemptions > 0
    for out, prompt, ref in zip(outs, prompts, hf_ref, strict=True):
        _assert_matches(out, prompt, ref, 2)


def test_prompt_logprobs_with_lora_adapters_match_peft(tiny_llama_dir, qv_adapters_dir):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    prompts = _prompts()
    names = ["alpha", None, "beta", "alpha", "beta", None]
    refs = {None: hf_prompt_logprobs(LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval(),
                                     prompts)}
    for name in ("alpha", "beta"):
        peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32),
                                               qv_adapters_dir / name).eval()
        refs[name] = hf_prompt_logprobs(peft_model, prompts)
    assert not torch.allclose(refs["alpha"][3], refs[None][3], atol=1e-2)  # the adapters matter
    for kw in ({}, {"max_num_batched_tokens": 5}):
        engine = _engine(tiny_llama_dir, adapters=str(qv_adapters_dir), **kw)
        outs = engine.generate(prompts, _greedy(prompt_logprobs=3), adapters=names)
        for i, (out, name) in enumerate(zip(outs, names, strict=True)):
            _assert_matches(out, prompts[i], refs[name][i], 3)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 5}, {"num_pages": 16}])
def test_the_choices_of_one_prompt_compute_its_logprobs_once(tiny_llama_dir, hf_ref, monkeypatch, kw):
    """n > 1: the choices in flight together share one list, each position computed once (chunked too; under
    preemption a choice admitted after the others finished computes its own); another k, or a request that
    comes after the first finished, computes its own."""
    prompts = _prompts()
    engine = _engine(tiny_llama_dir, **kw)
    rows: list[int] = []
    real = prompt_logprobs_module.raw_logprobs
    monkeypatch.setattr(prompt_logprobs_module, "raw_logprobs",
                        lambda logits, *args: rows.append(len(logits)) or real(logits, *args))
    choices = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True, prompt_logprobs=3)
               for s in range(3)]
    outs = engine.generate([prompts[3]] * 3 + [prompts[1]], [*choices, _greedy(prompt_logprobs=3)])
    if "num_pages" in kw:
        assert engine.scheduler.num_preemptions > 0
    else:
        assert sum(rows) == len(prompts[3]) - 1 + len(prompts[1]) - 1
        assert outs[0].prompt_logprobs is outs[1].prompt_logprobs is outs[2].prompt_logprobs
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3  # the choices sample apart all the same
    for out in outs[:3]:
        _assert_matches(out, prompts[3], hf_ref[3], 3)
    _assert_matches(outs[3], prompts[1], hf_ref[1], 3)
    rows.clear()
    outs = engine.generate([prompts[3]] * 2, [_greedy(prompt_logprobs=3), _greedy(prompt_logprobs=2)])
    assert sum(rows) == 2 * (len(prompts[3]) - 1)
    _assert_matches(outs[1], prompts[3], hf_ref[3], 2)
    rows.clear()
    _assert_matches(engine.generate([prompts[3]], _greedy(prompt_logprobs=3))[0], prompts[3], hf_ref[3], 3)
    assert sum(rows) == len(prompts[3]) - 1


MIXED = [_greedy(max_tokens=24, logprobs=2),
         SamplingParams(max_tokens=24, temperature=1.0, seed=8, ignore_eos=True, logprobs=1),
         _greedy(max_tokens=24, frequency_penalty=1.0), _greedy(max_tokens=24, logprobs=0),
         SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True), _greedy(max_tokens=24, logprobs=3)]
SCORED = {1, 3, 5}  # these ask for prompt logprobs in the mixed batch


def _with_prompt_logprobs(params: SamplingParams, k: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, prompt_logprobs=k)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 5}, {"num_pages": 16}])
def test_other_requests_of_a_batch_are_bit_identical(tiny_llama_dir, hf_ref, kw):
    """The sampler sees exactly the rows it sees without prompt logprobs: in the same batch, every request's
    tokens and logprobs are bit-identical whether some of them ask for prompt logprobs or not, and equal to
    each request's tokens alone."""
    prompts = _prompts()
    # Without prefix caching: blocks kept by an earlier run were computed in other chunks, so a run reading them
    # differs in the last bits from one computing its prompt (as chunked prefill does); a request asking for
    # prompt logprobs never reads them.
    engine = _engine(tiny_llama_dir, enable_prefix_caching=False, **kw)
    alone = [engine.generate([p], [params])[0].token_ids for p, params in zip(prompts, MIXED, strict=True)]
    plain = engine.generate(prompts, MIXED)
    scored_params = [_with_prompt_logprobs(p, 4) if i in SCORED else p for i, p in enumerate(MIXED)]
    scored = engine.generate(prompts, scored_params)
    if "num_pages" in kw:
        assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in plain] == alone
    for i, (a, b) in enumerate(zip(plain, scored, strict=True)):
        assert b.token_ids == a.token_ids and b.logprobs == a.logprobs, i
        assert (b.prompt_logprobs is not None) == (i in SCORED)
        if i in SCORED:
            _assert_matches(b, prompts[i], hf_ref[i], 4)


def test_prompt_logprobs_beyond_twenty_are_refused():
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


def test_a_prompt_logprobs_list_is_shared_only_for_one_adapter_version_and_k_while_a_holder_runs():
    """...and within one tenant and cache_salt, as the prefix cache: another tenant's request for the same
    prompt took the list, and its prompt logprobs came sooner for it (a timing that told it what was asked)."""
    def seq(adapter: str | None, k: int = 2, tenant: str = "t", salt: str | None = None) -> Sequence:
        return Sequence("r", [1, 2, 3], _greedy(prompt_logprobs=k, cache_salt=salt), adapter=adapter, tenant=tenant)

    lists: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    first, canary, other_k, sibling = seq("a@v1"), seq("a@v2"), seq("a@v1", 3), seq("a@v1")
    strangers = [seq("a@v1", tenant="u"), seq("a@v1", salt="user-2"), seq(None), seq(None, tenant="u")]
    prompt_logprobs_module.share_prompt_logprobs([(s, 3) for s in (first, canary, other_k, sibling, *strangers)],
                                                 lists)
    assert sibling.prompt_logprobs is first.prompt_logprobs
    assert canary.prompt_logprobs is not first.prompt_logprobs and other_k.prompt_logprobs is not first.prompt_logprobs
    assert len({id(s.prompt_logprobs) for s in (first, *strangers)}) == 5
    eras = {"t": 1}  # tenant t left the keys file, and its name was given again: the new holder shares nothing
    renamed = seq("a@v1")
    prompt_logprobs_module.share_prompt_logprobs([(renamed, 3)], lists, eras)
    assert renamed.prompt_logprobs is not first.prompt_logprobs
    first.status = sibling.status = SequenceStatus.FINISHED
    later = seq("a@v1")
    prompt_logprobs_module.share_prompt_logprobs([(later, 3)], lists)
    assert later.prompt_logprobs is not first.prompt_logprobs  # its holders finished: it computes its own
