"""Engine vs Hugging Face transformers on a tiny random Llama (fp32, GQA, llama3 RoPE scaling)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.engine import EngineError

PROMPT_LENS = [3, 17, 9, 30, 1, 12]
MAX_NEW = 12


def _prompts(lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lens]


def hf_greedy(model_dir, prompts, max_new=MAX_NEW):
    """Per prompt, alone: (greedy tokens, log_softmax of each step's logits)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                               return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        tokens = g.sequences[0, len(p):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1) for step in g.logits]
        out.append((tokens, logprobs))
    return out


@pytest.fixture(scope="module")
def hf_ref(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, _prompts())


def _engine(model_dir, **kw) -> Engine:
    kw.setdefault("num_pages", 64)
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(model_dir), device=kw.pop("device", "cpu"), dtype="float32", **kw))


def _assert_all_free(engine: Engine) -> None:
    engine.page_pool.check()
    assert engine.page_pool.num_used("kv") == 0
    assert not engine.has_unfinished()
    assert engine.requests == {}


def _assert_matches(outs, ref, *, logprobs=True):
    for out, (tokens, lps) in zip(outs, ref, strict=True):
        assert out.token_ids == tokens
        if logprobs:
            assert len(out.logprobs) == len(tokens)
            for lp, ref_lp in zip(out.logprobs, lps, strict=True):
                assert abs(lp.logprob - ref_lp[lp.token_id].item()) < 1e-4
                for tok, val in lp.top:
                    assert abs(val - ref_lp[tok].item()) < 1e-4
                assert [t for t, _ in lp.top] == ref_lp.topk(len(lp.top)).indices.tolist()


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=3)


def test_greedy_batch_matches_hf(tiny_llama_dir, hf_ref):
    engine = _engine(tiny_llama_dir)
    outs = engine.generate(_prompts(), GREEDY)
    _assert_matches(outs, hf_ref)
    assert engine.scheduler.num_preemptions == 0
    _assert_all_free(engine)


def test_tied_embeddings_and_sharded_checkpoint(tiny_llama_tied_dir, tmp_path):
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(tiny_llama_tied_dir).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    prompts = _prompts([5, 11, 2], seed=3)
    outs = _engine(sharded).generate(prompts, GREEDY)
    _assert_matches(outs, hf_greedy(tiny_llama_tied_dir, prompts))


def test_preemption_keeps_outputs_identical(tiny_llama_dir, hf_ref):
    # 12 pages of 4 tokens: the six requests need ~40 pages together, so running ones get preempted.
    engine = _engine(tiny_llama_dir, num_pages=12)
    outs = engine.generate(_prompts(), GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions for o in outs)
    _assert_matches(outs, hf_ref)
    _assert_all_free(engine)


def record_prefill_chunks(engine, max_tokens: int | None = None) -> list[int]:
    """The sizes of the partial prefill chunks the engine's scheduler hands out from now on (each step
    checked to stay within max_tokens)."""
    chunks: list[int] = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        assert max_tokens is None or batch.num_tokens <= max_tokens
        chunks.extend(n for s, n in batch.prefills if n < s.num_prompt_tokens)
        return batch

    engine.scheduler.schedule = spy
    return chunks


def test_chunked_prefill_identical(tiny_llama_dir, hf_ref):
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=5)
    chunked = record_prefill_chunks(engine, 5)
    outs = engine.generate(_prompts(), GREEDY)
    assert chunked, "no prompt was split into chunks"
    _assert_matches(outs, hf_ref)
    _assert_all_free(engine)


def test_requests_joining_mid_decode(tiny_llama_dir, hf_ref):
    engine = _engine(tiny_llama_dir, max_num_seqs=4)
    prompts = _prompts()
    results = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:  # one new request every third step, joining running decodes
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        step += 1
    _assert_matches([results[f"r{i}"] for i in range(len(prompts))], hf_ref)
    _assert_all_free(engine)


def test_seeded_sampling_reproducible_and_batch_independent(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    prompts = _prompts()
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([prompts[1]], params)[0].token_ids
    again = engine.generate([prompts[1]], params)[0].token_ids
    mixed = engine.generate(
        prompts, [params if i == 1 else SamplingParams(max_tokens=7, temperature=1.0) for i in range(len(prompts))]
    )[1].token_ids
    assert alone == again == mixed
    other_seed = engine.generate([prompts[1]] * 3, [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=s) for s in (1, 2, 3)
    ])
    assert len({tuple(o.token_ids) for o in other_seed} | {tuple(alone)}) > 1
    _assert_all_free(engine)


