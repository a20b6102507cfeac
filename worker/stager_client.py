"""The engine's side of the stager: `StagerClient` asks it for an adapter over localhost (blocking;
called from adapter loader threads, never the step loop), and `StagerProcess` starts a stager child
when the worker runs alone (no sidecar).

    with StagerProcess(cache_dir=..., env={...}) as stager:      # object-store settings in env
        path = stager.client().stage("s3://adapters/sql/v2/", sha256)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class StagerError(RuntimeError):
    """The stager refused or failed to stage an adapter; `code` is its error code."""

    def __init__(self, message: str, status: int = 0, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class StagerClient:
    def __init__(self, url: str, token: str, *, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                err = json.loads(exc.read()).get("error", {})
            except ValueError:
                err = {}
            raise StagerError(err.get("message") or f"stager answered {exc.code}", exc.code, err.get("code")) from None
        except (urllib.error.URLError, OSError) as exc:
            raise StagerError(f"stager at {self.url} unreachable: {exc}") from None

    def stage(self, uri: str, sha256: str | None = None) -> Path:
        """Local directory of the adapter at `uri`, downloaded and verified by the stager if needed."""
        return Path(self._call("POST", "/v1/stage", {"uri": uri, "sha256": sha256})["path"])

    def state(self) -> dict:
        return self._call("GET", "/v1/state")

    def put_directives(self, desired: dict) -> dict:
        return self._call("PUT", "/v1/directives", desired)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StagerProcess:
    """A stager child process on 127.0.0.1 with a fresh random token; stopped by its PID."""

    def __init__(self, *, cache_dir: str | Path, port: int = 0, env: dict[str, str] | None = None,
                 args: list[str] | None = None, log_path: str | Path | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.port = port or _free_port()
        self.token = secrets.token_urlsafe(24)
        self.env = env
        self.args = args or []
        self.log_path = Path(log_path) if log_path else self.cache_dir.parent / f"stager-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 600.0) -> StagerClient:
        return StagerClient(self.url, self.token, timeout=timeout)

    def start(self, timeout: float = 30.0) -> None:
        env = dict(os.environ if self.env is None else self.env)
        env["LORAFLEET_STAGER_TOKEN"] = self.token  # not on the command line (visible in ps)
        cmd = [sys.executable, "-m", "lorafleet.worker.stager", "--stager-host", "127.0.0.1",
               "--stager-port", str(self.port), "--stager-cache-dir", str(self.cache_dir), *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise StagerError(f"stager exited with {self.proc_returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise StagerError(f"stager not ready after {timeout} s") from None
                time.sleep(0.05)

    proc_returncode = property(lambda self: self.proc.returncode if self.proc else None)

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            self._log = None

    def __enter__(self) -> StagerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
