"""One tenant's flood of bodies of a million small JSON values: what it costs another tenant and /healthz.

    python bench/intake_flood.py --seconds 10 --flooders 8 --out bench/results

Starts `python -m lorafleet.worker` with the embedded model on 127.0.0.1 with two tenants. Tenant `a` streams
greedy 64-token completions one after another while /healthz is polled every 20 ms; tenant `b` posts 4 MB bodies
(each answered 400: an unknown field, or a prompt past the context) from `--flooders` connections. After a
warm-up: first nothing (the baseline), then 1.39M empty lists, 450k `{"": []}` objects, a prompt of 2M token
ids, a text prompt of 4 MB. A JSON parse holds the interpreter lock from start to end, so such a flood once
stalled every thread of the worker; a text's tokenization took 4.4 s of a core before its length was refused. Prints a table (tenant a's tokens/s and longest gap between two tokens or before the first,
/healthz's longest answer, the flood's answers, the worker's peak memory) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_io import start_worker_process, write_json  # same folder

JUNK = {"none": None, "lists": ("[]", 1_390_000), "objects": ('{"": []}', 450_000), "ids": ("1", 2_000_000),
        "text": ("The quick brown fox jumps over the lazy dog. ", 93_000)}


def flood_body(name: str, model: str) -> bytes | None:
    """Tenant b's 4 MB body: a prompt far past the context (token ids, or a text), else an unknown field."""
    if (junk := JUNK[name]) is None:
        return None
    if name == "text":
        return json.dumps({"model": model, "prompt": junk[0] * junk[1], "max_tokens": 1}).encode()
    items = "[" + ",".join([junk[0]] * junk[1]) + "]"
    return (f'{{"model": "{model}", "prompt": {items}, "max_tokens": 1}}' if name == "ids" else
            f'{{"model": "{model}", "prompt": "x", "max_tokens": 1, "junk": {items}}}').encode()


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def phase(url: str, model: str, body: bytes | None, flooders: int, seconds: float) -> dict:
    stop, gaps, health, answers = asyncio.Event(), [], [], {}
    tokens = 0

    async def stream(s: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while not stop.is_set():
            req = {"model": model, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "stream": True,
                   "ignore_eos": True}
            last = time.monotonic()  # the wait for the first token counts as a gap too
            async with s.post(f"{url}/v1/completions", json=req, headers={"Authorization": "Bearer key-a"}) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last, tokens = now, tokens + 1

    async def probe(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            async with s.get(f"{url}/healthz") as r:
                await r.read()
            health.append(time.monotonic() - t0)
            await asyncio.sleep(0.02)

    async def flood(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with s.post(f"{url}/v1/completions", data=body, headers={
                    "Authorization": "Bearer key-b", "Content-Type": "application/json"}) as r:
                await r.read()
                answers[r.status] = answers.get(r.status, 0) + 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.create_task(stream(s)), asyncio.create_task(probe(s))]
        tasks += [asyncio.create_task(flood(s)) for _ in range(flooders if body is not None else 0)]
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    return {"tokens_per_s": round(tokens / wall, 1), "longest_gap_s": round(max(gaps), 3),
            "healthz_longest_s": round(max(health), 3), "flood_answers": {str(k): v for k, v in answers.items()},
            "flood_requests_per_s": round(sum(answers.values()) / wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--flooders", type=int, default=8, help="tenant b's connections posting bodies")
    ap.add_argument("--floods", nargs="+", choices=list(JUNK), default=list(JUNK), help="phases to run, in order")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="added to the JSON file's name (e.g. a code version)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text("tenants:\n  a: {keys: [key-a], adapters: ['*']}\n  b: {keys: [key-b], adapters: ['*']}\n")
        cmd = [sys.executable, "-m", "lorafleet.worker", "--port", "0", "--api-keys-file", str(keys)]
        proc, url = start_worker_process(cmd, Path(tmp) / "worker.log")
        try:
            model = asyncio.run(_first_model(url))
            asyncio.run(phase(url, model, None, 0, 3.0))  # warm-up: the first requests' one-time costs
            results = {}
            for name in args.floods:
                results[name] = asyncio.run(phase(url, model, flood_body(name, model), args.flooders, args.seconds))
                print(f"flood {name:8s}: tenant a {results[name]['tokens_per_s']:7.1f} tokens/s, longest gap "
                      f"{results[name]['longest_gap_s']:.3f} s; /healthz longest {results[name]['healthz_longest_s']:.3f} s;"
                      f" flood {results[name]['flood_requests_per_s']} requests/s {results[name]['flood_answers']}",
                      flush=True)
            peak = peak_rss_mb(proc.pid)
            print(f"worker peak memory: {peak:.0f} MB")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    date = datetime.date.today().isoformat()
    write_json(args.out, "intake_flood" + (f"_{args.tag}" if args.tag else ""), date, "cpu",
               {"date": date, "cpus": os.cpu_count(), "seconds": args.seconds, "flooders": args.flooders,
                "phases": results, "peak_rss_mb": round(peak),
                "command": " ".join(["python bench/intake_flood.py", *sys.argv[1:]])})


async def _first_model(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models", headers={"Authorization": "Bearer key-a"}) as r:
        return json.loads(await r.text())["data"][0]["id"]


if __name__ == "__main__":
    main()
