"""Memory soak: a worker's resident memory under a long mixed load, to tell a leak from a warm-up.

    python bench/memory_soak.py --out bench/results                      # 12 min, embedded SmolLM2 on CPU
    python bench/memory_soak.py --seconds 120 --clients 4 --out /tmp/x   # a short look

Starts `python -m lorafleet.worker` on 127.0.0.1 (a free port) with the demo adapters, and has --clients
official `openai` clients send requests one after another for --seconds: completions or chat, streamed
or not, `n` 1 or 2, logprobs or not, over the three demo adapters and the base model, prompts of 3 to 60
random words. The worker's resident set (VmRSS) is read every --every seconds. A leak grows to the end; a
warm-up (caches filling, allocator arenas) flattens. Prints the samples and writes them as JSON under --out;
the worker is stopped (by PID) on the way out, also on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench_io import write_json  # same folder
from openai import AsyncOpenAI

ADAPTERS = Path(__file__).resolve().parents[1] / "examples" / "adapters"
WORDS = ["red", "fish", "open", "sky", "happy", "king", "stone", "green", "apple", "river", "boat", "cloud", "tree", "rain", "sun", "moon", "star"]


def resident_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def client(api: AsyncOpenAI, models: list[str], seed: int, until: float, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        model, stream = rng.choice(models), rng.random() < 0.5
        prompt = "Words: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + "\nReply:"
        try:
            if rng.random() < 0.5:
                answer = await api.completions.create(model=model, prompt=prompt, max_tokens=rng.randint(4, 40),
                                                      temperature=0.8, n=rng.choice([1, 2]), stream=stream,
                                                      logprobs=rng.choice([None, 2]))
            else:
                answer = await api.chat.completions.create(model=model, max_tokens=rng.randint(4, 40), stream=stream,
                                                           messages=[{"role": "user", "content": prompt}],
                                                           temperature=0.8)
            if stream:
                async for _ in answer:
                    pass
            counts["ok"] += 1
        except Exception as exc:  # counted, and the soak goes on: a failure is a finding, not the end
            counts["failed"] += 1
            print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr)


async def soak(args: argparse.Namespace, port: int, pid: int) -> tuple[list[dict], dict[str, int]]:
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):  # the model converts and loads first: a readiness poll, not a sleep
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2):
                break
        except OSError:
            await asyncio.sleep(0.5)
    else:
        raise RuntimeError("the worker did not answer /v1/models within 5 minutes")
    api = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    models = [p.name for p in sorted(ADAPTERS.iterdir()) if p.is_dir()] + [None]
    counts = {"ok": 0, "failed": 0}
    start = time.monotonic()
    until = start + args.seconds
    tasks = [asyncio.create_task(client(api, [m or args.base_name for m in models], i, until, counts))
             for i in range(args.clients)]
    samples = []
    while time.monotonic() < until:
        samples.append({"s": round(time.monotonic() - start), "rss_mib": resident_mib(pid), **counts})
        print(f"{samples[-1]['s']:6d} s  {samples[-1]['rss_mib']:6d} MiB  {counts['ok']:6d} ok  {counts['failed']} failed")
        await asyncio.sleep(min(args.every, max(until - time.monotonic(), 0)))
    await asyncio.gather(*tasks)
    samples.append({"s": round(time.monotonic() - start), "rss_mib": resident_mib(pid), **counts})
    print(f"{samples[-1]['s']:6d} s  {samples[-1]['rss_mib']:6d} MiB  {counts['ok']:6d} ok  {counts['failed']} failed (end)")
    return samples, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=720)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--base-name", default="SmolLM2-135M-Instruct", help="the worker's base model name")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = subprocess.Popen([sys.executable, "-m", "lorafleet.worker", "--adapters", str(ADAPTERS),
                               "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL)
    try:
        samples, counts = asyncio.run(soak(args, port, worker.pid))
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
    after_warmup = [s for s in samples if s["s"] >= args.seconds // 3]
    growth = after_warmup[-1]["rss_mib"] - after_warmup[0]["rss_mib"] if after_warmup else None
    print(f"growth over the last two thirds: {growth} MiB; {counts['ok']} requests, {counts['failed']} failed")
    shown = {k: v for k, v in vars(args).items() if k != "out"}
    res = {"date": datetime.date.today().isoformat(), "device": "cpu", "args": shown, "samples": samples,
           "growth_last_two_thirds_mib": growth, **counts}
    write_json(args.out, "memory_soak", res["date"], "cpu", res)


if __name__ == "__main__":
    main()
