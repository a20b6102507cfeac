"""A real Prometheus for tests: the Debian ``prometheus`` binary (``make prometheus``) on 127.0.0.1, a
free port, its data and log under a given folder.

    with PrometheusServer(tmp_path, scrape_configs) as prom:
        prom.url                          # http://127.0.0.1:PORT
        prom.query("up")                  # the instant query's result list

`start()` polls ``/-/ready`` until the server answers; `stop()` sends TERM, then KILL after 10 s,
always to the PID it started. The first samples arrive about one scrape interval after it is ready:
poll for them (``wait_for``), never sleep.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.child_server import ChildServer
from tests.s3_server import free_port


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer(ChildServer):
    start_timeout_s = 60.0
    stop_grace_s = 10.0

    def __init__(self, root: Path, scrape_configs: list[dict[str, Any]], *, scrape_interval: str = "1s") -> None:
        self.root = Path(root)
        self.scrape_configs, self.scrape_interval = scrape_configs, scrape_interval
        self.port = free_port()
        self.log_path = self.root / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _fresh_ports(self) -> None:
        self.port = free_port()

    def _start(self, timeout: float) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus not found (make prometheus)")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": self.scrape_configs,
        }))
        self._spawn([binary, f"--config.file={config}", f"--storage.tsdb.path={self.root / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}"], cwd=self.root)
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise self.exited("prometheus", code)
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus not ready after {timeout} s: {self.log_tail()}")
            time.sleep(0.1)

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())["data"]["result"]

    async def wait_for(self, check: Callable[[], bool], what: str, *, timeout: float = 90.0) -> None:
        """Poll until ``check()`` (typically over ``query``) holds: samples arrive with the scrapes."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus never had {what}: {self.log_tail()}")
            await asyncio.sleep(0.2)
