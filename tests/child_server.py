"""What the test servers (`S3Server`, `PrometheusServer`) share: one child process started by the test,
its output in a log file, and a `stop()` that always reaches the PID it started (TERM, then KILL after
`stop_grace_s`; with `own_session`, KILL goes to the child's process group). A context manager. A first
start whose port another process took meanwhile (free_port only picked it) starts again on fresh ports; a
restart keeps its ports (clients know them)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


class PortTaken(RuntimeError):
    """The child could not bind a port it was given."""


class ChildServer:
    stop_grace_s = 5.0
    own_session = False  # the child runs in its own session: KILL its whole group (helpers it spawned)
    log_path: Path

    proc: subprocess.Popen | None = None
    _log = None
    _ready_once = False
    start_timeout_s = 30.0

    def start(self, timeout: float | None = None) -> None:
        """Start and wait until ready (`_start`, which raises PortTaken where a port was taken), at most
        `timeout` seconds (default `start_timeout_s`) per try."""
        timeout = self.start_timeout_s if timeout is None else timeout
        for attempt in range(3):
            try:
                self._start(timeout)
                self._ready_once = True
                return
            except PortTaken:
                if self._ready_once or attempt == 2:
                    raise
                self.log_path.unlink(missing_ok=True)  # a start again logs afresh
                self._fresh_ports()

    def _start(self, timeout: float) -> None:
        raise NotImplementedError

    def _fresh_ports(self) -> None:
        raise NotImplementedError

    def _spawn(self, cmd: list[str], cwd: Path) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=self.own_session)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""

    port_taken_markers: tuple[str, ...] = ("address already in use",)

    def exited(self, name: str, code: int) -> RuntimeError:
        """The error for a child that exited while starting: PortTaken where its whole log (a port's
        message may lie before a long stack trace) shows a port it was given was taken."""
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        error = PortTaken if any(marker in log for marker in self.port_taken_markers) else RuntimeError
        return error(f"{name} exited with {code}: {log[-2000:]}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                if self.own_session:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
                proc.wait(self.stop_grace_s)
        self._close_log()

    def _close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            log.close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
