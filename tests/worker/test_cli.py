"""worker/cli.py: flags and LORAFLEET_* variables generated from config dataclasses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import pytest

from lorafleet.worker.cli import build_parser, config_from_args, flag_terms
from lorafleet.worker.worker_config import WorkerConfig


@dataclass(slots=True)
class Inner:
    model: str = field(metadata={"help": "model directory"})
    max_num_seqs: int = field(default=8, metadata={"help": "sequences per step"})
    device: Literal["cpu", "cuda"] = field(default="cpu", metadata={"help": "device"})


@dataclass(slots=True)
class Outer:
    engine: Inner
    port: int = field(default=8000, metadata={"help": "TCP port"})
    ratio: float = field(default=0.5, metadata={"help": "a ratio"})
    verbose: bool = field(default=False, metadata={"help": "chatty logs"})
    keys_file: str | None = field(default=None, metadata={"help": "API keys"})
    tags: list[str] = field(default_factory=list, metadata={"help": "tags"})

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535 (got {self.port})")


def test_flags_build_nested_config_with_defaults():
    cfg = config_from_args(Outer, ["--model", "/m", "--port", "9001", "--verbose", "--tags", "a,b"], env={})
    assert cfg.engine == Inner(model="/m")
    assert (cfg.port, cfg.ratio, cfg.verbose, cfg.keys_file, cfg.tags) == (9001, 0.5, True, None, ["a", "b"])


def test_env_sets_fields_and_flags_win():
    env = {"LORAFLEET_MODEL": "/env", "LORAFLEET_PORT": "7000", "LORAFLEET_VERBOSE": "yes",
           "LORAFLEET_MAX_NUM_SEQS": "4", "LORAFLEET_DEVICE": "cuda"}
    cfg = config_from_args(Outer, ["--port", "7001"], env=env)
    assert cfg.engine == Inner(model="/env", max_num_seqs=4, device="cuda")
    assert cfg.port == 7001 and cfg.verbose is True
    assert config_from_args(Outer, ["--no-verbose"], env=env).verbose is False


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        ([], {}, "--model"),  # required field missing
        (["--model", "m", "--port", "x"], {}, "expected int"),
        (["--model", "m", "--device", "tpu"], {}, "invalid choice"),
        (["--model", "m"], {"LORAFLEET_PORT": "eighty"}, "LORAFLEET_PORT"),
        (["--model", "m"], {"LORAFLEET_VERBOSE": "maybe"}, "LORAFLEET_VERBOSE"),
        (["--model", "m", "--port", "70000"], {}, "port must be in"),  # __post_init__ validation
        (["--model", "m", "--ratio", "nan"], {}, "expected a finite number"),  # nan passes every range check
        (["--model", "m"], {"LORAFLEET_RATIO": "inf"}, "LORAFLEET_RATIO: expected a finite number"),
    ],
)
def test_bad_values_exit_with_usage_naming_the_problem(argv, env, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(Outer, argv, env=env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1 and err.rstrip().endswith("(see --help)"), err


def test_help_explains_every_field_and_its_env_var():
    text = build_parser(Outer, env={}).format_help()
    for flag, env_var, words in [("--model", "LORAFLEET_MODEL", "model directory"),
                                 ("--max-num-seqs", "LORAFLEET_MAX_NUM_SEQS", "sequences per step"),
                                 ("--keys-file", "LORAFLEET_KEYS_FILE", "API keys"),
                                 ("--verbose", "LORAFLEET_VERBOSE", "chatty logs")]:
        assert flag in text and env_var in text and words in text


def test_composing_config_may_reword_nested_fields():
    @dataclass(slots=True)
    class Worded:
        engine: Inner = field(metadata={"help": {"model": "a directory or an s3:// URI"}})

    text = build_parser(Worded, env={}).format_help()
    assert "a directory or an s3:// URI" in text and "model directory" not in text
    assert "sequences per step" in text


def test_field_comments_are_help_when_metadata_is_absent():
    @dataclass(slots=True)
    class Commented:
        block_size: int = 16  # tokens per KV block

    assert "tokens per KV block" in build_parser(Commented, env={}).format_help()


def test_clashing_nested_names_are_refused():
    @dataclass(slots=True)
    class Clash:
        engine: Inner
        model: str = "x"

    with pytest.raises(TypeError, match="clash"):
        build_parser(Clash, env={})


def test_worker_help_runs_as_a_module():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lorafleet.worker", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--adapters", "--host", "--port", "--device", "--admin-token", "--api-keys-file"):
        assert flag in out.stdout
    assert "LORAFLEET_PORT" in out.stdout
    for env_var in ("LORAFLEET_S3_ENDPOINT", "LORAFLEET_S3_ACCESS_KEY", "LORAFLEET_S3_SECRET_KEY"):
        assert env_var in out.stdout  # an s3:// --adapters reads them


HEAVY = ("torch", "triton", "transformers", "minio", "kubernetes")

# Runs `python -m MODULE ARGS...` as -m does, then prints which of HEAVY it imported, however it ended
# (--help and a bad flag end in SystemExit).
_IMPORTS_OF = """
import runpy, sys
heavy = set(sys.argv.pop().split(","))
module, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    print("HEAVY:" + ",".join(sorted({m.partition(".")[0] for m in sys.modules} & heavy)), file=sys.stderr)
"""


@pytest.mark.parametrize(("module", "args", "needle"), [
    ("lorafleet.worker", ["--help"], "--max-num-seqs"),
    ("lorafleet.worker", ["--port", "eighty"], "--port: expected int, got 'eighty'"),  # argparse refuses it
    ("lorafleet.worker", ["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),  # the config's validation does
    ("lorafleet.worker", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("lorafleet.worker.stager", ["--help"], "--stager-cache-dir"),
    ("lorafleet.worker.stager", ["--stager-port", "eighty"], "--stager-port: expected int, got 'eighty'"),
], ids=["worker-help", "worker-bad-value", "worker-invalid", "worker-unknown-flag", "stager-help", "stager-bad-value"])
def test_help_and_bad_flags_answer_without_importing_torch(module, args, needle):
    """`--help` took seconds: the package imported torch (and the engine) before the flags were parsed.
    Which modules were imported is checked, not how long it took."""
    import subprocess
    import sys

    env = {**os.environ, "LORAFLEET_STAGER_TOKEN": "t" * 20}  # the stager's required setting
    out = subprocess.run([sys.executable, "-c", _IMPORTS_OF, module, *args, ",".join(HEAVY)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "HEAVY:", out.stderr  # none of them
    if args == ["--help"]:
        assert out.returncode == 0 and needle in out.stdout, out.stdout
    else:
        assert out.returncode == 2 and f"python -m {module}: error:" in out.stderr and needle in out.stderr, out.stderr


def test_the_package_exports_its_api_on_first_use():
    """`from lorafleet.worker import Engine` still works: the package imports it when it is asked for."""
    import subprocess
    import sys

    code = ("import sys, lorafleet.worker as w; assert 'torch' not in sys.modules; "
            "from lorafleet.worker import Engine, EngineConfig, RequestOutput, SamplingParams; "
            "assert 'torch' in sys.modules and Engine.__module__ == 'lorafleet.worker.engine'; "
            "assert w.SamplingParams is SamplingParams and 'Engine' in dir(w)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_stager_file_limit_is_a_flag_and_an_env_var(capsys):
    from lorafleet.worker.stager_config import StagerConfig

    env = {"LORAFLEET_STAGER_TOKEN": "t" * 20}
    assert config_from_args(StagerConfig, [], env=env).max_adapter_file_bytes == 4 << 30
    assert config_from_args(StagerConfig, ["--max-adapter-file-bytes", "1024"], env=env).max_adapter_file_bytes == 1024
    env_limit = {**env, "LORAFLEET_MAX_ADAPTER_FILE_BYTES": "2048"}
    assert config_from_args(StagerConfig, [], env=env_limit).max_adapter_file_bytes == 2048
    assert "largest adapter file staged" in build_parser(StagerConfig, env=env).format_help()
    with pytest.raises(SystemExit):
        config_from_args(StagerConfig, ["--max-adapter-file-bytes", "0"], env=env)
    assert "--max-adapter-file-bytes must be > 0" in capsys.readouterr().err


def test_worker_admin_listener_is_a_flag_and_an_env_var():
    from lorafleet.worker.worker_config import WorkerConfig

    config = config_from_args(WorkerConfig, ["--admin-port", "8002"], env={})
    assert (config.admin_port, config.admin_listen_host) == (8002, "127.0.0.1")  # the loopback unless told
    config = config_from_args(WorkerConfig, [], env={"LORAFLEET_ADMIN_PORT": "0", "LORAFLEET_ADMIN_HOST": "::1"})
    assert (config.admin_port, config.admin_listen_host) == (0, "::1")
    config = config_from_args(WorkerConfig, [], env={})
    assert config.admin_port is None  # unset: the admin API stays on --port


@pytest.mark.parametrize(("argv", "needle"), [
    (["--port", "8000", "--admin-port", "8000"], "--admin-port 8000 is --port too: the admin API needs a port of its "
                                                 "own; choose another --admin-port, or leave it unset"),
    (["--stager-port", "8001", "--admin-port", "8001"], "--admin-port 8001 is --stager-port too"),
    (["--admin-host", "0.0.0.0"], "--admin-host 0.0.0.0 needs --admin-port"),
    (["--admin-port", "70000"], "--admin-port must be in 0..65535"),
], ids=["same-as-port", "same-as-stager-port", "host-without-port", "out-of-range"])
def test_worker_admin_listener_settings_it_cannot_use_are_refused(argv, needle, capsys):
    from lorafleet.worker.worker_config import WorkerConfig

    with pytest.raises(SystemExit) as exc:
        config_from_args(WorkerConfig, argv, env={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_tool_call_parser_is_a_flag_and_an_env_var(tmp_path, capsys):
    from lorafleet.worker.worker_config import WorkerConfig

    argv = ["--model", str(tmp_path)]
    assert config_from_args(WorkerConfig, argv, env={}).tool_call_parser == "auto"
    assert config_from_args(WorkerConfig, [*argv, "--tool-call-parser", "hermes"], env={}).tool_call_parser == "hermes"
    env = {"LORAFLEET_TOOL_CALL_PARSER": "llama3_json"}
    assert config_from_args(WorkerConfig, argv, env=env).tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        config_from_args(WorkerConfig, [*argv, "--tool-call-parser", "mistral"], env={})
    assert "invalid choice" in capsys.readouterr().err


def test_validation_errors_name_the_flags_the_user_set(capsys):
    """A config's check speaks of its fields; the user set flags, and is told of those."""
    for argv, env, said in [
        (["--max-body-bytes", "10"], {}, "--max-body-bytes must be >= 1024, got 10"),
        ([], {"LORAFLEET_MAX_NUM_SEQS": "0"}, "--max-num-seqs must be >= 1, got 0"),  # a nested config's field
    ]:
        with pytest.raises(SystemExit) as exc:
            config_from_args(WorkerConfig, ["--model", "m", *argv], env=env)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and said in err, err
        assert "max_" not in err, err


def test_flag_terms_name_the_fields_a_check_names_and_leave_values_alone():
    assert flag_terms("max_num_seqs (0) must be >= 1; port 80", Outer) == "--max-num-seqs (0) must be >= 1; port 80"
    assert flag_terms("max_num_seqs, keys_file and keys_files_x must be > 0", Outer) == (
        "--max-num-seqs, --keys-file and keys_files_x must be > 0")
    for quoted in ["/srv/keys_file: not a directory", "--model max_num_seqs is also an adapter's name",
                   "https://keys_file.example.com/ refused", "LORAFLEET_MAX_NUM_SEQS: expected int", "'keys_file'"]:
        assert flag_terms(quoted, Outer) == quoted


def test_a_value_spelling_a_field_s_name_is_quoted_as_given(tmp_path, capsys):
    with pytest.raises(SystemExit):
        config_from_args(WorkerConfig, ["--model", "m", "--adapters", str(tmp_path / "adapter_roots")], env={})
    err = capsys.readouterr().err
    assert "--adapter-roots" not in err, err
