"""The engine's own CPU work per decode step (scheduling, batch building, outputs), the model forward taken out.

    python bench/engine_overhead.py --out bench/results

A tiny Llama (so the forward is small) on the CPU, one torch thread. Each case fills a batch of `batch` decoding
requests over `adapters` adapters, then times `--steps` steps: the median step, the median forward
(`model(...)` + `compute_logits`, timed around the call) and the overhead (their difference: the engine's
Python work, the sampler included), and of it the scheduler's `schedule()`. Cases: a plain batch; a full batch
with requests of 1,000 tenants waiting behind it (no seat frees: nothing is admitted, nothing needs looking at); long outputs with logprobs (what each
step reports grows with what was generated); requests for cold adapters arriving every step among 5,000
registered (loads and evictions); a burst of 128 requests of 128 tenants admitted in one step, their prompts
beginning with the same chat template (each waiting head is checked against the step's prefills for a block one of
them fills: prefix_cache.py). On a GPU the forward is far shorter and this overhead is what is left.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_io import write_json  # noqa: E402
from engine_throughput import random_adapter  # noqa: E402

from lorafleet.worker import Engine, EngineConfig, SamplingParams  # noqa: E402
from tests.worker.conftest import make_tiny_llama  # noqa: E402

# name -> (batch, adapters in the batch, registered idle adapters, waiting requests, their tenants, logprobs,
# decode steps before timing, cold requests per step, one-token requests of as many tenants arriving per step)
CASES = {
    "plain": (64, 16, 0, 0, 0, False, 8, 0, 0),
    "waiting_tenants": (64, 16, 0, 4000, 1000, False, 8, 0, 0),
    "long_logprobs": (64, 16, 0, 0, 0, True, 1500, 0, 0),
    "cold_churn": (64, 16, 5000, 0, 0, False, 8, 2, 0),
    "admit_burst": (0, 16, 0, 0, 0, False, 0, 0, 128),
}
TEMPLATE = list(range(3, 19))  # one block: how every burst prompt begins


class Timed:
    """The model, its forward and logits timed."""

    def __init__(self, model) -> None:
        self._model, self.seconds = model, 0.0

    def _timed(self, fn, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0

    def __call__(self, *a, **k):
        return self._timed(self._model, *a, **k)

    def compute_logits(self, *a, **k):
        return self._timed(self._model.compute_logits, *a, **k)

    def __getattr__(self, name):
        return getattr(self._model, name)


def run_case(model_dir: Path, name: str, steps: int) -> dict:
    batch, adapters, idle, waiting, tenants, logprobs, warm, churn, burst = CASES[name]
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 max_num_seqs=max(batch + 4 * churn, burst),
                                 max_num_batched_tokens=4096, max_loras=adapters + 8, max_lora_rank=8, num_pages=20000))
    for i in range(adapters):
        engine.adapter_pool.add(f"a{i}@bench", random_adapter(engine, f"a{i}", 8, i), tenant=f"t{i % max(tenants, 1)}")
        engine.adapter_pool.load(f"a{i}@bench")
    protos = [random_adapter(engine, "p", 8, 1000 + i) for i in range(8)]
    for i in range(idle):
        engine.adapter_pool.add(f"idle{i}@bench", tenant=f"t{i % max(tenants, 1)}",
                                loader=lambda i=i: dataclasses.replace(protos[i % 8], name=f"idle{i}"))
    timed = Timed(engine.runner.model)
    engine.runner.model = timed
    scheduling, schedule = Timed(None), engine.scheduler.schedule  # schedule() timed apart
    engine.scheduler.schedule = lambda: scheduling._timed(schedule)
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, 256)
    params = SamplingParams(max_tokens=warm + steps + 64, temperature=0.0, ignore_eos=True,
                            logprobs=5 if logprobs else None)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(16)], params, adapter=f"a{i % adapters}",
                           tenant=f"t{i % tenants}" if tenants else None)
    while engine.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(warm):
        engine.step()
    for i in range(waiting):
        engine.add_request(f"w{i}", [rng.randrange(3, vocab) for _ in range(16)], params, adapter=f"a{i % adapters}",
                           tenant=f"t{i % tenants}" if tenants else None)
    walls, forwards, schedules, cold = [], [], [], iter(range(10**9))
    for _ in range(steps):
        for _ in range(churn):
            j = next(cold)
            engine.add_request(f"c{j}", [rng.randrange(3, vocab) for _ in range(4)],
                               SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
                               adapter=f"idle{rng.randrange(idle)}")
        for _ in range(burst):
            j = next(cold)
            engine.add_request(f"b{j}", TEMPLATE + [rng.randrange(3, vocab) for _ in range(16)],
                               SamplingParams(max_tokens=1, temperature=0.0), adapter=f"a{j % adapters}",
                               tenant=f"t{j % burst}")
        timed.seconds = scheduling.seconds = 0.0
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        forwards.append(timed.seconds)
        schedules.append(scheduling.seconds)
    output_len = len(engine.requests["r0"].output_token_ids) if batch else 1
    engine.close()
    overhead = statistics.median(w - f for w, f in zip(walls, forwards, strict=True))
    return {"case": name, "batch": batch, "adapters": adapters, "registered_idle": idle, "waiting": waiting,
            "waiting_tenants": tenants, "logprobs": logprobs, "output_len": output_len,
            "cold_per_step": churn, "burst_per_step": burst, "step_ms": round(statistics.median(walls) * 1e3, 3),
            "forward_ms": round(statistics.median(forwards) * 1e3, 3),
            "schedule_ms": round(statistics.median(schedules) * 1e3, 3), "overhead_ms": round(overhead * 1e3, 3),
            "overhead_us_per_seq": round(overhead * 1e6 / max(batch, burst), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per case")
    ap.add_argument("--out", default=None, help="folder for the JSON (bench/results)")
    ap.add_argument("--tag", default="", help="added to the JSON file's name (e.g. before)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_llama(Path(tmp) / "tiny")
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))  # long outputs
        for name in args.cases.split(","):
            rows.append(run_case(model_dir, name, args.steps))
            r = rows[-1]
            print(f"{r['case']:16} batch {r['batch']:4d}  step {r['step_ms']:8.2f} ms  forward {r['forward_ms']:8.2f} ms  "
                  f"overhead {r['overhead_ms']:7.2f} ms ({r['overhead_us_per_seq']:.0f} us a sequence), of it scheduling "
                  f"{r['schedule_ms']:.2f} ms", flush=True)
    if args.out:
        date = datetime.date.today().isoformat()
        write_json(args.out, "engine_overhead" + (f"_{args.tag}" if args.tag else ""), date, "cpu",
                   {"date": date, "device": "cpu, 1 torch thread", "steps": args.steps, "cases": rows})


if __name__ == "__main__":
    main()
