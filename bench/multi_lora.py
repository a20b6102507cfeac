"""Multi-LoRA serving vs one adapter vs switching adapters one at a time (the brief's three numbers).

    python bench/multi_lora.py --device cuda --layers 4 --out bench/results

One random model with Llama-3-8B layer shapes (hidden 4096, intermediate 14336, 32 q heads, 8 KV heads,
vocab 128256; `--layers` of them), random rank-16 adapters on all seven projections. The same
requests (prompt --prompt-len, --max-tokens generated, ignore_eos) are served:

* base: no adapter;
* single: every request on one adapter (the single-adapter baseline, 1.0x);
* mixed-K: requests spread over K adapters, decoded together in the same batches;
* switch-K: the naive way, one adapter at a time (all requests of adapter 1, then adapter 2, ...).

Prints a table, writes JSON and a PNG. The brief's reference (A100): mixed 8 ~ 0.9-0.95x of single,
naive switching 0.3-0.5x.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import register_random_adapters  # same folder
from kernel_setup import recorded_command  # same folder
from safetensors.torch import save_file

from lorafleet.worker import Engine, EngineConfig, SamplingParams


def make_model(out: Path, layers: int, device: str) -> Path:
    """Random weights with Llama-3-8B shapes, written straight as safetensors (no tokenizer: token ids)."""
    h, inter, heads, kv, vocab = 4096, 14336, 32, 8, 128256
    d = h // heads
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": w(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                    p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter),
                    p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}))
    return out


def serve(engine: Engine, prompts, adapters, params) -> tuple[float, int]:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, adapters=adapters)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--mixes", default="8,32")
    ap.add_argument("--segment-len", type=int, default=64, help="EngineConfig.lora_segment_len (most tokens per segment)")
    ap.add_argument("--max-lora-rank", type=int, default=64, help="EngineConfig.max_lora_rank, the pool's rank bound (the engine's default: 64)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.cuda_graphs: replay decode steps from CUDA graphs")
    ap.add_argument("--out", default=None, help="folder for JSON and PNG (default: print only)")
    args = ap.parse_args()
    mixes = [int(k) for k in args.mixes.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.layers, args.device)
        engine = Engine(EngineConfig(model=str(model), device=args.device, dtype="bfloat16",
                                     max_num_seqs=args.requests, max_loras=max(mixes) + 1,
                                     max_lora_rank=max(args.rank, args.max_lora_rank), max_num_batched_tokens=8192,
                                     lora_segment_len=args.segment_len, cuda_graphs=args.cuda_graphs))
    names = register_random_adapters(engine, max(mixes), args.rank)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up: compile every kernel shape the runs use.
    n_warm = min(8, len(names), len(prompts))
    serve(engine, prompts[:n_warm], names[:n_warm], SamplingParams(max_tokens=4, ignore_eos=True))
    serve(engine, prompts, [names[i % max(mixes)] for i in range(args.requests)],
          SamplingParams(max_tokens=2, ignore_eos=True))

    rows = {}
    wall, n = serve(engine, prompts, [None] * args.requests, params)
    rows["base"] = (wall, n)
    wall, n = serve(engine, prompts, [names[0]] * args.requests, params)
    rows["single"] = (wall, n)
    for k in mixes:
        adapters = [names[i % k] for i in range(args.requests)]
        rows[f"mixed-{k}"] = serve(engine, prompts, adapters, params)
        total_wall, total_n = 0.0, 0
        for j in range(k):  # naive: one adapter's requests at a time
            idx = [i for i in range(args.requests) if i % k == j]
            w, m = serve(engine, [prompts[i] for i in idx], [names[j]] * len(idx), params)
            total_wall, total_n = total_wall + w, total_n + m
        rows[f"switch-{k}"] = (total_wall, total_n)
    engine.close()

    single_tps = rows["single"][1] / rows["single"][0]
    result = {"date": dt.date.today().isoformat(), "command": recorded_command(),
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "model": f"random Llama-3-8B shapes, {args.layers} layers, bf16", "rank": args.rank,
              "segment_len": args.segment_len, "max_lora_rank": engine.config.max_lora_rank, "cuda_graphs": engine.runner.graphs is not None, "requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "runs": {}}
    print(f"{'run':<12}{'wall s':>9}{'gen tok/s':>12}{'vs single':>11}")
    for name, (wall, n) in rows.items():
        tps = n / wall
        result["runs"][name] = {"wall_s": round(wall, 3), "gen_tokens": n, "gen_tokens_per_s": round(tps, 1),
                                "vs_single": round(tps / single_tps, 3)}
        print(f"{name:<12}{wall:>9.3f}{tps:>12.1f}{tps / single_tps:>10.2f}x")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = (f"multi_lora_{result['date'].replace('-', '')}_{'h200' if 'H200' in result['gpu'] else 'run'}"
                f"_seg{args.segment_len}_r{engine.config.max_lora_rank}{'' if args.cuda_graphs else '_eager'}")
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.5))
        runs = result["runs"]
        ax.bar(list(runs), [r["vs_single"] for r in runs.values()],
               color=["grey", "C0"] + ["C2" if k.startswith("mixed") else "C3" for k in list(runs)[2:]])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("throughput vs one adapter")
        ax.set_title(f"{result['model']}, r={args.rank}, {args.requests} requests ({result['gpu']})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main()
