"""`make run` prints a curl that reaches the worker it starts: its port, and a key when keys are on.

The run target is made with its install and model steps marked done (`-o`), and the worker given
`--help`, so nothing is installed or served: what is checked is the printed curl and the command."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.parallel_runs import ParallelRuns

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None or not (ROOT / ".venv/bin/python").exists(),
                                reason="needs make and the repository's .venv")


PORT_CASES = [
    ("", {}, 8000),
    ("--port 9123", {}, 9123),
    ("--port=9124 --log-level debug", {}, 9124),
    ("", {"LORAFLEET_PORT": "9125"}, 9125),
    ("--port 9126", {"LORAFLEET_PORT": "9125"}, 9126),
]
KEY_CASES = [
    ("--api-keys-file keys.yaml", {}),
    ("", {"LORAFLEET_API_KEYS_FILE": "keys.yaml"}),
]


def _key(run_args: str, env: dict[str, str]):
    return run_args, tuple(sorted(env.items()))


def _submit(runs: ParallelRuns, run_args: str, env: dict[str, str]) -> None:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("LORAFLEET_") and k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    runs.submit(_key(run_args, env), ["make", "-s", "-o", "install", "-o", "model", "run",
                                      f"RUN_ARGS={run_args} --help"], cwd=ROOT, env={**base, **env})


@pytest.fixture(scope="module")
def make_runs():
    """Every case's `make run` (each one the worker's --help), started together: most of each run is
    the worker importing torch."""
    with ParallelRuns() as runs:
        for run_args, env, _ in PORT_CASES:
            _submit(runs, run_args, env)
        for run_args, env in KEY_CASES:
            _submit(runs, run_args, env)
        yield runs


def make_run(runs: ParallelRuns, run_args: str, **env: str) -> str:
    out = runs.result(_key(run_args, env))
    assert out.returncode == 0, out.stderr
    return out.stdout


def printed_curl(stdout: str) -> str:
    return next(line.strip() for line in stdout.splitlines() if line.strip().startswith("curl "))


@pytest.mark.parametrize(("run_args", "env", "port"), PORT_CASES)
def test_printed_curl_names_the_port_the_worker_listens_on(make_runs, run_args, env, port):
    stdout = make_run(make_runs, run_args, **env)
    curl = printed_curl(stdout)
    assert re.search(rf"http://127\.0\.0\.1:{port}/v1/completions", curl), curl
    assert f":{port}" in stdout.split("\n")[0]
    assert "Authorization" not in curl
    assert "--model" in stdout and "--port" in stdout  # the worker's own --help ran


@pytest.mark.parametrize(("run_args", "env"), KEY_CASES)
def test_printed_curl_carries_a_key_when_the_worker_checks_keys(make_runs, run_args, env):
    stdout = make_run(make_runs, run_args, **env)
    assert "-H 'Authorization: Bearer YOUR_KEY'" in printed_curl(stdout)
    assert "YOUR_KEY: a key of the --api-keys-file" in stdout
