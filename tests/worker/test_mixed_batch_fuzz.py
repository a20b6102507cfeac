"""Randomized mixed-batch property: a request gives the same tokens in a batch that mixes many PEFT adapters as it
gives alone on a fresh engine holding only its adapter, and as HF PEFT gives with that adapter merged
(merge_and_unload, float32), for every rank, alpha and target-module set.

test_multi_lora.py checks this for four hand-picked adapters. Here each seed draws six more: ranks 1-64 (1-128 on
seeds not divisible by 3, served with max_lora_rank 128), lora_alpha 0.3 to 3 times r (times sqrt(r) with rsLoRA),
integral or not, rank_pattern and alpha_pattern keyed by full name, by projection and by regex, some saved in
bfloat16, and target modules of each kind in TARGET_KINDS (cycled over the seeds: seeds 0 and 1 draw every kind).
Requests: one to three per adapter and a few on the base model, prompts of 1 to 100 tokens, some equal to another
adapter's prompt or sharing a prefix with one. Odd seeds serve the tied-embeddings Llama.

A slot, rank, scale or segment that leaks from one adapter to another shows only when adapters of different shapes
share a step, and only in some layouts of it: each request is checked in every engine of `scenarios`: all at once;
the folded gate|up activation on segments of 5 or 16 tokens; chunked prefill (steps of 7 to 32 tokens) with
staggered joins, one to three adapters a step and prefix caching; two or three slots and pages for one adapter and
the longest request, with a CPU tier of one byte (adapters evicted and read from disk again); every adapter pinned
with KV room for the longest request alone (requests preempted and recomputed). Some requests name an alias of
their adapter's weights (a second name, a canary version).

Near-ties: where the tokens part at a step whose reference holds its two best tokens within TIE_GAP, the request's
comparison ends there (float32 rounding, not a defect). Logprobs agree within LP_TOL at every step before.

LORAFLEET_FUZZ_SEEDS=0,1,2,3,... runs other seeds (a longer local sweep); the Triton and sampled runs take the first.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorafleet.worker import Engine, EngineConfig, SamplingParams, lora_linear

# Random rank_pattern / alpha_pattern keys may name modules an adapter does not target: PEFT warns and ignores them.
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
SEEDS = [int(s) for s in os.environ.get("LORAFLEET_FUZZ_SEEDS", "0,1").split(",") if s]
NUM_ADAPTERS = 6
LP_TOL = 2e-4
TIE_GAP = 2e-3
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL = ATTN + MLP
TARGET_KINDS = ("qv", "all", "mlp", "attn", "subset", "single", "all-linear", "regex", "layer", "exclude", "full_names")
RANKS = (1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 31, 32, 33, 48, 63, 64)
HIGH_RANKS = (65, 96, 100, 127, 128)


def _module_name(layer: int, proj: str) -> str:
    return f"layers.{layer}.{'self_attn' if proj in ATTN else 'mlp'}.{proj}"


def _targets(kind: str, rng: random.Random) -> dict:
    """LoraConfig fields that choose the adapted modules, of one kind."""
    if kind in ("qv", "all", "mlp", "attn"):
        return {"target_modules": {"qv": ["q_proj", "v_proj"], "all": ALL, "mlp": MLP, "attn": ATTN}[kind]}
    if kind == "subset":
        return {"target_modules": rng.sample(ALL, rng.randint(2, 6))}
    if kind == "single":
        return {"target_modules": [rng.choice(ALL)]}
    if kind == "all-linear":
        return {"target_modules": "all-linear"}
    if kind == "regex":  # a string: matched against the whole module name
        picks = "|".join(rng.sample(ALL, rng.randint(1, 4)))
        layer = rf"\.{rng.randint(0, 1)}\..*" if rng.random() < 0.5 else ""
        return {"target_modules": rf".*{layer}\.({picks})"}
    if kind == "layer":
        return {"target_modules": rng.sample(ALL, rng.randint(1, 7)), "layers_to_transform": [rng.randint(0, 1)]}
    if kind == "exclude":
        return {"target_modules": ALL, "exclude_modules": rng.sample(ALL, rng.randint(1, 4))}
    names = [f"model.{_module_name(layer, p)}" for layer in (0, 1) for p in ALL if rng.random() < 0.4]
    return {"target_modules": names or ["model.layers.1.mlp.up_proj"]}


def random_lora_config(rng: random.Random, kind: str, high_ranks: bool) -> dict:
    """LoraConfig kwargs: a random rank and alpha (rsLoRA or not), `kind`'s targets, sometimes rank/alpha patterns."""
    rank = lambda: rng.choice(HIGH_RANKS) if high_ranks and rng.random() < 0.4 else rng.choice(RANKS)
    r, use_rslora = rank(), rng.random() < 0.35
    alpha = math.exp(rng.uniform(math.log(0.3), math.log(3.0))) * (math.sqrt(r) if use_rslora else r)
    config = {"r": r, "lora_alpha": max(1, round(alpha)) if rng.random() < 0.5 else alpha, "use_rslora": use_rslora,
              **_targets(kind, rng)}
    if rng.random() < 0.45:
        keys = [_module_name(rng.randint(0, 1), p) for p in rng.sample(ALL, 3)]
        keys += [rng.choice(ALL), rf"layers\.[01]\.mlp\.{rng.choice(MLP)}"]
        config["rank_pattern"] = {k: rank() for k in rng.sample(keys, rng.randint(1, 3))}
        config["alpha_pattern"] = {k: rng.randint(1, 64) if rng.random() < 0.5 else round(rng.uniform(0.5, 40.0), 3)
                                   for k in rng.sample(keys, rng.randint(1, 3))}
    return config