def test_seeds_apart_by_a_multiple_of_2_to_the_32_draw_apart_on_the_cpu(tiny_llama_dir):
    """torch's CPU generator keeps a seed's low 32 bits; the engine mixes the high ones in (a client hashing user
    ids into 64-bit seeds must not get the same draws for ids 2**32 apart), keeping seeds below 2**32 as they are."""
    from lorafleet.worker.engine import generator_seed

    cpu = torch.device("cpu")
    assert [generator_seed(s, cpu) for s in (0, 5, 2**32 - 1)] == [0, 5, 2**32 - 1]
    assert len({generator_seed(s, cpu) for s in (5, 5 + 2**32, 5 + 2**33, 5 - 2**32, 2**63 - 1, -1)}) == 6
    assert generator_seed(5 + 2**32, torch.device("cuda")) == 5 + 2**32  # a CUDA generator keeps all 64 bits
    engine = _engine(tiny_llama_dir)
    outs = engine.generate([_prompts()[1]] * 4, [SamplingParams(max_tokens=10, temperature=1.0, seed=s)
                                                 for s in (5, 5 + 2**32, -1, 2**63 - 1)])
    assert outs[0].token_ids != outs[1].token_ids and outs[2].token_ids != outs[3].token_ids
    _assert_all_free(engine)


def test_stop_token_ids_stop_strings_and_max_tokens(tiny_llama_dir, hf_ref):
    engine = _engine(tiny_llama_dir)
    prompt = _prompts()[0]
    tokens = hf_ref[0][0]
    assert len(tokens) >= 6
    # A stop token id ends the request with that token as the last one.
    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[tokens[4]]))[0]
    first = tokens.index(tokens[4])
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    # max_tokens
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.token_ids == tokens[:3] and out.finish_reason == "length"
    # A stop string (the text of tokens 2..3) cuts the text before it, or keeps it when asked.
    full = engine.tokenizer.decode(tokens)
    stop = engine.tokenizer.decode(tokens[2:4])
    cut = full.index(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full[:cut]
    assert len(out.token_ids) <= 4
    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert out.text == full[: cut + len(stop)]
    _assert_all_free(engine)


def test_streamed_text_concatenates_to_final_text(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    engine.add_request("s", "hello world", SamplingParams(max_tokens=15, temperature=0, stop=["zz"]))
    pieces, tokens, final = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            tokens.extend(out.new_token_ids)
            final = out
    assert final.finished and "".join(pieces) == final.text and tokens == final.token_ids


def test_abort_frees_pages_at_once(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    engine.add_request("a", _prompts()[3], SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", _prompts()[1], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.page_pool.num_used("kv") > 0
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("a")
    _assert_all_free(engine)


def test_interrupted_generate_leaves_no_request_behind(tiny_llama_dir, hf_ref):
    """Ctrl-C (or any exception) inside generate: its requests are aborted, pages come back, and the
    next generate returns its own outputs (not those of the interrupted requests finishing meanwhile)."""
    engine = _engine(tiny_llama_dir)
    step, num_steps = engine.step, 0

    def interrupted_step():
        nonlocal num_steps
        num_steps += 1
        if num_steps == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        engine.generate(_prompts(), GREEDY)
    _assert_all_free(engine)
    engine.step = step
    _assert_matches(engine.generate(_prompts()[:2], GREEDY), hf_ref[:2])
    _assert_all_free(engine)


@pytest.mark.parametrize("seed", range(3))
def test_no_page_leak_after_random_workload(tiny_llama_dir, seed):
    """Random mix of lengths, sampling, stops, aborts and a tight pool: every page comes back."""
    rng = random.Random(seed)
    engine = _engine(tiny_llama_dir, num_pages=rng.choice([10, 16, 40]), max_num_batched_tokens=rng.choice([6, 64]),
                     max_num_seqs=rng.choice([2, 8]))
    for i in range(10):
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]),
                                stop=rng.choice([[], ["a", "e"]]), seed=rng.choice([None, i]))
        engine.add_request(f"w{i}", [rng.randrange(256) for _ in range(rng.randint(1, 20))], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 4:
            engine.abort("w3")
        engine.page_pool.check()
        held = sum(len(s.block_table) for s in engine.requests.values())
        assert engine.page_pool.num_used("kv") == held
    _assert_all_free(engine)


def test_refusals_name_the_problem(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, num_pages=4)  # 16 tokens of KV cache: the served context
    with pytest.raises(EngineError, match=r"at most 15 \(max_model_len 16\)"):
        engine.add_request(None, [1] * 16, SamplingParams(max_tokens=20))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request(None, [1, 99999])
    with pytest.raises(EngineError, match="not registered"):
        engine.add_request(None, [1, 2], SamplingParams(max_tokens=2), adapter="nope")
    with pytest.raises(EngineError, match="empty"):
        engine.add_request(None, [])
    assert not engine.has_unfinished()


def test_max_model_len_is_limited_to_what_the_kv_cache_holds(tiny_llama_dir, caplog):
    """As vLLM: the model's 512 positions do not fit 16 pages of 4 tokens, so the engine serves 64 (and
    says so); a request may use that whole context. An explicit max_model_len above it is refused."""
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.engine_config"):
        engine = _engine(tiny_llama_dir, num_pages=16)
    assert engine.max_model_len == 64
    assert "max_model_len lowered from the model's 512 to 64 tokens" in caplog.text
    prompt = [1, 2, 3]
    whole = SamplingParams(max_tokens=engine.max_model_len - len(prompt), temperature=0, ignore_eos=True)
    beyond = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)  # cut at the context, as vLLM
    outs = engine.generate([prompt, prompt], [whole, beyond])
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(61, "length"), (61, "length")]
    _assert_all_free(engine)
    assert _engine(tiny_llama_dir, num_pages=16, max_model_len=64).max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len 65 is larger than the KV cache holds \(64 tokens\)"):
        _engine(tiny_llama_dir, num_pages=16, max_model_len=65)


