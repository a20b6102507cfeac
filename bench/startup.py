"""Start-up of a GPU worker's engine: Triton compiles, warm-up and CUDA-graph captures, by compile threads.

    python bench/startup.py --layers 32 --out bench/results

One random model with Llama-3-8B shapes (bench/multi_lora.py's) is started in a fresh process per
case, each building the same Engine (bf16, 16 sequences, 8192 batched tokens, LoRA rank bound 64):

* one thread, empty cache: each kernel compiled at its first launch (`--compile-threads 1`);
* N threads, empty cache: the kernels listed first and compiled on N threads (the default);
* N threads, cache kept: the same again over the cache the last case left (a later pod on a node
  whose chart sets worker.compileCache.hostPath), which holds the engine's kernel list as well: the
  kernels are compiled from it, without the listing forwards;
* N threads, cache kept, list gone: the same with the list removed (they are listed again);
* one thread, cache kept: the first case again over its own cache (what the listing pass costs there).

Each case reports the engine's own log lines (compile ahead, warm-up, captures) and the time to
build the Engine. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_io import device_tag  # same folder

_PHASES = {"compile ahead": r"(\d+) Triton kernels (?:listed in ([\d.]+) s|as an earlier start listed them \([^)]*\)), "
                            r"(\d+) of them compiled on (\d+) threads in ([\d.]+) s",
           "warm-up": r"warm-up: \d+ forwards .* in ([\d.]+) s", "capture": r"captured \d+ CUDA graphs .* in ([\d.]+) s"}


def child(model: str, threads: int) -> None:
    """Build the engine once; print its log lines and the time as JSON (a case's own process)."""
    from lorafleet.worker import Engine, EngineConfig

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("lorafleet").addHandler(Keep())
    logging.getLogger("lorafleet").setLevel(logging.INFO)
    t0 = time.perf_counter()
    Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=8192,
                        max_lora_rank=64, compile_threads=threads))
    print(json.dumps({"engine_s": round(time.perf_counter() - t0, 1), "log": lines}))


def run_case(model: Path, threads: int, cache: Path, keep_list: bool = True) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    if not keep_list:
        for path in cache.glob("lorafleet-start-*.json"):
            path.unlink()
    entries = len(list(cache.iterdir())) if cache.exists() else 0
    out = subprocess.run([sys.executable, __file__, "--child", str(model), "--compile-threads", str(threads)],
                         capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["cache_entries_before"] = entries
    for phase, pattern in _PHASES.items():
        for line in result["log"]:
            if m := re.search(pattern, line):
                result[phase] = [float(g or 0) for g in m.groups()] if phase == "compile ahead" else float(m.group(1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--compile-threads", type=int, default=0, help="the threaded cases' threads (0: the engine's default)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: print only)")
    ap.add_argument("--threaded-only", action="store_true", help="skip the one-thread case")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.compile_threads)
        return
    import torch
    from kernel_setup import recorded_command  # same folder
    from multi_lora import make_model  # same folder

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.layers, "cuda")
        torch.cuda.empty_cache()
        cases = [("1 thread, empty cache", 1, Path(tmp) / "cache1", True),
                 ("threads, empty cache", args.compile_threads, Path(tmp) / "cacheN", True),
                 ("threads, cache kept", args.compile_threads, Path(tmp) / "cacheN", True),
                 ("threads, cache, no list", args.compile_threads, Path(tmp) / "cacheN", False),
                 ("1 thread, cache kept", 1, Path(tmp) / "cache1", True)]
        results = {}
        for name, threads, cache, keep_list in cases[1:4] if args.threaded_only else cases:
            results[name] = run_case(model, threads, cache, keep_list)
            print(f"{name}: {results[name]}", flush=True)
    print(f"\n{'case':<24}{'ahead: listed + compiled':>26}{'warm-up s':>11}{'capture s':>11}{'engine s':>10}")
    for name, r in results.items():
        ahead = r.get("compile ahead")
        ahead_s = f"{ahead[2]:.0f}/{ahead[0]:.0f}: {ahead[1]:.1f} + {ahead[4]:.1f} s" if ahead else "-"
        print(f"{name:<24}{ahead_s:>26}{r.get('warm-up', 0):>11.1f}{r.get('capture', 0):>11.1f}{r['engine_s']:>10.1f}")
    if args.out:
        gpu = torch.cuda.get_device_name()
        path = Path(args.out) / f"startup_compile_threads_{dt.date.today():%Y%m%d}_{device_tag(gpu)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"date": f"{dt.date.today()}", "gpu": gpu, "command": recorded_command(),
                                    "layers": args.layers, "cpus": os.cpu_count(), "cases": results}, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
