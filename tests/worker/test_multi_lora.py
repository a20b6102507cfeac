"""Mixed-adapter batches against HF PEFT: every request of a batch that mixes four PEFT adapters
(ranks 4/8/16/32, alpha != rank, rsLoRA, q/v only, all seven projections, rank_pattern) and the base
model gets the tokens and logprobs that PEFT gives for that adapter alone, and that the merged model
(merge_and_unload) gives."""

from __future__ import annotations

import random

import pytest
import torch

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.engine_errors import ContextLengthError

MAX_NEW = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    # name: LoraConfig kwargs
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(r=8, lora_alpha=12, target_modules=ALL),
    "rs16": dict(r=16, lora_alpha=7, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "pat32": dict(r=32, lora_alpha=20, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                  rank_pattern={"layers.1.mlp.down_proj": 4}, alpha_pattern={"layers.0.self_attn.o_proj": 3}),
}
# Interleaved adapters (None = base model) and prompt lengths.
PLAN = [("qv4", 5), (None, 13), ("all8", 2), ("rs16", 21), ("pat32", 9), (None, 3), ("all8", 17),
        ("qv4", 11), ("pat32", 26), ("rs16", 7)]


def _prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for _, n in PLAN]


def _make_adapter(model_dir, out_dir, seed, kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero (a no-op adapter); make both matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: _make_adapter(tiny_llama_dir, root / name, i, kw) for i, (name, kw) in enumerate(ADAPTERS.items())}


