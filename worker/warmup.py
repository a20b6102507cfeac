"""The engine's start-up on a GPU: compile the Triton kernels that served steps would otherwise stall
on, then capture the decode steps' CUDA graphs (each logged with its time).

On an empty Triton cache most of that time is compiling, one kernel after another as the forwards
launch them. With `compile_threads` above 1 (and a Triton that allows it, kernels.compile_ahead), the
warm-up's forwards and the captures' forwards first run with every launch that would compile skipped
and listed, the list is compiled at once on that many threads, and the warm-up and captures then find
their kernels compiled.
"""

from __future__ import annotations

import logging
import time

from lorafleet.kernels import compile_ahead
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, config: EngineConfig) -> None:
    """Compile ahead, warm up and capture, as `config` asks."""
    most = config.max_num_batched_tokens
    counts = sorted({c for c in (1, 16, 64, 256, 512, 1024) if c < most} | {most})  # 512: 32-token segments
    ranks = sorted({min(r, config.max_lora_rank) for r in (16, 32, 64, 128)})
    threads = config.compile_threads or compile_ahead.default_threads()
    if threads > 1 and compile_ahead.supported() and (config.warmup or runner.graphs is not None):
        t0 = time.perf_counter()
        with compile_ahead.launches_recorded() as found:
            if config.warmup:
                runner.warmup(counts, ranks)
            if runner.graphs is not None:
                runner.graphs.rehearse_all()
        t1 = time.perf_counter()
        compiled = compile_ahead.compile_all(found, threads)
        log.info("compiled ahead: %d Triton kernels listed in %.1f s, %d of them compiled on %d threads in %.1f s",
                 len(found), t1 - t0, compiled, threads, time.perf_counter() - t1)
    if config.warmup:
        t0 = time.perf_counter()
        runs = runner.warmup(counts, ranks)
        log.info("warm-up: %d forwards (tokens %s, rank bounds %s) in %.1f s", runs, counts, ranks, time.perf_counter() - t0)
    if runner.graphs is not None:
        t0 = time.perf_counter()
        runner.graphs.capture_all()
        log.info("captured %d CUDA graphs of decode steps (batch sizes %s) in %.1f s", runner.graphs.captures,
                 runner.graphs.buckets, time.perf_counter() - t0)
