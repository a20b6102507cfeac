"""Top-k and top-p over a batch of full-vocabulary rows: the sampler's filters against sorting every whole row.

    python bench/sampler_filters.py --out bench/results

64 rows of Llama-3's vocabulary (128,256 logits), on the GPU when there is one, else the CPU (one torch thread).
`peaked` rows are normal logits with standard deviation 6 (the most probable thousand tokens hold nearly all the
mass, as a language model's next-token rows mostly do); `flat` ones have deviation 1 (top-p 0.9 needs most of the
vocabulary: the sampler sorts those rows whole); `mixed`, peaked rows and one flat one. Cases: top-k 50; top-p 0.9; both. Each is timed against the
whole-row sort that defines them (the sampler before it took its thresholds from a top-k), median of `--repeat`
runs, and checked to keep the same tokens. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_io import device_tag, write_json  # noqa: E402

from lorafleet.worker.sampler import _processed_probs  # noqa: E402
from lorafleet.worker.sampling_params import SamplingParams  # noqa: E402

CASES = {"top_k": dict(top_k=50), "top_p": dict(top_p=0.9), "top_k_top_p": dict(top_k=50, top_p=0.9)}
SPREADS = {"peaked": (6.0, 6.0), "flat": (1.0, 1.0), "mixed": (6.0, 1.0)}  # the rows' deviation, the last row's


def sorted_rows(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k, then top-p, each from a sort of whole rows."""
    if top_k:
        logits = logits.masked_fill(logits < logits.sort(dim=-1, descending=True).values[:, top_k - 1:top_k],
                                    float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(dim=-1) - ordered >= top_p
        drop[:, 0] = False
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def timed(fn, repeat: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for the JSON (bench/results)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for spread, (std, last) in SPREADS.items():
        logits = torch.randn(args.rows, args.vocab, generator=gen, device=device) * std
        logits[-1] *= last / std
        for case, kw in CASES.items():
            params = [SamplingParams(temperature=1.0, **kw)] * args.rows
            got, ref = _processed_probs(logits, params), sorted_rows(logits, **kw)
            same = bool(torch.equal(got > 0, ref > 0))
            new = timed(lambda: _processed_probs(logits, params), args.repeat, device)  # noqa: B023
            old = timed(lambda: sorted_rows(logits, **kw), args.repeat, device)  # noqa: B023
            rows.append({"spread": spread, "case": case, "kept_per_row": round((got > 0).sum().item() / args.rows, 1),
                         "same_tokens_kept": same, "sampler_ms": round(new * 1e3, 3), "sorted_ms": round(old * 1e3, 3),
                         "speedup": round(old / new, 2)})
            r = rows[-1]
            print(f"{spread:7} {case:12} kept {r['kept_per_row']:9.1f}/row  sampler {r['sampler_ms']:9.3f} ms  "
                  f"whole-row sorts {r['sorted_ms']:9.3f} ms  {r['speedup']:6.2f}x  same tokens: {same}", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if args.out:
        date = datetime.date.today().isoformat()
        write_json(args.out, "sampler_filters", date, device_tag(name) if device.type == "cuda" else "cpu",
                   {"date": date, "device": name if device.type == "cuda" else "cpu, 1 torch thread",
                    "rows": args.rows, "vocab": args.vocab, "repeat": args.repeat, "cases": rows})


if __name__ == "__main__":
    main()