def _greedy(model, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
    return g.sequences[0, len(prompt):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in g.logits]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapter_dirs):
    """Per PLAN entry: (PEFT alone, merged) greedy tokens + per-step log_softmax; "base" the base model's."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    prompts = _prompts()
    refs = {}
    base = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    refs["base"] = [_greedy(base, p) for p in prompts]
    for i, (name, _) in enumerate(PLAN):
        if name is None:
            refs[i] = (refs["base"][i],) * 2
    for name, path in adapter_dirs.items():
        peft_model = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32), path).eval()
        alone = {i: _greedy(peft_model, prompts[i]) for i, (n, _) in enumerate(PLAN) if n == name}
        merged_model = peft_model.merge_and_unload().eval()
        for i in alone:
            refs[i] = (alone[i], _greedy(merged_model, prompts[i]))
    return refs


def _engine(model_dir, adapter_root, dtype="float32", **kw):
    kw.setdefault("block_size", 16)
    return Engine(EngineConfig(model=str(model_dir), device="cpu", dtype=dtype, adapters=str(adapter_root),
                               max_lora_rank=32, **kw))


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=2)


def _check(outs, references):
    for i, out in enumerate(outs):
        for tokens, lps in references[i]:  # PEFT alone, then merged
            assert out.token_ids == tokens, f"request {i} ({PLAN[i][0]})"
            for step, lp in enumerate(out.logprobs):
                ref = lps[step]
                assert abs(lp.logprob - ref[lp.token_id].item()) < 1e-4, f"request {i} step {step}"
                for tok, val in lp.top:
                    assert abs(val - ref[tok].item()) < 1e-4


def _assert_all_free(engine):
    engine.page_pool.check()
    engine.adapter_pool.check()
    assert engine.page_pool.num_used("kv") == 0
    assert all(d["refcount"] == 0 for d in engine.adapter_pool.describe())


def test_references_differ_per_adapter(references):
    """Sanity: every adapter really changes the model (else equality would prove nothing)."""
    for i, (name, _) in enumerate(PLAN):
        if name is not None:
            delta = (references[i][0][1][0] - references["base"][i][1][0]).abs().max().item()
            assert delta > 1e-2, f"adapter {name} hardly changes the first-step logprobs ({delta})"


def test_mixed_batch_matches_peft_alone_and_merged(tiny_llama_dir, adapter_dirs, references):
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent)
    assert sorted(k.split("@")[0] for k in engine.adapters()) == sorted(ADAPTERS)
    for key in engine.adapters():  # resident up front, so the first step holds every adapter
        engine.adapter_pool.load(key)
    sizes = []
    orig = engine.runner.prepare

    def spy(batch):
        ctx, samplers = orig(batch)
        if ctx.lora is not None:
            sizes.append(len(set(ctx.lora.seg_slots.tolist())))
            # The host-built batch carries what the kernels plan with: the mean rank over tokens with a
            # slot, and whether every token has one (the prefill write path relies on it).
            slots = ctx.lora.token_slots
            ranks = ctx.lora_layout.max_rank_by_slot()[slots[slots >= 0].long()].float()
            assert ctx.lora.mean_rank == pytest.approx(float(ranks.mean()))
            assert ctx.lora.every_token == bool((slots >= 0).all())
        return ctx, samplers

    engine.runner.prepare = spy
    outs = engine.generate(_prompts(), GREEDY, adapters=[a for a, _ in PLAN])
    assert max(sizes) == 4  # one step really mixed all four adapters (and the base)
    assert [o.adapter.split("@")[0] if o.adapter else None for o in outs] == [a for a, _ in PLAN]
    _check(outs, references)
    _assert_all_free(engine)


def test_mixed_batch_under_preemption(tiny_llama_dir, adapter_dirs, references):
    root = next(iter(adapter_dirs.values())).parent
    probe = _engine(tiny_llama_dir, root, block_size=8)
    for key in probe.adapters():
        probe.adapter_pool.load(key)
    adapter_pages = probe.page_pool.num_used("adapter")
    # Room for every adapter (pinned, so none gives its pages up) plus 5 KV pages of 8 tokens: the
    # ten requests cannot all stay resident.
    engine = _engine(tiny_llama_dir, root, block_size=8, num_pages=adapter_pages + 5)
    for key in engine.adapters():
        engine.adapter_pool.pin(key)
        engine.adapter_pool.load(key)
    outs = engine.generate(_prompts(), GREEDY, adapters=[a for a, _ in PLAN])
    assert engine.scheduler.num_preemptions > 0
    _check(outs, references)
    _assert_all_free(engine)


def test_mixed_batch_with_mid_decode_joins_and_chunks(tiny_llama_dir, adapter_dirs, references):
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent, max_num_batched_tokens=12,
                     block_size=4)
    prompts = _prompts()
    results, pending, step = {}, list(range(len(PLAN))), 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], GREEDY, adapter=PLAN[i][0])
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out
        step += 1
    _check([results[i] for i in range(len(PLAN))], references)
    _assert_all_free(engine)


def test_adapter_metadata_travels_with_weights(tiny_llama_dir, adapter_dirs, references, tmp_path):
    """Same A/B weights under another lora_alpha give other outputs: alpha/r is read per adapter,
    not assumed (a lost rank/alpha would serve a silently different model)."""
    import json
    import shutil

    changed = tmp_path / "qv4_alpha"
    shutil.copytree(adapter_dirs["qv4"], changed)
    cfg = json.loads((changed / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 64
    (changed / "adapter_config.json").write_text(json.dumps(cfg))
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent)
    engine.register_adapter("qv4_alpha", changed)
    i = next(i for i, (n, _) in enumerate(PLAN) if n == "qv4")
    same, other = engine.generate([_prompts()[i]] * 2, GREEDY, adapters=["qv4", "qv4_alpha"])
    ref = references[i][0][1][0]
    assert abs(same.logprobs[0].logprob - ref[same.token_ids[0]].item()) < 1e-4
    assert abs(other.logprobs[0].logprob - ref[other.token_ids[0]].item()) > 1e-3


def test_adapter_for_another_base_or_tokenizer_is_refused(tiny_llama_dir, adapter_dirs, tmp_path):
    import json
    import shutil

    from lorafleet.worker.peft_adapter import AdapterError

    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent)
    other_base = tmp_path / "other_base"
    shutil.copytree(adapter_dirs["qv4"], other_base)
    cfg = json.loads((other_base / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "meta-llama/Llama-3-8B"
    (other_base / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="base model"):
        engine.register_adapter("other_base", other_base)

    other_tok = tmp_path / "other_tok"
    shutil.copytree(adapter_dirs["qv4"], other_tok)
    tok = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different text
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(AdapterError, match="tokenizer"):
        engine.register_adapter("other_tok", other_tok)

    # Two ids no probe text encodes to swapped: only the vocabulary's digest tells it apart, which the engine
    # must hand the loader (the swap above is caught by the probes' encodings too).
    from lorafleet.worker.vocab_digest import probe_encodings

    unprobed = tmp_path / "unprobed"
    shutil.copytree(adapter_dirs["qv4"], unprobed)
    tok = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    probed = {i for ids in probe_encodings(tiny_llama_dir) for i in ids}
    a, b = [t for t in sorted(vocab, key=vocab.get) if vocab[t] not in probed][-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (unprobed / "tokenizer.json").write_text(json.dumps(tok))
    assert probe_encodings(unprobed) == probe_encodings(tiny_llama_dir)
    with pytest.raises(AdapterError, match="tokenizer"):
        engine.register_adapter("unprobed", unprobed)

    # The base's vocabulary and merges, but text lower-cased and a space put before it: "Hi" becomes other
    # ids. Equal vocabularies were taken as the same tokenizer.
    other_pipeline = tmp_path / "other_pipeline"
    shutil.copytree(adapter_dirs["qv4"], other_pipeline)
    tok = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    tok["normalizer"] = {"type": "Lowercase"}
    (other_pipeline / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(AdapterError, match="turns text into other ids .*'Hi' is"):
        engine.register_adapter("other_pipeline", other_pipeline)
    shutil.copy(tiny_llama_dir / "tokenizer.json", other_pipeline / "tokenizer.json")  # the base's own file: served
    engine.register_adapter("same_tok", other_pipeline)
    engine.unregister_adapter("same_tok")
    assert sorted(k.split("@")[0] for k in engine.adapters()) == sorted(ADAPTERS)


def test_an_adapter_declaring_its_own_chat_template_or_end_token_is_served_with_a_warning(tiny_llama_dir, adapter_dirs,
                                                                                          tmp_path, caplog):
    """The base's chat template and end-of-sequence token serve every adapter (as in vLLM); one trained with its
    own was registered without a word, its answers then never ending or oddly framed."""
    import json
    import logging
    import shutil

    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent)
    own = tmp_path / "own_chat"
    shutil.copytree(adapter_dirs["qv4"], own)
    (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages }}"}))
    with caplog.at_level(logging.INFO, logger="lorafleet.worker.engine"):
        engine.register_adapter("own_chat", own)
        (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": engine.tokenizer.config.get("eos_token")}))
        engine.register_adapter("base_chat", own)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "own_chat" in r.getMessage()]
    assert len(warned) == 1 and "chat template differs" in warned[0].getMessage(), caplog.text
    assert "end-of-sequence token '<|im_end|>' is not the served base's '</s>'" in warned[0].getMessage()
    assert "the base's vocabulary has no such token" in warned[0].getMessage()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and "base_chat" in r.getMessage()], caplog.text


def test_too_many_adapters_per_batch_are_bounded(tiny_llama_dir, adapter_dirs, references):
    """max_loras_per_batch caps the LoRA segments of a step (many small segments slow the kernels);
    the requests held back still finish, with the same results."""
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent, max_loras_per_batch=2)
    for key in engine.adapters():  # all resident: only the bound limits what a step mixes
        engine.adapter_pool.load(key)
    segments = []
    orig = engine.runner.prepare

    def spy(batch):
        ctx, samplers = orig(batch)
        segments.append(0 if ctx.lora is None else len(set(ctx.lora.seg_slots.tolist())))
        return ctx, samplers

    engine.runner.prepare = spy
    outs = engine.generate(_prompts(), GREEDY, adapters=[a for a, _ in PLAN])
    assert max(segments) == 2
    _check(outs, references)
    _assert_all_free(engine)


def test_triton_backend_matches_reference(tiny_llama_dir, adapter_dirs, references):
    """The GPU code path (Triton paged attention + SGMV shrink/expand), run by the Triton interpreter on
    CPU: a mixed batch gives the same tokens and logprobs as PEFT."""
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent, kernel_backend="triton")
    picks = [0, 1, 3, 4]  # qv4, base, rs16, pat32
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    outs = engine.generate([_prompts()[i] for i in picks], params, adapters=[PLAN[i][0] for i in picks])
    for i, out in zip(picks, outs, strict=True):
        tokens, lps = references[i][0]
        assert out.token_ids == tokens[:3]
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - lps[step][lp.token_id].item()) < 1e-4
    _assert_all_free(engine)


def test_bfloat16_unmerged_stays_close_to_fp32(tiny_llama_dir, adapter_dirs, references):
    """bf16 serving keeps the base shared and unmerged; its LoRA delta is accumulated in float32, so
    the drift from the fp32 reference stays at bf16 rounding level (measured 0.009-0.029 nats here), a
    fiftieth of what any of the adapters changes."""
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent, dtype="bfloat16")
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    outs = engine.generate(_prompts(), params, adapters=[a for a, _ in PLAN])
    for i, out in enumerate(outs):
        ref, base = references[i][0][1][0], references["base"][i][1][0]
        top = [t for t, _ in out.logprobs[0].top]
        assert max(abs(v - ref[t].item()) for t, v in out.logprobs[0].top) < 0.06, f"request {i}"
        # The bound means something: each adapter moves these log-probs 1.5-2.7 nats, so a delta dropped,
        # applied twice or scaled wrongly in bf16 would land far outside it.
        assert PLAN[i][0] is None or max(abs(ref[t].item() - base[t].item()) for t in top) > 20 * 0.06, f"request {i}"


def test_idle_adapters_give_their_pages_to_the_kv_cache(tiny_llama_dir, adapter_dirs, references):
    """Unified paging: with the pool full of idle adapters, base requests still run (the idle
    adapters are evicted rather than requests failing or preempting each other forever), and the
    adapters come back on their next request with the same results."""
    root = next(iter(adapter_dirs.values())).parent
    probe = _engine(tiny_llama_dir, root)
    for key in probe.adapters():
        probe.adapter_pool.load(key)
    adapter_pages = probe.page_pool.num_used("adapter")
    engine = _engine(tiny_llama_dir, root, num_pages=adapter_pages + 2)
    for key in engine.adapters():
        engine.adapter_pool.load(key)
    assert engine.page_pool.num_free == 2
    prompts = _prompts()
    base = engine.generate(prompts, GREEDY)
    for out, (tokens, _) in zip(base, references["base"], strict=True):
        assert out.token_ids == tokens
    assert any(d["tier"] != "gpu" for d in engine.adapter_pool.describe())
    _check(engine.generate(prompts, GREEDY, adapters=[a for a, _ in PLAN]), references)
    _assert_all_free(engine)


def test_request_that_can_never_fit_fails_instead_of_hanging(tiny_llama_dir, adapter_dirs):
    root = next(iter(adapter_dirs.values())).parent
    probe = _engine(tiny_llama_dir, root, block_size=4)
    for key in probe.adapters():
        probe.adapter_pool.load(key)
    engine = _engine(tiny_llama_dir, root, block_size=4, num_pages=probe.page_pool.num_used("adapter") + 3)
    for key in engine.adapters():
        engine.adapter_pool.pin(key)
        engine.adapter_pool.load(key)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ContextLengthError, match="pinned adapters take"):  # refused at once: it can never fit
        engine.generate([list(range(30)), [1, 2, 3]], params)
    (short,) = engine.generate([[1, 2, 3]], params)
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    _assert_all_free(engine)


def test_cold_adapter_load_does_not_block_other_requests(tiny_llama_dir, adapter_dirs, references):
    """A request whose adapter is still loading waits; the others keep decoding meanwhile."""
    import threading

    from lorafleet.worker.peft_adapter import load_peft_adapter

    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent)
    release = threading.Event()
    weights = load_peft_adapter(adapter_dirs["rs16"], engine.model_config, strict_base="off")

    def slow_loader():
        release.wait(60)  # the "disk read" finishes when the test says so (bounded: a regression fails, not hangs)
        return weights

    engine.adapter_pool.add("cold@1", loader=slow_loader)
    i_cold = next(i for i, (n, _) in enumerate(PLAN) if n == "rs16")
    i_base = next(i for i, (n, _) in enumerate(PLAN) if n is None)
    engine.add_request("cold", _prompts()[i_cold], GREEDY, adapter="cold")
    engine.add_request("base", _prompts()[i_base], GREEDY)
    done = {}
    for _ in range(MAX_NEW):  # a token of base's every step: not one step waits for the load
        outs = engine.step()
        assert [out.request_id for out in outs] == ["base"]  # cold has produced nothing while its adapter loads
        done |= {out.request_id: out for out in outs if out.finished}
    assert "base" in done and engine.num_waiting == 1 and engine.requests["cold"].num_computed_tokens == 0
    release.set()
    for _ in range(4 * MAX_NEW):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished():
            break
        if engine.last_batch_size == 0:
            engine.adapter_pool.wait_idle()
    assert not engine.has_unfinished(), list(engine.requests.values())
    assert done["base"].token_ids == references[i_base][0][0]
    assert done["cold"].token_ids == references[i_cold][0][0] and done["cold"].adapter == "cold@1"
    _assert_all_free(engine)


def test_hot_update_in_flight_requests_finish_on_their_version(tiny_llama_dir, adapter_dirs, references):
    """A new version is loaded beside the old one; a request that started on v1 finishes on v1's
    weights, a request arriving after the switch gets v2's; nothing sees a mix."""
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent)
    i_v1 = next(i for i, (n, _) in enumerate(PLAN) if n == "qv4")
    i_v2 = next(i for i, (n, _) in enumerate(PLAN) if n == "all8")
    assert engine.register_adapter("hot", adapter_dirs["qv4"], version="v1") == "hot@v1"
    engine.add_request("old", _prompts()[i_v1], GREEDY, adapter="hot")
    engine.adapter_pool.load("hot@v1")
    done = {}
    for _ in range(3):  # "old" is mid-decode on v1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "old" not in done and engine.requests["old"].output_token_ids
    engine.register_adapter("hot", adapter_dirs["all8"], version="v2")
    engine.adapter_pool.wait_idle()  # v2 resident: "hot" now resolves to it
    engine.add_request("new", _prompts()[i_v2], GREEDY, adapter="hot")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["old"].adapter == "hot@v1" and done["old"].token_ids == references[i_v1][0][0]
    assert done["new"].adapter == "hot@v2" and done["new"].token_ids == references[i_v2][0][0]
    _assert_all_free(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-3), ("bfloat16", 0.06)])
