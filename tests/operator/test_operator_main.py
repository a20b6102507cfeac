"""`python -m lorafleet.operator` as a real process: each log line printed once, no Kubernetes reported in
one line, and a stager token every sidecar would refuse refused at start."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import pytest

from lorafleet.operator.__main__ import main
from lorafleet.operator.operator_config import OperatorConfig

from .test_handlers import NS, cluster  # noqa: F401  (the kmock emulator fixture)

TOKEN = "operator-test-token-0123"


def operator_env(tmp_path, **extra: str) -> dict[str, str]:
    """No in-cluster service account, no kubeconfig but the one given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "LORAFLEET_"))}
    return {**env, "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "no-kubeconfig"),
            "LORAFLEET_STAGER_TOKEN": TOKEN, **extra}


def operator_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lorafleet.operator", *args]


def test_no_cluster_is_one_line_and_a_configuration_exit(tmp_path):
    out = subprocess.run(operator_cmd("--liveness-port", "0"), env=operator_env(tmp_path),
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert len(lines) == 1, lines
    assert "cannot reach Kubernetes: " in lines[0] and str(tmp_path / "no-kubeconfig") in lines[0]


def _kubeconfig(path, url: str) -> None:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: kmock, cluster: {{server: "{url}"}}}}]
users: [{{name: test, user: {{token: test}}}}]
contexts: [{{name: kmock, context: {{cluster: kmock, user: test, namespace: {NS}}}}}]
current-context: kmock
""")


async def test_every_log_line_is_printed_once(cluster, tmp_path):  # noqa: F811
    _, url = cluster
    _kubeconfig(tmp_path / "kubeconfig", url)
    proc = await asyncio.create_subprocess_exec(
        *operator_cmd("--namespace", NS, "--liveness-port", "0"),
        env=operator_env(tmp_path, KUBECONFIG=str(tmp_path / "kubeconfig")),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    seen: list[str] = []
    try:
        async with asyncio.timeout(60):  # a readiness poll on the output, not a timing assertion
            while not any("Initial authentication has finished" in line for line in seen):
                line = await proc.stdout.readline()
                assert line, "".join(seen)
                seen.append(line.decode())
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
    seen += rest.decode().splitlines(keepends=True)
    # Each message once, whatever the format around it.
    for message in ("Initial authentication has finished", "Activity 'register.<locals>.configure' succeeded"):
        assert sum(message in line for line in seen) == 1, "".join(seen)
    assert "Traceback" not in "".join(seen)


@pytest.mark.parametrize("token", ["", "short-token"])
def test_a_stager_token_every_sidecar_refuses_is_refused(monkeypatch, capsys, token):
    monkeypatch.delenv("LORAFLEET_STAGER_TOKEN", raising=False)
    with pytest.raises(ValueError, match="stager_token must be at least 16 characters"):
        OperatorConfig(stager_token=token)
    with pytest.raises(SystemExit) as exc:
        main(["--stager-token", token] if token else [])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"error: .*--stager-token must be at least 16 characters.*LORAFLEET_STAGER_TOKEN", err), err
