"""The test servers start again on fresh ports when a port they were given is taken before they bind it,
whichever way the child says so (weed's own allocator, or a listener failing after a long stack trace)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.child_server import ChildServer, PortTaken
from tests.s3_server import S3Server

# What a weed whose volume listener lost its port printed: the message, then a stack trace past 2000 chars.
VOLUME_BIND_FAILED = (
    "F1202 08:41:41.521754 volume.go:629 Volume server listener error:listen tcp 127.0.0.1:35013: bind: "
    "address already in use\ngoroutine 177 [running]:\n"
    + "github.com/seaweedfs/seaweedfs/weed/glog.stacks(0x0)\n\tglog.go:832 +0x85\n" * 60
)


class ScriptedChild(ChildServer):
    """A child that prints what it is told and exits with 255 on its first starts, then stays up."""

    def __init__(self, root: Path, failures: list[str], markers: tuple[str, ...]) -> None:
        self.root, self.failures, self.port_taken_markers = root, failures, markers
        self.log_path = root / "child.log"
        self.fresh_ports = 0

    def _fresh_ports(self) -> None:
        self.fresh_ports += 1

    def _start(self, timeout: float) -> None:
        if self.failures:
            message = self.failures.pop(0)
            self._spawn([sys.executable, "-c", f"import sys; sys.stdout.write({message!r}); sys.exit(255)"],
                        cwd=self.root)
            self.proc.wait(timeout)
            self._close_log()
            raise self.exited("child", self.proc.returncode)
        self._spawn([sys.executable, "-c", "import time; time.sleep(60)"], cwd=self.root)


def test_weed_listener_failing_after_a_long_trace_is_a_taken_port(tmp_path):
    server = S3Server(tmp_path)
    server.log_path.write_text(VOLUME_BIND_FAILED)
    error = server.exited("weed", 255)
    assert isinstance(error, PortTaken)
    assert "exited with 255" in str(error)


def test_weed_allocator_message_is_a_taken_port_and_other_failures_are_not(tmp_path):
    server = S3Server(tmp_path)
    server.log_path.write_text("Port allocation failed for volume\n")
    assert isinstance(server.exited("weed", 1), PortTaken)
    server.log_path.write_text("open /data: permission denied\n")
    error = server.exited("weed", 1)
    assert type(error) is RuntimeError
    assert "permission denied" in str(error)


def test_a_start_whose_port_was_taken_starts_again_on_fresh_ports(tmp_path):
    child = ScriptedChild(tmp_path, [VOLUME_BIND_FAILED], S3Server.port_taken_markers)
    try:
        child.start(timeout=10)
        assert child.fresh_ports == 1
        assert child.proc.poll() is None
    finally:
        child.stop()
    assert child.proc is None


def test_a_start_that_fails_otherwise_is_not_tried_again(tmp_path):
    child = ScriptedChild(tmp_path, ["config: no such file\n", ""], S3Server.port_taken_markers)
    with pytest.raises(RuntimeError, match="no such file") as info:
        child.start(timeout=10)
    assert not isinstance(info.value, PortTaken)
    assert child.fresh_ports == 0


def test_ports_taken_on_every_try_give_up_after_three(tmp_path):
    child = ScriptedChild(tmp_path, [VOLUME_BIND_FAILED] * 3, S3Server.port_taken_markers)
    with pytest.raises(PortTaken):
        child.start(timeout=10)
    assert child.fresh_ports == 2
