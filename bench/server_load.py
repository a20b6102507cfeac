"""Load on a real worker over HTTP: throughput and latency, one adapter vs many mixed in one batch.

    python bench/server_load.py --model DIR --num-adapters 8 --requests 64 --concurrency 32 --max-tokens 32

Makes `--num-adapters` random PEFT adapters (rank 8, all projections) for the model, starts
`python -m lorafleet.worker` on 127.0.0.1, and fires the same streaming workload twice: every request
on one adapter, then requests spread uniformly over all adapters. Reports generated tokens/s, TTFT and
end-to-end p50/p99, and the mean adapters per engine step from the worker's own histogram; writes
JSON to bench/results/server_load_<date>_<device>.json (or --out). The ratio mixed/single is the cost of serving many tenants in
one batch (the seed brief's reference on an A100: 0.9-0.95x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_io import start_worker_process  # same folder


def make_random_model(out: Path, hidden: int, layers: int) -> Path:
    """A random Llama with a byte-level tokenizer, for machines without the embedded model."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=258, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         max_position_embeddings=2048, bos_token_id=256, eos_token_id=257)
    LlamaForCausalLM(config).save_pretrained(out)
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=ord))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return out


def make_adapters(model_dir: Path, out: Path, num: int, rank: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for i in range(num):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        model.save_pretrained(out / f"bench-{i}")


def start_worker(model_dir: Path, adapters: Path, device: str, max_num_seqs: int, log: Path) -> tuple:
    cmd = [sys.executable, "-m", "lorafleet.worker", "--model", str(model_dir), "--adapters", str(adapters),
           "--device", device, "--port", "0", "--max-num-seqs", str(max_num_seqs), "--served-model-name", "base"]
    return start_worker_process(cmd, log)


async def one(session: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "prompt": f"Request {i}: tell me a story about the number {i}.",
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif ttft is None:  # the first event carries the first token
                ttft = time.perf_counter() - t0
    return {"ttft": ttft or 0.0, "e2e": time.perf_counter() - t0, "tokens": tokens}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def scenario(url: str, models: list[str], requests: int, concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def limited(session, i):
        async with sem:
            return await one(session, url, models[i % len(models)], i, max_tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await one(session, url, models[0], -1, 4)  # warm-up: first-use adapter load, allocator
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(session, i) for i in range(requests)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"adapters": len(models), "requests": requests, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_s": round(pct([r["ttft"] for r in results], 0.5), 4),
            "ttft_p99_s": round(pct([r["ttft"] for r in results], 0.99), 4),
            "e2e_p50_s": round(pct([r["e2e"] for r in results], 0.5), 4),
            "e2e_p99_s": round(pct([r["e2e"] for r in results], 0.99), 4)}


async def adapters_per_step(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("lorafleet_adapters_per_batch_sum"):
            total = float(line.split()[-1])
        elif line.startswith("lorafleet_adapters_per_batch_count"):
            count = float(line.split()[-1])
    return round(total / count, 2) if count else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF-style model directory")
    p.add_argument("--random-model", metavar="HIDDEN,LAYERS", help="use a random Llama of this size instead")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", help="JSON file (default: bench/results/server_load_<date>_<device>.json, so a run "
                                 "leaves the results of other days and devices alone)")
    args = p.parse_args()
    if args.out is None:
        stamp = time.strftime("%Y%m%d")
        args.out = str(Path(__file__).parent / "results" / f"server_load_{stamp}_{args.device.split(':')[0]}.json")
    if not args.model and not args.random_model:
        p.error("give --model or --random-model")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.random_model:
            hidden, layers = map(int, args.random_model.split(","))
            args.model = str(make_random_model(tmp / "model", hidden, layers))
        make_adapters(Path(args.model), tmp / "adapters", args.num_adapters, args.rank)
        proc, url = start_worker(Path(args.model), tmp / "adapters", args.device, args.concurrency, tmp / "w.log")
        try:
            names = [f"bench-{i}" for i in range(args.num_adapters)]
            # Warm-up, discarded: every adapter resident, kernels compiled for the batch shapes.
            asyncio.run(scenario(url, names, 2 * args.concurrency, args.concurrency, args.max_tokens))
            single = asyncio.run(scenario(url, names[:1], args.requests, args.concurrency, args.max_tokens))
            mixed = asyncio.run(scenario(url, names, args.requests, args.concurrency, args.max_tokens))
            mixed["mean_adapters_per_step_overall"] = asyncio.run(adapters_per_step(url))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    result = {"model": args.random_model and f"random Llama hidden,layers={args.random_model}" or args.model,
              "device": args.device, "num_adapters": args.num_adapters, "rank": args.rank, "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "single_adapter": single, "mixed_adapters": mixed,
              "mixed_over_single_throughput": round(mixed["tokens_per_s"] / single["tokens_per_s"], 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
