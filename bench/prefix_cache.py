"""Prefix caching: chat turns that share a system prompt, with and without kept KV blocks.

    python bench/prefix_cache.py --out bench/results              # embedded SmolLM2 on CPU
    python bench/prefix_cache.py --device cuda --dtype bfloat16 --system-tokens 1024 --sessions 32 \
        --random-model 4096,8                                     # a random Llama, hidden 4096, 8 layers

--sessions conversations (one per adapter, round robin over --adapters random adapters; 0: the base model)
share a --system-tokens system prompt; each sends --turns turns, a turn's prompt being the previous turn's
prompt and answer plus a new user message. All sessions' turn k are sent together, then turn k+1. Reported
per setting: wall time, mean time to first token, prompt tokens computed against prompt tokens sent and
against the floor (the tokens no earlier request computed; kept blocks are whole blocks, so each prompt's
last partial block is computed again), and whether the two settings gave the same tokens.
Prints a table and writes the figures as JSON under --out.
"""

from __future__ import annotations

import argparse
import datetime
import random
import tempfile
import time
from pathlib import Path

import torch
from bench_io import device_tag, write_json  # same folder
from engine_throughput import register_random_adapters

from lorafleet.worker import Engine, EngineConfig, SamplingParams


def run(args: argparse.Namespace, caching: bool) -> dict:
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, seed=0,
                                 enable_prefix_caching=caching, max_num_seqs=max(args.sessions, 1)))
    names = register_random_adapters(engine, args.adapters, args.rank) if args.adapters else []
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
    history = {s: list(system) for s in range(args.sessions)}
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    ttfts, sent, tokens = [], 0, {}
    started = time.perf_counter()
    for turn in range(args.turns):
        arrived = {}
        for s in range(args.sessions):
            history[s] += [rng.randrange(100, vocab) for _ in range(args.user_tokens)]
            sent += len(history[s])
            rid = f"s{s}t{turn}"
            engine.add_request(rid, list(history[s]), params, adapter=names[s % len(names)] if names else None)
            arrived[rid] = time.perf_counter()
        firsts = {}
        while engine.has_unfinished():
            for out in engine.step():
                firsts.setdefault(out.request_id, time.perf_counter())
                if out.finished:
                    tokens[out.request_id] = out.token_ids
                    s = int(out.request_id[1:].split("t")[0])
                    history[s] += out.token_ids
        ttfts += [firsts[rid] - t for rid, t in arrived.items()]
    wall = time.perf_counter() - started
    cache = engine.block_manager.prefix_cache
    # Tokens no earlier request computed: the system prompt once per adapter (their KV differs), each user
    # message, and each answer's last token (sampled, never fed back while it was generated).
    new = (len(system) * max(1, min(args.sessions, len(names))) + args.sessions * args.turns * args.user_tokens
           + args.sessions * (args.turns - 1))
    return {"prefix_caching": caching, "wall_s": wall, "mean_ttft_s": sum(ttfts) / len(ttfts),
            "prompt_tokens_sent": sent, "prompt_tokens_computed": sent - (cache.hit_tokens if cache else 0),
            "new_tokens": new, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M)")
    ap.add_argument("--random-model", default=None, metavar="HIDDEN,LAYERS",
                    help="a random Llama of that size instead (byte-level vocabulary, 2048 positions)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.random_model:
        from server_load import make_random_model  # same folder

        hidden, layers = map(int, args.random_model.split(","))
        args.model = str(make_random_model(Path(tempfile.mkdtemp()) / "model", hidden, layers))
    elif args.model is None:
        from lorafleet.worker.default_model import default_model_dir
        args.model = str(default_model_dir())
    rows = [run(args, caching) for caching in (False, True)]
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(f"{'prefix caching':>15} {'wall s':>8} {'mean TTFT s':>12} {'prompt tokens':>14} {'computed':>9} "
          f"{'new':>7}")
    for r in rows:
        print(f"{'on' if r['prefix_caching'] else 'off':>15} {r['wall_s']:8.2f} {r['mean_ttft_s']:12.3f} "
              f"{r['prompt_tokens_sent']:14d} {r['prompt_tokens_computed']:9d} {r['new_tokens']:7d}")
    print(f"wall time off/on: {rows[0]['wall_s'] / rows[1]['wall_s']:.2f}x; TTFT off/on: "
          f"{rows[0]['mean_ttft_s'] / rows[1]['mean_ttft_s']:.2f}x; same tokens: {same}")
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    shown = {**vars(args), "model": Path(args.model).name, "out": None}  # no path of this machine in the results
    res = {"date": datetime.date.today().isoformat(), "gpu": gpu, "args": shown, "same_tokens": same,
           "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
    write_json(args.out, "prefix_cache", res["date"], device_tag(gpu), res)


if __name__ == "__main__":
    main()