def make_adapter(base_dir, out_dir, seed: int, config: dict, save_dtype=None):
    """A PEFT adapter saved by peft: A ~ 0.15 N(0, 1), B ~ 0.15 N(0, 1) / sqrt(r) (the delta's size does not grow
    with the rank), stored in save_dtype where given."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15 / (math.sqrt(p.shape[1]) if "lora_B" in name else 1))
                if save_dtype is not None:
                    p.data = p.data.to(save_dtype)
    model.save_pretrained(out_dir)
    return out_dir


def draw_case(seed: int, base_dir, root):
    """(rng, adapter dirs by name, requests as (adapter name or None, prompt, max_tokens)) of one seed."""
    rng = random.Random(seed)
    dirs = {}
    for j in range(NUM_ADAPTERS):
        kind = TARGET_KINDS[(NUM_ADAPTERS * seed + j) % len(TARGET_KINDS)]
        config = random_lora_config(rng, kind, high_ranks=max_lora_rank(seed) > 64)
        save_dtype = torch.bfloat16 if rng.random() < 0.15 else None
        dirs[f"s{seed}a{j}"] = make_adapter(base_dir, root / f"s{seed}a{j}", 1000 * seed + j, config, save_dtype)
    requests, prompts = [], []
    for name in [*dirs, *[None] * rng.randint(2, 4)]:
        for _ in range(rng.randint(1, 3) if name else 1):
            u = rng.random()
            if prompts and u < 0.2:
                prompt = list(rng.choice(prompts))
            elif prompts and u < 0.35:
                head = rng.choice(prompts)
                prompt = head[: rng.randint(1, len(head))] + [rng.randrange(256) for _ in range(rng.randint(1, 20))]
            else:
                length = rng.choice([1, 2, 3, 5, 9, 15, 16, 17, 31, 33, 47, 64, 65, 100])
                prompt = [rng.randrange(256) for _ in range(length)]
            prompts.append(prompt)
            requests.append((name, prompt, rng.randint(1, 10)))
    rng.shuffle(requests)
    return rng, dirs, requests


def _models(base_dir, dirs):
    """HF models by adapter name (None: the base), each adapter merged into the base (merge_and_unload)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    load = lambda: LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return {None: load().eval(), **{name: PeftModel.from_pretrained(load(), path).merge_and_unload().eval()
                                    for name, path in dirs.items()}}


def hf_greedy(models, requests):
    """Per request: (greedy tokens, per step {token: logprob} over the vocabulary) of its merged model; a plain
    loop, no EOS, like a request with ignore_eos."""
    refs = []
    with torch.no_grad():
        for name, prompt, max_tokens in requests:
            ids, tokens, steps = list(prompt), [], []
            for _ in range(max_tokens):
                logprobs = torch.log_softmax(models[name](torch.tensor([ids])).logits[0, -1].float(), -1)
                tokens.append(int(logprobs.argmax()))
                steps.append(dict(enumerate(logprobs.tolist())))
                ids.append(tokens[-1])
            refs.append((tokens, steps))
    return refs


