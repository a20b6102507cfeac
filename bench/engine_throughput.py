"""Offline engine throughput: one base model, N requests spread over K adapters, decoded together.

    python bench/engine_throughput.py                       # embedded SmolLM2, random adapters
    python bench/engine_throughput.py --adapters 0          # base model only
    python bench/engine_throughput.py --device cuda --dtype bfloat16 --num-requests 256
    python bench/engine_throughput.py --device cuda --no-cuda-graphs    # decode steps run eagerly

Adapters are random PEFT-shaped LoRA weights of rank --rank on all seven projections, registered
straight into the engine's adapter pool (no files). Prints one JSON line: wall time, generated
tokens/s, process CPU seconds, steps, mean sequences and adapters per step, preemptions.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from lorafleet.kernels.lora_layout import PROJS
from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.peft_adapter import LoRAWeights, ModuleLoRA


def random_adapter(engine: Engine, name: str, rank: int, seed: int) -> LoRAWeights:
    mc = engine.model_config
    shapes = {"q_proj": (mc.hidden_size, mc.q_size), "k_proj": (mc.hidden_size, mc.kv_size),
              "v_proj": (mc.hidden_size, mc.kv_size), "o_proj": (mc.q_size, mc.hidden_size),
              "gate_proj": (mc.hidden_size, mc.intermediate_size), "up_proj": (mc.hidden_size, mc.intermediate_size),
              "down_proj": (mc.intermediate_size, mc.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for layer in range(mc.num_hidden_layers):
        for proj in PROJS:
            fan_in, fan_out = shapes[proj]
            a = (torch.randn(rank, fan_in, generator=g) * 0.01).to(engine.dtype)
            b = (torch.randn(fan_out, rank, generator=g) * 0.01).to(engine.dtype)
            modules[(layer, proj)] = ModuleLoRA(a=a, b=b, scale=2.0)
    nbytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    return LoRAWeights(name=name, version="bench", base_model=engine.model_name, modules=modules, nbytes=nbytes)


def register_random_adapters(engine: Engine, num: int, rank: int) -> list[str]:
    """Registers bench0..bench{num-1} (version "bench") and makes them GPU-resident; returns names."""
    names = []
    for i in range(num):
        key = f"bench{i}@bench"
        engine.adapter_pool.add(key, random_adapter(engine, f"bench{i}", rank, i))
        engine.adapter_pool.load(key)
        names.append(f"bench{i}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4, help="distinct adapters (0 = base only)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="replay decode steps from CUDA graphs (cuda only)")
    args = ap.parse_args()

    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                 max_num_seqs=args.max_num_seqs, max_lora_rank=max(args.rank, 16),
                                 cuda_graphs=args.cuda_graphs))
    names = register_random_adapters(engine, args.adapters, args.rank)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    adapters = [names[i % len(names)] if names else None for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    engine.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), adapters=adapters[:2])  # warm-up
    sizes, loras = [], []
    orig_step = engine.step

    def step():
        outs = orig_step()
        sizes.append(engine.last_batch_size)
        loras.append(engine.last_batch_adapters)
        return outs

    engine.step = step
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params, adapters=adapters)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    generated = sum(len(o.token_ids) for o in outs)
    print(json.dumps({
        "model": engine.model_name, "device": args.device, "dtype": str(engine.dtype).removeprefix("torch."),
        "requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "adapters": args.adapters, "rank": args.rank, "cuda_graphs": engine.runner.graphs is not None,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),  # process CPU time: less sensitive than wall time to a busy machine
        "gen_tokens_per_s": round(generated / wall, 1),
        "total_tokens_per_s": round((generated + args.num_requests * args.prompt_len) / wall, 1),
        "steps": len(sizes), "mean_seqs_per_step": round(sum(sizes) / max(len(sizes), 1), 2),
        "mean_adapters_per_step": round(sum(loras) / max(len(loras), 1), 2),
        "preemptions": engine.scheduler.num_preemptions,
    }))
    engine.close()


if __name__ == "__main__":
    main()
