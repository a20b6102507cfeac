"""Short-lived commands that a module's tests each check one of, run side by side.

Each `python -m lorafleet.worker ...` run spends seconds importing torch before it gets to what a test
checks; run one after the other, a module of such tests waits for every import in turn. A module-scoped
fixture submits all of its commands at once (as many running as there are cores) and each test waits
for its own result, then asserts on it exactly as it would on a `subprocess.run` of its own.

    @pytest.fixture(scope="module")
    def runs():
        with ParallelRuns() as runs:
            for key, cmd in CASES.items():
                runs.submit(key, cmd, env=...)
            yield runs

    def test_x(runs):
        out = runs.result(key)  # a subprocess.CompletedProcess (text, stdout and stderr captured)
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor


class ParallelRuns:
    def __init__(self, max_running: int | None = None, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=max_running or max(2, os.cpu_count() or 2))
        self._futures: dict[object, Future] = {}

    def submit(self, key, cmd: list[str], **kwargs) -> None:
        """Start `cmd` (subprocess.run keywords in kwargs) as soon as a runner is free."""
        assert key not in self._futures, key
        self._futures[key] = self._pool.submit(subprocess.run, cmd, capture_output=True, text=True,
                                               timeout=self.timeout, **kwargs)

    def result(self, key) -> subprocess.CompletedProcess:
        """The finished run of `key` (its exception, a timeout say, is raised here, in its test)."""
        return self._futures[key].result()

    def close(self) -> None:
        # Runs not started yet are dropped; a started one ends by itself (or subprocess.run's timeout
        # kills it), and is waited for.
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ParallelRuns:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