def as_reference(out):
    """An engine output as a reference: its tokens and, per step, {token: logprob} of the chosen and top tokens."""
    return out.token_ids, [{**dict(lp.top), lp.token_id: lp.logprob} for lp in out.logprobs]


def first_difference(out, reference) -> str | None:
    """Where out leaves reference (tokens, per-step {token: logprob}); None where it does not, or where it parts
    from it at a near-tie."""
    (tokens, steps), (_, mine) = reference, as_reference(out)
    for step, (got, want) in enumerate(zip(out.token_ids, tokens, strict=False)):
        best = sorted(steps[step].values(), reverse=True)
        if got != want:
            return None if len(best) > 1 and best[0] - best[1] < TIE_GAP else f"step {step}: token {got}, want {want}"
        diff = max(abs(v - steps[step][t]) for t, v in mine[step].items() if t in steps[step])
        if diff > LP_TOL:
            return f"step {step}: logprobs differ by {diff:.2e}"
    return None if len(out.token_ids) == len(tokens) else f"{len(out.token_ids)} tokens, want {len(tokens)}"


def make_engine(base_dir, **kw) -> Engine:
    kw.setdefault("block_size", 16)
    return Engine(EngineConfig(model=str(base_dir), device="cpu", dtype="float32", **kw))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3, ignore_eos=True)


def run_alone(base_dir, dirs, requests, params, max_rank: int):
    """Each request on a fresh engine holding only its adapter (no prefix cache)."""
    outs = []
    for (name, prompt, _), p in zip(requests, params, strict=True):
        engine = make_engine(base_dir, enable_prefix_caching=False, max_lora_rank=max_rank)
        (out,) = engine.generate([prompt], p, adapters=[engine.register_adapter(name, dirs[name]) if name else None])
        outs.append(out)
    return outs