def test_cuda_mixed_batch_with_triton_kernels(tiny_llama_dir, adapter_dirs, references, dtype, tol):
    """The same mixed batch on the GPU (Triton paged attention + SGMV), fp32 and bf16."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype=dtype, block_size=16,
                                 adapters=str(next(iter(adapter_dirs.values())).parent), max_lora_rank=32,
                                 pool_bytes=64 << 20))
    params = SamplingParams(max_tokens=MAX_NEW if dtype == "float32" else 1, temperature=0.0, logprobs=5)
    outs = engine.generate(_prompts(), params, adapters=[a for a, _ in PLAN])
    for i, out in enumerate(outs):
        tokens, lps = references[i][0]
        if dtype == "float32":
            assert out.token_ids == tokens, f"request {i}"
        for step, lp in enumerate(out.logprobs):
            if out.token_ids[: step + 1] != tokens[: step + 1]:
                break
            assert max(abs(v - lps[step][t].item()) for t, v in lp.top) < tol, f"request {i} step {step}"
    _assert_all_free(engine)


def test_long_prompts_span_several_lora_segments(tiny_llama_dir, adapter_dirs, monkeypatch):
    """A prefill longer than one LoRA kernel segment is cut into several segments of one slot; the
    result equals PEFT running the adapter alone (a prefill-sized batch: the activation path too)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from lorafleet.worker import lora_linear
    from lorafleet.worker.lora_linear import folds_act

    # The engine folds at 64-token segments (steps of 1,024 tokens or more); this tiny model's prompts
    # are shorter: fold from 16 tokens per segment here, so the folded path is checked against PEFT.
    monkeypatch.setattr(lora_linear, "FUSED_ACT_MIN_SEGMENT_TOKENS", 16)
    rng = random.Random(7)
    # 112 prompt tokens, all with an adapter: 16-token segments (5 and 2), 16 per segment on average.
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (80, 32)]
    names = ["all8", "pat32"]
    engine = _engine(tiny_llama_dir, next(iter(adapter_dirs.values())).parent)
    segments, sizes = [], []
    orig = engine.runner.prepare

    def spy(batch):
        ctx, samplers = orig(batch)
        if ctx.lora is not None:
            segments.append(ctx.lora.seg_slots.tolist())
            sizes.append((ctx.lora.num_tokens, ctx.lora.every_token, folds_act(ctx.lora, ctx.lora.num_tokens)))
        return ctx, samplers

    engine.runner.prepare = spy
    outs = engine.generate(prompts, GREEDY, adapters=names)
    assert max(len(s) for s in segments) > len(set(max(segments, key=len)))  # some slot was really cut
    assert (sum(len(p) for p in prompts), True, True) in sizes  # one prefill step of every prompt token, all adapted: the folded activation
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        peft_model = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32), adapter_dirs[name]).eval()
        tokens, logprobs = _greedy(peft_model, prompt)
        assert out.token_ids == tokens, name


