"""The start's kernel list (kernels/compile_ahead.py save_list / load_list, worker/warmup.py): kept
beside Triton's cache so that a later start of the same engine compiles it without the listing
forwards. On the CPU, with this package's kernels as compiled Triton kernels and a runner that
launches through Triton's hook as a GPU forward would: what is kept, what a later start takes from
it, what it refuses, and how the list is named. The GPU test of two real starts is in
test_compile_ahead.py."""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from triton import knobs
from triton.runtime.jit import JITFunction

import lorafleet.kernels as kernels_package
from lorafleet.kernels import activation, compile_ahead
from lorafleet.worker import EngineConfig, warmup
from lorafleet.worker.model_config import ModelConfig
from lorafleet.worker.warmup import start_list_path

MODEL = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture
def kernel(monkeypatch):
    """One of this package's kernels as a compiled Triton kernel (the suite's interpreter wraps them),
    with an in-memory cache the runner below fills as Triton's launches would."""
    jit = JITFunction(activation.silu_mul_kernel.fn)
    jit.device_caches = collections.defaultdict(lambda: ({}, None, None, None, None))
    monkeypatch.setattr(activation, "silu_mul_kernel", jit)
    return jit


def other_kernel(x_ptr):
    """Not this package's kernel."""


def spec(kernel, key: str) -> compile_ahead.Specialization:
    return compile_ahead.Specialization(kernel, key, json.dumps({"name": kernel.fn.__name__, "key": key}))


def test_a_saved_list_comes_back_less_what_no_longer_fits(tmp_path, kernel, caplog):
    path = tmp_path / "cache" / "start.json"
    assert compile_ahead.load_list(path) is None  # none yet
    foreign = compile_ahead.Specialization(JITFunction(other_kernel), "f", "{}")  # not this package's: not kept
    found = [spec(kernel, "key0"), spec(kernel, "key1")]
    compile_ahead.save_list([*found, foreign, *found], path)  # one entry per kernel and key
    assert compile_ahead.load_list(path) == found
    assert [p.name for p in path.parent.iterdir()] == ["start.json"]  # nothing left beside it
    saved = json.loads(path.read_text())
    assert [e["key"] for e in saved["specializations"]] == ["key0", "key1"]
    first = saved["specializations"][0]
    wrong = {"a kernel changed since": {**first, "source": "0" * 64},
             "a kernel gone": {**first, "kernel": "lorafleet.kernels.activation:gone"},
             "outside this package": {**first, "kernel": "os:system"},
             "not a kernel": {**first, "kernel": "lorafleet.kernels.activation:silu_mul"},
             "a specialization of another key": {**first, "data": json.dumps({"name": "silu_mul_kernel", "key": "key9"})},
             "a specialization of another kernel": {**first, "data": json.dumps({"name": "other", "key": "key0"})},
             "garbled": ["lorafleet.kernels.activation:silu_mul_kernel"]}
    for why, entry in wrong.items():  # that entry left out, the other kept
        caplog.clear()
        path.write_text(json.dumps({**saved, "specializations": [entry, saved["specializations"][1]]}))
        assert compile_ahead.load_list(path) == found[1:], why
        assert "1 of 2 entries of the kernel list" in caplog.text, why
    path.write_text(json.dumps({**saved, "specializations": [wrong["a kernel gone"]]}))
    assert compile_ahead.load_list(path) is None  # nothing left: listed again
    for why, text in {"not json": "{", "another format": json.dumps({**saved, "format": 0}),
                      "too large": " " * (8 << 20) + json.dumps(saved)}.items():
        path.write_text(text)
        assert compile_ahead.load_list(path) is None, why
    path.unlink()
    os.mkfifo(path)  # not a regular file: never opened (a read would wait for ever)
    assert compile_ahead.load_list(path) is None


