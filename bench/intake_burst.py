"""A burst of simultaneous requests against the intake places: how many are served, how many refused.

    python bench/intake_burst.py --bursts 16 64 256 --out bench/results

Starts `python -m lorafleet.worker` with the embedded model on 127.0.0.1 (no keys: one tenant) and, for each
burst size, opens that many connections at once, each posting a short completion (4 tokens). A worker holds
`--max-intake-requests` requests in intake at once (on 2 cores, 64: 256 MiB of 4 MiB bodies); the others wait
for a place for `--intake-wait-s`, then are refused 429 intake_full. Prints a table (answers by status and code,
the burst's wall time) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_io import start_worker_process, write_json  # same folder


async def burst(url: str, n: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async with s.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def one(i: int) -> str:
            req = {"model": model, "prompt": f"Hello {i}", "max_tokens": 4, "temperature": 0}
            async with s.post(f"{url}/v1/completions", json=req) as r:
                body = await r.json()
                return f"{r.status} {(body.get('error') or {}).get('code') or ''}".strip()

        t0 = time.monotonic()
        answers = collections.Counter(await asyncio.gather(*[one(i) for i in range(n)]))
        return {"requests": n, "answers": dict(answers), "seconds": round(time.monotonic() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, nargs="+", default=[16, 64, 256], help="simultaneous requests of each burst")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="added to the JSON file's name (e.g. a code version)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_worker_process([sys.executable, "-m", "lorafleet.worker", "--port", "0"],
                                         Path(tmp) / "worker.log")
        try:
            results = []
            for n in args.bursts:
                results.append(asyncio.run(burst(url, n)))
                print(f"burst of {n:4d}: {results[-1]['answers']} in {results[-1]['seconds']} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    date = datetime.date.today().isoformat()
    write_json(args.out, "intake_burst" + (f"_{args.tag}" if args.tag else ""), date, "cpu",
               {"date": date, "cpus": os.cpu_count(), "bursts": results,
                "command": " ".join(["python bench/intake_burst.py", *sys.argv[1:]])})


if __name__ == "__main__":
    main()
