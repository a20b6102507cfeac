"""`python -m lorafleet.worker.stager` as a real process: a port or cache folder it cannot use ends in one
line naming it (exit 2), never a traceback; a start says where it listens."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

TOKEN = "0123456789abcdef0123"


def stager_cmd(*args: str) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "-m", "lorafleet.worker.stager", *args], {**os.environ, "LORAFLEET_STAGER_TOKEN": TOKEN}


def run_stager(*args: str) -> subprocess.CompletedProcess:
    cmd, env = stager_cmd(*args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], out.stderr


def test_a_port_in_use_is_refused_naming_the_port(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run_stager("--stager-cache-dir", str(tmp_path / "cache"), "--stager-port", str(port))
    assert_one_line_error(out, "cannot start", f"--stager-port {port}", f"127.0.0.1:{port}", "already in use")


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_a_cache_folder_that_cannot_be_made_is_refused_naming_it(tmp_path, where):
    if where == "proc":
        cache_dir = "/proc/nope"
    else:
        (tmp_path / "file").write_text("not a folder")
        cache_dir = str(tmp_path / "file" / "cache")
    out = run_stager("--stager-cache-dir", cache_dir, "--stager-port", "0")
    assert_one_line_error(out, "cannot start", f"--stager-cache-dir {cache_dir}")


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)  # end of output


def wait_for_line(lines: queue.Queue, pattern: str, seen: list[str], timeout: float = 60.0) -> re.Match:
    """The first line matching `pattern` (a readiness poll on the process's output)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(seen)}")


def stop(proc: subprocess.Popen) -> None:
    """End a stager the test started (by its PID), killed if it does not stop in time."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def test_a_start_logs_one_line_with_address_cache_and_engine(tmp_path):
    cache_dir = tmp_path / "cache"
    cmd, env = stager_cmd("--stager-cache-dir", str(cache_dir), "--stager-port", "0",
                          "--stager-cache-bytes", str(2 << 30), "--engine-url", "http://127.0.0.1:9")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        match = wait_for_line(lines, r"INFO .*stager listening on 127\.0\.0\.1:(\d+), cache (\S+) \((.+)\), "
                                     r"engine (\S+)", seen)
        port, logged_dir, budget, engine = match.groups()
        assert Path(logged_dir) == cache_dir and cache_dir.is_dir()
        assert "2.0 GiB" in budget and engine == "http://127.0.0.1:9"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as resp:
            assert resp.status == 200
    finally:
        stop(proc)
    assert len([line for line in seen if "stager listening" in line]) == 1