def test_a_list_is_written_whole_or_not_at_all_and_old_ones_go(tmp_path, kernel, monkeypatch):
    path = tmp_path / "start.json"
    unused, used = tmp_path / "lorafleet-start-old.json", tmp_path / "lorafleet-start-used.json"
    for old in (unused, used):
        compile_ahead.save_list([spec(kernel, "k")], old)
        os.utime(old, (0, time.time() - 31 * 86400))
    assert compile_ahead.load_list(used) is not None  # a start took it: kept
    compile_ahead.save_list([spec(kernel, "k")], path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lorafleet-start-used.json", "start.json"]

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compile_ahead.os, "replace", refused)
    with pytest.raises(OSError, match="No space"):
        compile_ahead.save_list([spec(kernel, "k2")], path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lorafleet-start-used.json", "start.json"]
    assert [s.key for s in compile_ahead.load_list(path)] == ["k"]


class Runner:
    """Launches `keys` of `kernel` at each warm-up as Triton would: a key not in the kernel's in-memory
    cache goes to the cache hook, and unless the hook skips it, compiles (lands in the cache)."""

    graphs = device = None

    def __init__(self, kernel, keys):
        self.kernel, self.keys, self.warmups, self.compiled_at_launch = kernel, keys, 0, []

    def warmup(self, counts, ranks):
        self.warmups += 1
        cache = self.kernel.device_caches[0][0]
        for key in self.keys:
            if key in cache:
                continue
            hook = knobs.runtime.jit_cache_hook
            launched = type("Launched", (), {"jit_function": self.kernel})
            if hook is None or not hook(key=key, fn=launched, compile={"specialization_data": spec(self.kernel, key).data, "device": 0}):
                cache[key] = "compiled"
                self.compiled_at_launch.append(key)
        return 1


def test_a_later_start_compiles_the_kept_list_and_adds_what_it_missed(tmp_path, kernel, monkeypatch, caplog):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_ahead, "supported", lambda: True)
    monkeypatch.setattr(warmup, "gpu_facts", lambda device: "GPU sm_90 132 SMs")
    ahead = []

    def compile_all(found, threads):
        ahead.append([s.key for s in found])
        kernel.device_caches[0][0].update(dict.fromkeys((s.key for s in found), "compiled"))
        return len(found)

    monkeypatch.setattr(compile_ahead, "compile_all", compile_all)
    config = EngineConfig(compile_threads=4)
    caplog.set_level(logging.INFO, logger="lorafleet.worker.warmup")

    def start(keys):
        kernel.device_caches[0][0].clear()  # a new process
        runner = Runner(kernel, keys)
        warmup.warm_up(runner, config, MODEL, 2048)
        return runner

    first = start(["a", "b"])
    assert first.warmups == 2 and ahead == [["a", "b"]] and first.compiled_at_launch == []  # listed, then warm-up
    path = start_list_path(config, MODEL, 2048, "GPU sm_90 132 SMs")
    written = path.read_text()
    again = start(["a", "b"])
    assert again.warmups == 1 and ahead[-1] == ["a", "b"] and again.compiled_at_launch == []  # no listing forwards
    assert path.read_text() == written and "as an earlier start listed them" in caplog.text
    more = start(["a", "b", "c"])  # a launch the list does not have: compiled at its launch, and added
    assert more.warmups == 1 and ahead[-1] == ["a", "b"] and more.compiled_at_launch == ["c"]
    assert [s.key for s in compile_ahead.load_list(path)] == ["a", "b", "c"]
    caplog.clear()

    def no_room(found, path):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(compile_ahead, "save_list", no_room)
    path.unlink()
    assert start(["a"]).warmups == 2  # listed again, and the start goes on without keeping the list
    assert "the kernel list for the next start is not kept" in caplog.text


def test_the_list_is_named_by_what_decides_the_kernels(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    config = EngineConfig(model=str(tiny_llama_dir))
    path = start_list_path(config, MODEL, 2048, "H200 sm_90 132 SMs")
    assert path.parent == tmp_path and path.name.startswith("lorafleet-start-")
    same = {start_list_path(EngineConfig(model=str(tiny_llama_dir), **change), MODEL, 2048, "H200 sm_90 132 SMs")
            for change in ({}, {"seed": 7}, {"compile_threads": 2}, {"max_failed_forwards": 3})}
    assert same == {path}  # settings that change no kernel
    others = {start_list_path(EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=4096), MODEL, 2048, "H200 sm_90 132 SMs"),
              start_list_path(config, ModelConfig(**{**dataclasses.asdict(MODEL), "head_dim": 32}), 2048, "H200 sm_90 132 SMs"),
              start_list_path(config, MODEL, 4096, "H200 sm_90 132 SMs"),
              start_list_path(config, MODEL, 2048, "H200 sm_90 66 SMs")}
    assert len(others) == 4 and path not in others


_OWN = """
import json, sys
from lorafleet.kernels import compile_ahead
before = sorted(m for m in sys.modules if m.startswith("lorafleet.kernels."))
print(json.dumps({"before": before, "own": sorted(compile_ahead.own_kernels())}))
"""


def test_every_kernel_of_the_package_is_its_own_also_one_imported_at_its_first_launch():
    """A later start reads the list before the engine's first forward, which is when the attention
    kernels' module is first imported: those entries were left out as "not a kernel of this code", and
    compiled at their launch at every start. Every @triton.jit function of every kernel module counts."""
    expected = set()
    for path in sorted(Path(next(iter(kernels_package.__path__))).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
                expected.add(f"lorafleet.kernels.{path.stem}:{node.name}")
    assert "lorafleet.kernels.attention_triton:_write_kv_kernel" in expected
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, as on a GPU
    run = subprocess.run([sys.executable, "-c", _OWN], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert "lorafleet.kernels.attention_triton" not in result["before"]  # the engine imports it late
    assert set(result["own"]) == expected