def test_a_request_fails_at_once_when_every_adapter_slot_is_pinned(tiny_llama_dir, tmp_path):
    """One slot, held by a pinned adapter: a request for another adapter can never be placed. It fails
    with AdapterLoadError naming the cause instead of waiting forever."""
    from lorafleet.worker.adapter_entry import AdapterLoadError
    from tests.lora_factory import make_peft_adapter

    engine = _engine(tiny_llama_dir, max_loras=1)
    for seed, name in enumerate(("pinned", "other")):
        make_peft_adapter(tiny_llama_dir, tmp_path / name, rank=4, seed=seed, targets=["q_proj", "v_proj"])
    pinned = engine.register_adapter("pinned", tmp_path / "pinned", pinned=True)
    engine.register_adapter("other", tmp_path / "other")
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4), adapter="other")
    done = []
    for _ in range(50):  # bounded: before the fix the request waited for a slot forever
        done += [o for o in engine.step() if o.finished]
        if done:
            break
        engine.adapter_pool.wait_idle()
    assert [o.finish_reason for o in done] == ["error"]
    assert isinstance(done[0].exception, AdapterLoadError)
    assert f"every adapter slot (1, --max-loras) is held by pinned adapters ({pinned})" in done[0].error
    _assert_all_free(engine)
    assert engine.adapter_pool.entry(pinned).resident


def test_text_prompts_and_chat_template(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>hi\n<|assistant|>"
    out_text, out_ids = engine.generate(["hello", engine.tokenizer.encode("hello")], GREEDY)
    assert out_text.token_ids == out_ids.token_ids


def test_seeded_sampling_survives_preemption(tiny_llama_dir):
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=100 + i) for i in range(6)]
    roomy = _engine(tiny_llama_dir).generate(_prompts(), params)
    tight_engine = _engine(tiny_llama_dir, num_pages=12)
    tight = tight_engine.generate(_prompts(), params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_model_dir_without_tokenizer_takes_token_ids(tiny_llama_dir, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, bare / name)
    engine = _engine(bare)
    assert engine.tokenizer is None
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) == 3 and out.text == ""
    with pytest.raises(EngineError, match="tokenizer"):
        engine.add_request(None, "text")
    with pytest.raises(EngineError, match="stop strings"):
        engine.add_request(None, [1], SamplingParams(stop=["x"]))


def test_pickle_only_model_dir_is_refused(tmp_path):
    import json

    from lorafleet.worker.model_config import ModelConfigError

    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelConfigError, match="pickle"):
        _engine(tmp_path)


def test_triton_backend_chunked_prefill_matches_hf(tiny_llama_dir, hf_ref):
    """The GPU code path (Triton KV write, decode and chunked-prefill attention) run by the Triton
    interpreter on CPU, with prompts split into chunks next to decodes."""
    engine = _engine(tiny_llama_dir, kernel_backend="triton", max_num_batched_tokens=8, num_pages=12)
    picks = [0, 1, 2]
    outs = engine.generate([_prompts()[i] for i in picks], SamplingParams(max_tokens=4, temperature=0, logprobs=2))
    _assert_matches(outs, [(hf_ref[i][0][:4], hf_ref[i][1][:4]) for i in picks])
    _assert_all_free(engine)


def test_a_request_whose_stop_check_fails_fails_alone(tiny_llama_dir, monkeypatch):
    """A failure after a request's step (its stop check, its text: a bug, a tokenizer's) fails that request only;
    the step's other requests go on with their own tokens, and nothing is left behind. It escaped the step, and
    the serving loop failed every request in flight."""
    engine = _engine(tiny_llama_dir)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = engine.generate(prompts, params)
    check = engine.stop_checker.check

    def broken(seq):
        if seq.request_id == "bad" and len(seq.output_token_ids) == 2:
            raise RuntimeError("stop check: test failure")
        return check(seq)

    monkeypatch.setattr(engine.stop_checker, "check", broken)
    for rid, prompt in zip(("bad", "ok"), prompts, strict=True):
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert done["bad"].finish_reason == "error" and "test failure" in done["bad"].error
    assert done["ok"].token_ids == ref[1].token_ids and engine.requests == {}
    assert engine.page_pool.num_used("kv") == 0
