"""Compiling the start-up's Triton kernels ahead, on threads (kernels/compile_ahead.py,
worker/warmup.py). On the CPU: what decides whether and how wide it runs, and that one thread records
at a time while other threads' compiles go through. On the GPU (gpu marker): a recorded launch is
neither compiled nor run while another thread's launch of it runs, the list compiles, and an engine
started in a fresh process with an empty Triton cache compiles nothing at launch after it, leaves no
hook behind, and answers as one that compiled each kernel at its first launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import triton
import triton.language as tl

from lorafleet.kernels import compile_ahead
from lorafleet.worker import EngineConfig


@triton.jit
def add_k(x_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
    """x[:n] += K (the GPU tests' kernel: each test launches its own specializations of it)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + K, mask=offs < n)


def test_the_interpreter_compiles_nothing_ahead(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not compile_ahead.supported()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert compile_ahead.supported()  # the Triton installed here has the hooks and ignore_errors


@pytest.mark.parametrize(
    "files, cpus",
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "50000 100000"}, 1),
        ({"cpu.max": "garbled"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_a_cgroup_quota_bounds_the_threads(tmp_path, files, cpus):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert compile_ahead._cgroup_cpus(str(tmp_path)) == cpus
    cores = len(os.sched_getaffinity(0))
    no_meminfo = str(tmp_path / "no-meminfo")
    assert compile_ahead.default_threads(str(tmp_path), no_meminfo) == min(16, cores, cpus or cores)


GIB = 1 << 30


@pytest.mark.parametrize(
    "files, meminfo_gib, most",
    [
        ({"memory.max": f"{4 * GIB}\n", "memory.current": f"{GIB}\n"}, 64, 3),  # a pod limited to 4 GiB, 1 used
        ({"memory.max": "max\n", "memory.current": f"{GIB}\n"}, 5, 5),  # no limit: what the machine has free
        ({"memory/memory.limit_in_bytes": f"{2 * GIB}\n", "memory/memory.usage_in_bytes": "0\n"}, 64, 2),  # v1
        ({"memory/memory.limit_in_bytes": f"{1 << 62}\n", "memory/memory.usage_in_bytes": "0\n"}, 64, 16),
        ({"memory.max": f"{GIB // 2}\n", "memory.current": "0\n"}, 64, 1),  # always one thread
        ({}, None, 16),  # nothing readable: cores alone
    ],
)
def test_free_memory_bounds_the_threads(tmp_path, files, meminfo_gib, most):
    """Up to 16 LLVM and ptxas compiles at once: a pod with a small memory limit must not be killed for it."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    meminfo = tmp_path / "meminfo"
    if meminfo_gib is not None:
        meminfo.write_text(f"MemTotal: {128 << 20} kB\nMemAvailable: {meminfo_gib << 20} kB\n")
    cores = len(os.sched_getaffinity(0))
    assert compile_ahead.default_threads(str(tmp_path), str(meminfo)) == min(most, cores)


def test_one_thread_records_at_a_time_and_the_hook_comes_back():
    from triton import knobs

    assert knobs.runtime.jit_cache_hook is None
    first_in, second_in, order = threading.Event(), threading.Event(), []

    def second():
        first_in.wait()
        with compile_ahead.launches_recorded():
            order.append("second")
            second_in.set()

    t = threading.Thread(target=second)
    t.start()
    with compile_ahead.launches_recorded():
        first_in.set()
        assert not second_in.wait(0.2)  # it waits for this window to close
        hook = knobs.runtime.jit_cache_hook
        passed = []  # another thread's compile goes through: not skipped, not listed
        other = threading.Thread(target=lambda: passed.append(hook(key="k", fn=None, compile={})))
        other.start()
        other.join()
        assert passed == [None]
        order.append("first")
    t.join()
    assert order == ["first", "second"] and knobs.runtime.jit_cache_hook is None
    with pytest.raises(RuntimeError), compile_ahead.launches_recorded():
        raise RuntimeError("a failed forward")
    assert knobs.runtime.jit_cache_hook is None


def test_compile_threads_must_not_be_negative(tiny_llama_dir):
    with pytest.raises(ValueError, match="compile_threads must be >= 0"):
        EngineConfig(model=str(tiny_llama_dir), compile_threads=-1)


@pytest.mark.gpu
def test_a_recorded_launch_is_neither_compiled_nor_run_and_compiles_ahead():
    assert compile_ahead.supported()
    x = torch.zeros(1000, device="cuda")
    with compile_ahead.launches_recorded() as found:
        for _ in range(2):  # the same specialization twice: listed once
            for k, block in ((1, 128), (2, 256)):
                add_k[(triton.cdiv(1000, block),)](x, 1000, K=k, BLOCK=block)
    torch.cuda.synchronize()
    assert x.abs().sum().item() == 0  # nothing ran
    assert len(found) == 2 and {s.name for s in found} == {"add_k"}
    for caches in add_k.device_caches.values():  # what stood in for the recorded ones while recording is gone
        assert not any(isinstance(k, compile_ahead._Skip) for k in caches[0].values())
    assert compile_ahead.compile_all(found[:1], threads=2) == 1  # the second is left to its launch
    launch_compiles = []
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: launch_compiles.append(kw["key"])
    try:
        for k, block in ((1, 128), (2, 256)):
            add_k[(triton.cdiv(1000, block),)](x, 1000, K=k, BLOCK=block)
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert len(launch_compiles) == 1 and launch_compiles[0] == found[1].key  # only the one not compiled ahead
    assert torch.equal(x, torch.full_like(x, 3.0))


@pytest.mark.gpu
def test_another_threads_launch_runs_while_this_one_records():
    """The recording thread's launch is skipped; another thread's launch of the same specialization,
    listed already, compiles and runs, and from then on it is a compiled kernel for every thread."""
    mine, theirs = torch.zeros(1000, device="cuda"), torch.zeros(1000, device="cuda")
    with compile_ahead.launches_recorded() as found:
        add_k[(8,)](mine, 1000, K=5, BLOCK=128)
        torch.cuda.synchronize()
        assert mine.abs().sum().item() == 0  # listed, not run
        other = threading.Thread(target=lambda: add_k[(8,)](theirs, 1000, K=5, BLOCK=128))
        other.start()
        other.join()
        torch.cuda.synchronize()
        assert torch.equal(theirs, torch.full_like(theirs, 5.0))
        add_k[(8,)](mine, 1000, K=5, BLOCK=128)  # compiled now: it runs as any compiled kernel does
    torch.cuda.synchronize()
    assert len(found) == 1 and torch.equal(mine, torch.full_like(mine, 5.0))
    for caches in add_k.device_caches.values():
        assert not any(isinstance(k, compile_ahead._Skip) for k in caches[0].values())
    add_k[(8,)](mine, 1000, K=5, BLOCK=128)
    assert torch.equal(mine, torch.full_like(mine, 10.0))


_START = """
import json, logging, sys
from triton import knobs
from lorafleet.worker import Engine, EngineConfig, SamplingParams
launched, ahead = [], []
logging.basicConfig(level=logging.WARNING)
logging.getLogger("lorafleet.worker.warmup").setLevel(logging.INFO)
logging.getLogger("lorafleet.worker.warmup").addFilter(lambda r: ahead.append(r.getMessage()) or True)
knobs.runtime.jit_post_compile_hook = lambda **kw: launched.append(kw["fn"].name) if not kw["is_manual_warmup"] else None
model, adapters, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = Engine(EngineConfig(model=model, device="cuda", dtype="float32", adapters=adapters, max_lora_rank=16,
                             max_num_seqs=4, max_num_batched_tokens=256, pool_bytes=64 << 20, compile_threads=threads))
at_start = len(launched)
outs = engine.generate([[5, 6, 7], [9, 10, 11, 12]], SamplingParams(max_tokens=6, temperature=0.0), adapters=["alpha", None])
print(json.dumps({"compiled_at_launch": at_start, "tokens": [o.token_ids for o in outs],
                  "hook_left": knobs.runtime.jit_cache_hook is not None, "ahead": [m for m in ahead if "ahead" in m]}))
"""


@pytest.mark.gpu
def test_an_engine_compiles_ahead_then_launches_compiled_kernels(tiny_llama_dir, qv_adapters_dir, tmp_path):
    results = {}
    for case, threads in (("first", 4), ("again", 4), ("one", 1)):
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / f"cache{threads}")}  # empty at each first start
        run = subprocess.run([sys.executable, "-c", _START, str(tiny_llama_dir), str(qv_adapters_dir), str(threads)],
                             capture_output=True, text=True, env=env, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        results[case] = json.loads(run.stdout.strip().splitlines()[-1])
    assert results["first"]["compiled_at_launch"] == 0  # the warm-up and captures found every kernel compiled
    assert results["one"]["compiled_at_launch"] > 0  # one thread: each compiled at its first launch, as before
    assert results["first"]["tokens"] == results["again"]["tokens"] == results["one"]["tokens"]
    assert not any(r["hook_left"] for r in results.values())
    # The first start listed its kernels and kept the list; the next one compiled that list straight away.
    assert len(results["first"]["ahead"]) == 1 and "listed in" in results["first"]["ahead"][0]
    assert [p.name.startswith("lorafleet-start-") for p in (tmp_path / "cache4").glob("lorafleet-start-*.json")] == [True]
    assert len(results["again"]["ahead"]) == 1 and "as an earlier start listed them" in results["again"]["ahead"][0]
    assert results["again"]["compiled_at_launch"] == 0
