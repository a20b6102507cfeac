"""What a layer's LoRA delta adds to the layer: base GEMMs alone, with the delta after each GEMM, and
with the delta overlapped with the GEMMs on a side stream (worker/lora_linear.py, the engine's path).

    python bench/lora_overlap.py --out bench/results     # writes lora_overlap_<date>_<gpu>.json and .png

One Llama-3-8B decoder layer's four fused projections (q|k|v, o, gate|up, down) at T tokens spread
round-robin over A adapters, bf16, CUDA-graph replay with the L2 flushed before each layer (the
Timer of bench/lora_kernels.py). Added time = layer with LoRA - base GEMMs alone; floor = the distinct
adapters' bytes / copy bandwidth measured in the same run. Up to 64 tokens it also times variants of
the side stream: high priority, and the GEMMs told to leave SMs free (torch's experimental SM
carveout, which only cuBLASLt honours) — the H200 run of 2026-11-30 found priority and the carveout
on plain cuBLAS without effect (graph replay), and cuBLASLt with 16 SMs carved out adding 8-34% less
time at T=16-64 but twice as much at T=1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from bench_io import device_tag  # same folder

from lorafleet.kernels.lora_layout import make_lora_batch
from lorafleet.worker.lora_linear import lora_linear

_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("lora_kernels.py"))
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)

CASES = [(1, 8, "16"), (16, 8, "16"), (64, 32, "16"), (256, 32, "16"), (1024, 8, "16"), (64, 32, "mixed"), (64, 32, "30")]


class Layer:
    def __init__(self, num_tokens: int, num_adapters: int, rank_name: str, gen: torch.Generator) -> None:
        ranks = [kb.RANKS[rank_name][s % len(kb.RANKS[rank_name])] for s in range(num_adapters)]
        self.layout, _ = kb.build_layout(ranks, gen)
        self.distinct_bytes = kb.adapter_bytes(ranks[: min(num_tokens, num_adapters)])
        slots = (torch.arange(num_tokens, device="cuda") % num_adapters).to(torch.int32)
        self.batch = make_lora_batch(slots, self.layout.max_rank_by_slot())
        self.weights = [(torch.randn(sum(w), kb.DIMS[p[0]][0], device="cuda", generator=gen) * 0.02).to(kb.DT) for p, w in kb.GROUPS]
        self.xs = [torch.randn(num_tokens, w.shape[1], device="cuda", generator=gen).to(kb.DT) for w in self.weights]
        self.offsets = [[sum(w[:i]) for i in range(len(w))] for _, w in kb.GROUPS]
        self.side = torch.cuda.Stream()
        self.side_high = torch.cuda.Stream(priority=-10)  # clamped to the highest priority

    def ctx(self, overlap: bool, high: bool = False) -> SimpleNamespace:
        side = (self.side_high if high else self.side) if overlap else None
        return SimpleNamespace(lora=self.batch, lora_layout=self.layout, backend="triton", lora_stream=side)

    def base(self) -> None:
        for x, w in zip(self.xs, self.weights, strict=True):
            F.linear(x, w)

    def base_carved(self, carveout: int) -> None:
        with gemm_settings(carveout):
            self.base()

    def with_lora(self, overlap: bool, high: bool = False, carveout: int = 0, lt: bool = False) -> list[torch.Tensor]:
        """carveout: SMs the base GEMMs leave free for the side stream; lt: the GEMMs through cuBLASLt."""
        ctx = self.ctx(overlap, high)
        with gemm_settings(carveout, lt):
            return [lora_linear(x, w, ctx, 0, p, offs) for (p, _), x, w, offs in zip(kb.GROUPS, self.xs, self.weights, self.offsets, strict=True)]


@contextlib.contextmanager
def gemm_settings(carveout: int = 0, lt: bool = False):
    """torch's process-wide matmul settings for a block: SMs carved out of the GEMMs (cuBLASLt's SM count
    target; plain cuBLAS ignores it) and cuBLASLt as the BLAS library; both restored afterwards."""
    old, old_lib = torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()
    torch._C._set_sm_carveout_experimental(carveout or None)
    if lt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(old)
        torch._C._set_blas_preferred_backend(old_lib)

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/lora_overlap.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    timer = kb.Timer()
    copy_gbs = kb.copy_bandwidth()
    rows = []
    print(f"copy {copy_gbs:.0f} GB/s")
    print(f"{'T':>5} {'A':>3} {'rank':>5} {'base us':>8} {'serial +us':>10} {'overlap +us':>11} {'floor us':>8} {'overlap/floor':>13} {'overlap/base':>12}")
    for num_tokens, num_adapters, rank_name in CASES:
        layer = Layer(num_tokens, num_adapters, rank_name, gen)
        serial_out, overlap_out = layer.with_lora(False), layer.with_lora(True)
        err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(overlap_out, serial_out, strict=True))
        base = timer.graph(layer.base)
        serial = timer.graph(lambda la=layer: la.with_lora(False))
        overlap = timer.graph(lambda la=layer: la.with_lora(True))
        floor = layer.distinct_bytes / (copy_gbs * 1e3)
        row = {"tokens": num_tokens, "adapters": num_adapters, "rank": rank_name, "base_us": base, "serial_added_us": serial - base,
               "overlap_added_us": overlap - base, "floor_us": floor, "overlap_rel_diff_vs_serial": err}
        if num_tokens <= 64:  # the side stream's variants: high priority, and SMs kept from the GEMMs
            row["variants_added_us"] = {
                "high_priority": timer.graph(lambda la=layer: la.with_lora(True, high=True)) - base,
                **{f"carveout_{c}": timer.graph(lambda la=layer, c=c: la.with_lora(True, carveout=c)) - base for c in (8, 16, 32)},
                **{f"high_priority_carveout_{c}": timer.graph(lambda la=layer, c=c: la.with_lora(True, high=True, carveout=c)) - base for c in (16,)},
                **{f"cublaslt_carveout_{c}": timer.graph(lambda la=layer, c=c: la.with_lora(True, carveout=c, lt=True)) - base for c in (0, 16, 32)},
            }
            row["base_carveout_16_us"] = timer.graph(lambda la=layer: la.base_carved(16))
            print("   variants (added us):", {k: round(v, 1) for k, v in row["variants_added_us"].items()},
                  f"base with 16 SMs carved out {row['base_carveout_16_us']:.1f} us", flush=True)
        rows.append(row)
        print(f"{num_tokens:>5} {num_adapters:>3} {rank_name:>5} {base:>8.1f} {serial - base:>10.1f} {overlap - base:>11.1f} {floor:>8.1f} "
              f"{(overlap - base) / floor:>13.2f} {(overlap - base) / base:>12.3f}", flush=True)
        del layer
        torch.cuda.empty_cache()
    name = f"lora_overlap_{datetime.date.today():%Y%m%d}_{device_tag(torch.cuda.get_device_name())}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"date": f"{datetime.date.today()}", "command": kb.recorded_command(),
                                                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                 "copy_gbs": copy_gbs, "rows": rows}, indent=1))
    plot(rows, out / f"{name}.png")
    print(f"wrote {out / name}.json and .png")
    return 0


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"T={r['tokens']}\nA={r['adapters']} r={r['rank']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([x - 0.27 for x in xs], [r["serial_added_us"] for r in rows], 0.27, label="delta after each GEMM")
    ax.bar(list(xs), [r["overlap_added_us"] for r in rows], 0.27, label="delta beside the GEMMs (side stream)")
    ax.bar([x + 0.27 for x in xs], [r["floor_us"] for r in rows], 0.27, label="floor: adapter bytes / copy BW")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="µs added to one Llama-3-8B layer", title="LoRA delta's cost to the layer (H200, bf16, cold L2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
