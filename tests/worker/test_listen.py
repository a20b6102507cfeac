"""worker/listen.py: `*` listens on every family the machine has, so a pod of an IPv4, IPv6 or dual-stack cluster
is reached on its address (0.0.0.0 left IPv6 pods unreachable, :: IPv4 ones)."""

from __future__ import annotations

import socket
import subprocess
import threading
import urllib.request

import pytest

from lorafleet.worker.listen import ANY_HOST, close_all, listen_sockets
from tests.worker.test_stager_main import _lines, stager_cmd, stop, wait_for_line


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_any_host_listens_on_each_family_on_one_port():
    sockets = listen_sockets(ANY_HOST, 0)
    try:
        families = {s.family for s in sockets}
        assert socket.AF_INET in families and (socket.AF_INET6 in families) == _has_ipv6()
        assert len({s.getsockname()[1] for s in sockets}) == 1  # port 0: the first one's port for every family
        port = sockets[0].getsockname()[1]
        for family, loopback in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            if family in families:
                with socket.create_connection((loopback, port), timeout=5):
                    pass
    finally:
        close_all(sockets)


@pytest.mark.skipif(not _has_ipv6(), reason="this machine has no IPv6 loopback")
def test_a_stager_on_any_host_answers_on_ipv4_and_ipv6(tmp_path):
    import queue

    cmd, env = stager_cmd("--stager-host", ANY_HOST, "--stager-port", "0", "--stager-cache-dir", str(tmp_path / "c"),
                          "--engine-url", "http://127.0.0.1:9")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        port = wait_for_line(lines, r"stager listening on \*:(\d+)", [])[1]
        for host in ("127.0.0.1", "[::1]"):
            with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=30) as resp:
                assert resp.status == 200, host
    finally:
        stop(proc)
