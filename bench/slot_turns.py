"""One tenant's burst of adapters against another tenant's one: how long the other waits for a GPU slot.

    python bench/slot_turns.py --seconds 25 --burst 12 --out bench/results

Starts `python -m lorafleet.worker` with the embedded model on 127.0.0.1, `--max-loras 4` (four GPU slots; on a
CPU the slots are the same pool pages), and two tenants: `a` owns one adapter, `b` owns `--burst` of them (copies
of the demo adapter `shout` under other names). Tenant a sends 32-token completions on its adapter one after
another; after a warm-up, tenant b runs one client per adapter, each sending 24-token completions, for
`--seconds`. Each of b's requests frees its slot when it ends: a slot that frees goes to a waiting adapter, and a
request of a waits for one whenever a's adapter was evicted between its requests. Prints a table (a's requests
during b's burst and their time to first token, b's requests) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_io import start_worker_process, write_json  # same folder

DEMO = Path(__file__).resolve().parent.parent / "examples" / "adapters" / "shout"


async def run(url: str, burst: int, seconds: float) -> dict:
    stop, a_ttft, b_done = asyncio.Event(), [], []

    async def a_loop(s: aiohttp.ClientSession, during: list[float]) -> None:
        while not stop.is_set():
            req = {"model": "a", "prompt": "Words: red fish open sky\nReply:", "max_tokens": 32, "stream": True,
                   "temperature": 0, "ignore_eos": True}
            t0, first = time.monotonic(), None
            async with s.post(f"{url}/v1/completions", json=req, headers={"Authorization": "Bearer key-a"}) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.monotonic() - t0
            during.append(first)

    async def b_loop(s: aiohttp.ClientSession, i: int) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            req = {"model": f"b{i}", "prompt": "Words: red fish open sky\nReply:", "max_tokens": 24, "temperature": 0,
                   "ignore_eos": True}
            async with s.post(f"{url}/v1/completions", json=req, headers={"Authorization": "Bearer key-b"}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            b_done.append(time.monotonic())

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        warm: list[float] = []
        a = asyncio.create_task(a_loop(s, warm))
        await asyncio.sleep(4.0)  # a's adapter on the GPU, its first requests' one-time costs paid
        warm.clear()
        await asyncio.gather(*[b_loop(s, i) for i in range(burst)])
        a_ttft.extend(t for t in warm if t is not None)
        stop.set()
        await a
    return {"a_requests": len(a_ttft), "a_ttft_s": [round(t, 3) for t in a_ttft],
            "a_ttft_max_s": round(max(a_ttft), 3) if a_ttft else None,
            "a_ttft_median_s": round(statistics.median(a_ttft), 3) if a_ttft else None, "b_requests": len(b_done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=25.0, help="how long tenant b's clients send requests")
    ap.add_argument("--burst", type=int, default=12, help="tenant b's adapters, one client each")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="added to the JSON file's name (e.g. a code version)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "adapters"
        for name in ["a", *(f"b{i}" for i in range(args.burst))]:
            shutil.copytree(DEMO, folder / name)
        keys = Path(tmp) / "keys.yaml"
        keys.write_text("tenants:\n  a: {keys: [key-a], adapters: [a]}\n  b: {keys: [key-b], adapters: ['b*']}\n")
        cmd = [sys.executable, "-m", "lorafleet.worker", "--port", "0", "--api-keys-file", str(keys),
               "--adapters", str(folder), "--max-loras", "4"]
        proc, url = start_worker_process(cmd, Path(tmp) / "worker.log")
        try:
            result = asyncio.run(run(url, args.burst, args.seconds))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"tenant a: {result['a_requests']} requests during b's burst, time to first token median "
          f"{result['a_ttft_median_s']} s, max {result['a_ttft_max_s']} s; tenant b: {result['b_requests']} requests "
          f"on {args.burst} adapters", flush=True)
    date = datetime.date.today().isoformat()
    write_json(args.out, "slot_turns" + (f"_{args.tag}" if args.tag else ""), date, "cpu",
               {"date": date, "cpus": os.cpu_count(), "seconds": args.seconds, "burst": args.burst, **result,
                "command": " ".join(["python bench/slot_turns.py", *sys.argv[1:]])})


if __name__ == "__main__":
    main()
