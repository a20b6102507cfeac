"""The engine's start-up on a GPU: compile the Triton kernels that served steps would otherwise stall
on, then capture the decode steps' CUDA graphs (each logged with its time).

On an empty Triton cache most of that time is compiling, one kernel after another as the forwards
launch them. With `compile_threads` above 1 (and a Triton that allows it, kernels.compile_ahead), the
warm-up's forwards and the captures' forwards first run with every launch that would compile skipped
and listed, the list is compiled at once on that many threads, and the warm-up and captures then find
their kernels compiled. The list is kept beside Triton's disk cache, named by what decides it (this
code, the engine's and the model's configuration and context length, the GPU, torch, Triton and its
settings): a later start of the same engine compiles it straight away, without the listing forwards.
A launch the list missed compiles as usual, and is added to it. Either way one recording window is
open for the whole start (one engine of a process starts at a time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging
import time
from pathlib import Path

from lorafleet.kernels import compile_ahead
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.model_config import ModelConfig
from lorafleet.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
    """Compile ahead, warm up and capture, as `config` asks."""
    most = config.max_num_batched_tokens
    counts = sorted({c for c in (1, 16, 64, 256, 512, 1024) if c < most} | {most})  # 512: 32-token segments
    ranks = sorted({min(r, config.max_lora_rank) for r in (16, 32, 64, 128)})
    threads = config.compile_threads or compile_ahead.default_threads()
    ahead = threads > 1 and compile_ahead.supported() and (config.warmup or runner.graphs is not None)
    if ahead:
        list_path = start_list_path(config, model_config, max_model_len, gpu_facts(runner.device))
        listed = compile_ahead.load_list(list_path) if list_path is not None else None
        t0 = time.perf_counter()
        if listed is None:
            with compile_ahead.launches_recorded() as found:
                _forwards(runner, config, counts, ranks, capture=False)
        else:
            found = listed
        t1 = time.perf_counter()
        compiled = compile_ahead.compile_all(found, threads)
        how = f"listed in {t1 - t0:.1f} s" if listed is None else f"as an earlier start listed them ({list_path.name})"
        log.info("compiled ahead: %d Triton kernels %s, %d of them compiled on %d threads in %.1f s",
                 len(found), how, compiled, threads, time.perf_counter() - t1)
    with compile_ahead.launches_recorded(skip=False) if ahead else contextlib.nullcontext([]) as missed:
        _forwards(runner, config, counts, ranks, capture=True)
    if ahead and list_path is not None and (listed is None or missed):
        if missed:
            log.info("%d Triton kernels compiled at their launch, not ahead: added to the list for the next start", len(missed))
        try:
            compile_ahead.save_list([*found, *missed], list_path)
        except OSError as e:
            log.warning("the kernel list for the next start is not kept (%s): it lists them again", e)


def _forwards(runner: ModelRunner, config: EngineConfig, counts: list[int], ranks: list[int], *, capture: bool) -> None:
    """The warm-up's forwards and the captures (with `capture`, logged), or their rehearsal."""
    if config.warmup:
        t0 = time.perf_counter()
        runs = runner.warmup(counts, ranks)
        if capture:
            log.info("warm-up: %d forwards (tokens %s, rank bounds %s) in %.1f s", runs, counts, ranks, time.perf_counter() - t0)
    if runner.graphs is None:
        return
    if not capture:
        runner.graphs.rehearse_all()
        return
    t0 = time.perf_counter()
    runner.graphs.capture_all()
    log.info("captured %d CUDA graphs of decode steps (batch sizes %s) in %.1f s", runner.graphs.captures,
             runner.graphs.buckets, time.perf_counter() - t0)


# Settings that change no kernel a start launches: a list is shared whatever they are.
_NOT_KERNELS = ("tokenizer", "seed", "generation_config", "adapters", "strict_base", "base_model_aliases", "max_adapter_file_bytes",
                "max_adapter_wait_steps", "compile_threads", "max_failed_forwards")


def gpu_facts(device) -> str:
    """The device's name, compute capability and SM count (a MIG slice has fewer SMs: other splits)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return f"{props.name} sm_{props.major}{props.minor} {props.multi_processor_count} SMs"


def start_list_path(config: EngineConfig, model_config: ModelConfig, max_model_len: int, gpu: str) -> Path | None:
    """Where the start's kernel list is kept: in Triton's cache directory, named by a hash of what
    decides which kernels a start launches (`gpu`: gpu_facts). None where this Triton names no cache
    directory."""
    cache_dir = getattr(getattr(compile_ahead.knobs, "cache", None), "dir", None)
    if not cache_dir:
        return None
    import torch
    import triton

    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        triton_env = get_cache_invalidating_env_vars()  # TRITON_DEBUG and the like: in every kernel's key
    except ImportError:
        triton_env = {}
    code = hashlib.sha256()
    for package in ("lorafleet.kernels", "lorafleet.worker"):
        folder = next(iter(importlib.import_module(package).__path__))  # kernels/ is a namespace portion
        for path in sorted(Path(folder).glob("*.py")):
            code.update(path.name.encode() + b"\0" + path.read_bytes())
    engine = {k: v for k, v in dataclasses.asdict(config).items() if k not in _NOT_KERNELS}
    facts = {"code": code.hexdigest(), "torch": torch.__version__, "triton": triton.__version__, "triton_env": triton_env,
             "gpu": gpu, "config": engine, "model": dataclasses.asdict(model_config), "max_model_len": max_model_len}
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"{compile_ahead.LIST_PREFIX}{digest}.json"