def test_a_version_registered_again_with_a_higher_rank_is_served_at_its_own_rank(tiny_llama_dir, adapter_dirs,
                                                                                references):
    """A key dropped and registered again with other weights (an operator's `v1` reused) is served at the new
    adapter's rank from its first step: a rank remembered for the old weights cut the new ones to it (the
    kernels clamp every slot to the batch's largest rank)."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_lora_rank=32,
                                 block_size=16))
    index = next(i for i, (name, _) in enumerate(PLAN) if name == "pat32")
    prompt = _prompts()[index]
    engine.register_adapter("x", adapter_dirs["qv4"], version="v1")  # rank 4
    engine.generate([prompt], GREEDY, adapters=["x"])
    engine.unregister_adapter("x")
    assert "x@v1" not in {d["key"] for d in engine.adapter_pool.describe()}
    add, served = engine.adapter_pool.add, []

    def add_then_step(*args, **kwargs):  # a step of the engine thread right after the pool took the weights
        add(*args, **kwargs)
        served.append(engine.generate([prompt], GREEDY, adapters=["x"])[0].token_ids)

    engine.adapter_pool.add = add_then_step
    engine.register_adapter("x", adapter_dirs["pat32"], version="v1")  # rank 32
    engine.adapter_pool.add = add
    assert served == [references[index][0][0]]
    assert engine.generate([prompt], GREEDY, adapters=["x"])[0].token_ids == references[index][0][0]


def test_an_adapter_ending_its_answers_with_its_own_token_of_the_base_vocabulary_ends_on_it(tiny_llama_dir, tmp_path):
    """An instruct fine-tune of a base model ends its turns with its chat template's token, one the base's
    vocabulary has but not as its EOS: its requests end on it as on EOS (finish_reason stop, no stop_reason, its
    text left out, masked by min_tokens, ignored with ignore_eos). They used to run on to max_tokens. Requests of
    other adapters and of the base keep ending on the base's EOS alone."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from tests.lora_factory import make_peft_adapter

    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_special_tokens(["<|eot|>"])
    tok.save(str(base / "tokenizer.json"))
    eot = tok.token_to_id("<|eot|>")
    chat = tmp_path / "adapters" / "chat"
    make_peft_adapter(base, chat, rank=4, seed=1, targets=["q_proj", "v_proj"])
    shutil.copy(base / "tokenizer.json", chat / "tokenizer.json")  # the very same vocabulary
    config = json.loads((base / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|eot|>"}))
    shutil.copytree(chat, tmp_path / "adapters" / "plain")
    (tmp_path / "adapters" / "plain" / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", adapters=str(tmp_path / "adapters")))
    emits = {"logit_bias": {eot: 100.0}, "temperature": 0.0}  # the fine-tune's habit, emulated
    ended, late, ignored, plain, alone = engine.generate(
        [[72, 105]] * 5, [SamplingParams(max_tokens=12, **emits), SamplingParams(max_tokens=12, min_tokens=3, **emits),
                          SamplingParams(max_tokens=12, ignore_eos=True, **emits), SamplingParams(max_tokens=12, **emits),
                          SamplingParams(max_tokens=12, **emits)], adapters=["chat", "chat", "chat", "plain", None])
    assert (ended.finish_reason, ended.stop_reason, ended.token_ids) == ("stop", None, [eot])
    assert late.finish_reason == "stop" and len(late.token_ids) == 4 and eot not in late.token_ids[:3]
    assert ignored.finish_reason == "length" and ignored.token_ids == [eot] * 12
    assert plain.finish_reason == alone.finish_reason == "length"  # the base's EOS alone ends them
    add, known = engine.adapter_pool.add, []  # known before a request can resolve to the version (a push thread)
    engine.adapter_pool.add = lambda key, *a, **k: known.append(key in engine.adapter_eos) or add(key, *a, **k)
    for version in ("v2", "v3", "v4"):  # versions pushed and replaced are forgotten at the next push
        engine.register_adapter("chat", chat, version=version)
    assert known == [True] * 3
    assert set(engine.adapter_eos) - set(engine.adapters()) <= {"chat@v3"} and engine.adapter_eos["chat@v4"] == {eot}
    engine.unregister_adapter("chat")
    assert set(engine.adapter_eos) == set(engine.adapters()) and all(k.startswith("plain@") for k in engine.adapter_eos)
    word = tok.token_to_id("the") if tok.token_to_id("the") is not None else 100
    config["eos_token"] = tok.id_to_token(word)  # an ordinary token: never an end (it would cut answers mid-sentence)
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    engine.register_adapter("chat", chat, version="w")
    assert engine.adapter_eos["chat@w"] == frozenset()