def run_staggered(engine, requests, params, adapters, rng):
    """Adds the requests in a random order, zero to two a step after a random first group (prefills join decodes);
    returns the outputs in request order."""
    order = list(range(len(requests)))
    rng.shuffle(order)
    first = rng.randint(1, len(order))
    pending, ids, done = order[first:], {}, {}

    def add(i):
        ids[engine.add_request(f"r{i}", requests[i][1], params[i], adapter=adapters[i])] = i

    for i in order[:first]:
        add(i)
    for _ in range(5000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                add(pending.pop(0))
        done |= {ids[out.request_id]: out for out in engine.step() if out.finished}
        if not pending and not engine.has_unfinished():
            return [done[i] for i in range(len(requests))]
        if engine.last_batch_size == 0 and engine.has_unfinished():
            engine.adapter_pool.wait_idle()  # every waiting request's adapter is still loading
    raise AssertionError("the engine did not finish the requests in 5000 steps")


def register(engine, dirs, *, pinned: bool = False):
    """Every adapter under its own name; the first three's weights again under other keys (a second version, a
    canary; another name). Returns (key by name, alias key by name)."""
    keys = {name: engine.register_adapter(name, path, pinned=pinned) for name, path in dirs.items()}
    names = list(dirs)
    aliases = {names[0]: engine.register_adapter("ver", dirs[names[0]], version="v1", pinned=pinned),
               names[1]: engine.register_adapter("ver", dirs[names[1]], version="v2", pinned=pinned,
                                                 make_current=False),
               names[2]: engine.register_adapter("dup", dirs[names[2]], pinned=pinned)}
    return keys, aliases


def adapter_pages(base_dir, dirs, *, every: bool, **cfg) -> int:
    """Pages of an engine of cfg that all of register's keys take together (every), or the largest alone."""
    probe = make_engine(base_dir, **cfg)
    keys, aliases = register(probe, dirs)
    pages = []
    for key in [*keys.values(), *aliases.values()]:
        before = probe.page_pool.num_used("adapter")
        probe.adapter_pool.load(key)
        pages.append(probe.page_pool.num_used("adapter") - before)
        if not every:
            probe.adapter_pool.evict(key)
    return sum(pages) if every else max(pages)


@dataclass
class Scenario:
    config: dict  # EngineConfig fields
    fold: bool = False  # the gate|up activation folded at every segment (FUSED_ACT_MIN_SEGMENT_TOKENS = 1)
    stagger: bool = False  # requests join a few a step (run_staggered), not all at once
    evicts: bool = False  # slots and pages too few, a CPU tier of one byte: adapters leave and are read from disk again
    preempts: bool = False  # every key pinned, KV room for the longest request alone, 16-token steps: preemptions


def scenarios(rng: random.Random, base_dir, dirs, requests, max_rank: int) -> dict[str, Scenario]:
    """The engines every request is checked in, their sizes drawn by rng (page budgets measured on probe engines)."""
    longest = max(len(p) + n for _, p, n in requests)
    tight = {"block_size": rng.choice([4, 8]), "max_loras": rng.choice([2, 3]), "lora_segment_len": rng.choice([5, 64]),
             "max_lora_rank": max_rank}
    tight["num_pages"] = (adapter_pages(base_dir, dirs, every=False, **tight) + -(-longest // tight["block_size"])
                          + rng.randint(1, 3))
    pinned = {"block_size": 4, "max_num_batched_tokens": 16, "max_lora_rank": max_rank}
    pinned["num_pages"] = adapter_pages(base_dir, dirs, every=True, **pinned) + -(-longest // 4)
    return {
        "together": Scenario({"max_lora_rank": max_rank}),
        "folded": Scenario({"lora_segment_len": rng.choice([5, 16]), "block_size": 8, "max_lora_rank": max_rank},
                           fold=True),
        "chunked": Scenario({"block_size": 4, "max_num_batched_tokens": rng.choice([7, 13, 32]),
                             "enable_prefix_caching": True, "max_loras_per_batch": rng.choice([1, 2, 3]),
                             "max_lora_rank": max_rank},
                            fold=rng.random() < 0.5, stagger=True),
        "evicting": Scenario(tight, fold=rng.random() < 0.5, stagger=True, evicts=True),
        "preempting": Scenario(pinned, preempts=True),
    }


def max_lora_rank(seed: int) -> int:
    return 64 if seed % 3 == 0 else 128


def base_model_for(seed: int, request) -> Path:
    return request.getfixturevalue("tiny_llama_tied_dir" if seed % 2 else "tiny_llama_dir")


@pytest.mark.parametrize("seed", SEEDS)
def test_mixed_batches_match_the_request_alone_and_peft_merged(seed, request, tmp_path, monkeypatch):
    """Every request, in every scenario, gives the tokens (and logprobs within LP_TOL) of PEFT merged and of itself
    alone; every adapter changes the model; "evicting" really evicts adapters and "preempting" preempts requests."""
    base_dir = base_model_for(seed, request)
    rng, dirs, requests = draw_case(seed, base_dir, tmp_path)
    max_rank = max_lora_rank(seed)
    models = _models(base_dir, dirs)
    refs = hf_greedy(models, requests)
    probe = torch.tensor([random.Random(seed).choices(range(256), k=16)])
    with torch.no_grad():  # every adapter changes the model, else equality would prove nothing
        base = torch.log_softmax(models[None](probe).logits, -1)
        for name in dirs:
            moved = float((torch.log_softmax(models[name](probe).logits, -1) - base).abs().max())
            assert moved > 1e-2, f"adapter {name} hardly changes the model ({moved:.1e})"
    params = [greedy(n) for _, _, n in requests]
    alone = run_alone(base_dir, dirs, requests, params, max_rank)
    problems = [f"alone, request {i} ({requests[i][0]}): {d}"
                for i, (out, ref) in enumerate(zip(alone, refs, strict=True)) if (d := first_difference(out, ref))]
    for label, sc in scenarios(rng, base_dir, dirs, requests, max_rank).items():
        monkeypatch.setattr(lora_linear, "FUSED_ACT_MIN_SEGMENT_TOKENS", 1 if sc.fold else 48)
        engine = make_engine(base_dir, **sc.config)
        keys, aliases = register(engine, dirs, pinned=sc.preempts)
        if sc.evicts:  # an adapter evicted from the GPU leaves the CPU tier too: its next load re-reads the folder
            engine.adapter_pool.configure(cpu_budget_bytes=1)
        adapters = [aliases[a] if a in aliases and rng.random() < 0.5 else keys.get(a) for a, _, _ in requests]
        if sc.stagger:
            outs = run_staggered(engine, requests, params, adapters, rng)
        else:
            outs = engine.generate([p for _, p, _ in requests], params, adapters=adapters)
        for i, out in enumerate(outs):
            where = f"{label} {sc}, request {i} ({adapters[i]})"
            if out.finish_reason != "length":
                problems.append(f"{where}: finished {out.finish_reason} {out.error}")
                continue
            against = (("PEFT merged", refs[i]), ("alone", as_reference(alone[i])))
            problems += [f"{where} vs {kind}: {d}" for kind, ref in against if (d := first_difference(out, ref))]
        evictions = engine.adapter_pool.stats()["evictions"]
        assert not sc.evicts or (sum(evictions["gpu"].values()) > 0 and evictions["cpu"].get("budget")), evictions
        assert not sc.preempts or engine.num_preemptions > 0
    assert not problems, "\n".join(problems[:20])


def test_mixed_batches_on_triton_match_peft_merged(request, tmp_path, monkeypatch):
    """The engine on kernel_backend='triton' (the interpreter on CPU): the first request of each adapter and of the
    base, short prompts, a few tokens each, with chunked prefill, staggered joins and the folded activation, gives
    PEFT merged's tokens and logprobs."""
    seed = SEEDS[0]
    base_dir = base_model_for(seed, request)
    rng, dirs, requests = draw_case(seed, base_dir, tmp_path)
    firsts = {name: (name, prompt[:12], min(n, 3)) for name, prompt, n in reversed(requests)}
    requests = list(firsts.values())
    refs = hf_greedy(_models(base_dir, dirs), requests)
    monkeypatch.setattr(lora_linear, "FUSED_ACT_MIN_SEGMENT_TOKENS", 1)
    engine = make_engine(base_dir, kernel_backend="triton", block_size=4, max_num_batched_tokens=16,
                         max_lora_rank=max_lora_rank(seed), lora_segment_len=5)
    adapters = [engine.register_adapter(name, dirs[name]) if name else None for name, _, _ in requests]
    outs = run_staggered(engine, requests, [greedy(n) for _, _, n in requests], adapters, rng)
    problems = [f"request {i} ({adapters[i]}): {d}" for i, (out, ref) in enumerate(zip(outs, refs, strict=True))
                if (d := first_difference(out, ref))]
    assert not problems, "\n".join(problems)


def test_sampled_requests_and_prompt_logprobs_in_a_mixed_batch(request, tmp_path, monkeypatch):
    """Seeded sampling (temperature, top_p, top_k), chunked prefill, three slots for six adapters: a request of the
    mixed batch samples the tokens it samples alone; its prompt logprobs equal PEFT merged's log_softmax."""
    seed = SEEDS[0]
    base_dir = base_model_for(seed, request)
    rng, dirs, requests = draw_case(seed, base_dir, tmp_path)
    params = [SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.7, 1.0, 1.3]),
                             top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 5, 40]), seed=rng.randrange(1 << 30),
                             logprobs=2, prompt_logprobs=rng.choice([0, 2]), ignore_eos=True) for _ in requests]
    alone = run_alone(base_dir, dirs, requests, params, max_lora_rank(seed))
    monkeypatch.setattr(lora_linear, "FUSED_ACT_MIN_SEGMENT_TOKENS", 1)
    engine = make_engine(base_dir, block_size=4, max_num_batched_tokens=rng.choice([9, 40]), max_loras=3,
                         max_lora_rank=max_lora_rank(seed))
    keys = {name: engine.register_adapter(name, path) for name, path in dirs.items()}
    outs = engine.generate([p for _, p, _ in requests], params, adapters=[keys.get(a) for a, _, _ in requests])
    models = _models(base_dir, dirs)
    for i, ((name, prompt, _), out) in enumerate(zip(requests, outs, strict=True)):
        assert out.token_ids == alone[i].token_ids, f"request {i} ({name})"
        for lp, lq in zip(out.logprobs, alone[i].logprobs, strict=True):
            assert abs(lp.logprob - lq.logprob) < LP_TOL, f"request {i} ({name})"
        if len(prompt) < 2:
            continue
        with torch.no_grad():
            want = torch.log_softmax(models[name](torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token_id == prompt[pos]
            diffs = [abs(v - want[pos - 1, t].item()) for t, v in [(lp.token_id, lp.logprob), *lp.top]]
            assert max(diffs) < LP_TOL, f"request {i} ({name}) position {pos}"
