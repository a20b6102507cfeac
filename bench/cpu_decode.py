"""What an adapter costs a CPU decode step: the embedded model (what `make run` serves) alone and with each demo
adapter, one request at a time, greedy, the time of each decode step after its prefill (the smallest of --rounds
runs: the least disturbed by other work on the machine).

    python bench/cpu_decode.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_io import write_json  # noqa: E402

from lorafleet.worker import Engine, EngineConfig, SamplingParams  # noqa: E402
from lorafleet.worker.default_model import default_model_dir  # noqa: E402

ADAPTERS = Path(__file__).resolve().parents[1] / "examples" / "adapters"
PROMPT = "Words: red fish open sky\nReply:"


def decode_step_s(engine: Engine, adapter: str | None, tokens: int) -> float:
    """Seconds per decode step of one greedy request for `tokens` tokens (its prefill step not counted)."""
    engine.add_request(f"r{time.monotonic_ns()}", PROMPT,
                       SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), adapter=adapter)
    engine.step()  # the prefill
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    ap.add_argument("--out", default=None, help="folder for the JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=str(default_model_dir()), device="cpu", dtype="float32"))
    names = [None, *(key.split("@")[0] for key in engine.register_adapter_dir(ADAPTERS))]
    for name in names:  # every adapter's first load (steps waiting for it would count as steps) and warm-up
        if name is not None:
            engine.adapter_pool.load(engine.adapter_pool.resolve(name))
        decode_step_s(engine, name, 2)
    best = {name: float("inf") for name in names}
    for _ in range(args.rounds):  # interleaved: a slow moment of the machine falls on every model alike
        for name in names:
            best[name] = min(best[name], decode_step_s(engine, name, args.tokens))
    base = best[None]
    rows = [{"model": name or "base", "decode_step_ms": round(1e3 * s, 2), "vs_base": round(s / base, 3)}
            for name, s in best.items()]
    print(f"{'model':>10} {'ms/step':>9} {'x base':>7}")
    for row in rows:
        print(f"{row['model']:>10} {row['decode_step_ms']:>9.1f} {row['vs_base']:>7.2f}")
    if args.out:
        res = {"args": vars(args), "torch": torch.__version__, "model": engine.model_name, "rows": rows,
               "command": " ".join(["python", "bench/cpu_decode.py", *sys.argv[1:]])}
        write_json(args.out, "cpu_decode", dt.date.today().isoformat(), "cpu", res)


if __name__ == "__main__":
    main()
