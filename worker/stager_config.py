"""StagerConfig: the stager process's settings (flags and LORAFLEET_* env vars are generated from it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.worker.file_limits import MAX_FILE_BYTES
from lorafleet.worker.sources import SourcesConfig


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(slots=True)
class StagerConfig:
    stager_token: str = field(default="", metadata=_help("bearer token every caller must present (>= 16 chars)"))
    stager_host: str = field(default="127.0.0.1", metadata=_help(
        "address to listen on (localhost: a sidecar; * in a pod: every address of IPv4 and IPv6)"))
    stager_port: int = field(default=8100, metadata=_help("TCP port"))
    stager_cache_dir: str = field(default="/var/cache/lorafleet", metadata=_help("node-local disk cache"))
    stager_cache_bytes: int = field(default=50 << 30, metadata=_help("byte budget of the disk cache"))
    stager_cache_limit_bytes: int | None = field(default=None, metadata=_help(
        "the most the cache may hold, copies that must stay included (the volume's size: an emptyDir's sizeLimit); "
        "a download past it is refused, as that version's error (507 cache_limit), instead of the volume filling "
        "(unset: the disk's own size)"))
    max_adapter_file_bytes: int = field(default=MAX_FILE_BYTES, metadata=_help(
        "largest adapter file staged (adapter_config.json: at most 1 MiB); a larger one, or one that is not a "
        "regular file (a FIFO, a device), is refused before it is read or downloaded"))
    local_roots: list[str] = field(default_factory=list, metadata=_help("directories local sources may be in"))
    s3_allow: list[str] = field(default_factory=list, metadata=_help("allowed `bucket` or `bucket/prefix/`"))
    s3_endpoint: str | None = field(default=None, metadata=_help("object store host:port"))
    s3_access_key: str | None = field(default=None, metadata=_help("object store access key"))
    s3_secret_key: str | None = field(default=None, metadata=_help("object store secret key"))
    s3_secure: bool = field(default=True, metadata=_help("use TLS to the object store"))
    s3_region: str | None = field(default=None, metadata=_help("object store region"))
    download_timeout_s: float = field(default=300.0, metadata=_help("give up on one adapter download after"))
    store_check_timeout_s: float = field(default=3.0, metadata=_help(
        "read timeout of a listing that checks a cached copy is current, and of a push's first call to a store "
        "that did not answer; no answer in time (one retry) takes the store as down for the push"))
    stage_concurrency: int = field(default=4, metadata=_help(
        "versions of a push staged at once (a new pod's warm set is one push): one slow download does not hold up "
        "the others, and a fast store fills a pod sooner, but the downloads in flight share the link, each within "
        "its own --download-timeout-s. Each download counts its size against the cache's byte budget from the "
        "moment its objects are listed"))
    stage_lease_s: float = field(default=600.0, metadata=_help(
        "keep a copy /v1/stage handed out from eviction this long (the engine loads from its path)"))
    engine_url: str | None = field(default=None, metadata=_help("engine base URL (http://127.0.0.1:8000)"))
    admin_token: str | None = field(default=None, metadata=_help("the engine's admin token"))
    stager_adapters: str | None = field(
        default=None, metadata=_help("s3://bucket/prefix/ whose subfolders are adapters to serve at start"))
    ready_after_push: bool = field(default=False, metadata=_help(
        "/readyz answers 200 only once a push (the operator's, or the seed of --stager-adapters) has reached the "
        "engine, so that a new pod joins its Service with its adapters registered instead of answering 404; "
        "off: as soon as the stager listens"))
    ready_without_push_s: float | None = field(default=None, metadata=_help(
        "with --ready-after-push: ready anyway this many seconds after the start when no push has reached the "
        "engine (no operator, or none that selects this pod), serving the base model only (unset: never)"))
    engine_start_wait_s: float = field(default=900.0, metadata=_help(
        "how long a push waits for its engine to finish starting (the model loading) before it is forwarded; its "
        "downloads go on meanwhile, so a new pod stages its adapters while its model loads"))

    def __post_init__(self) -> None:
        # The paths handed out (and checked by the engine) are absolute, whatever the working directory.
        self.stager_cache_dir = os.path.abspath(self.stager_cache_dir)
        if len(self.stager_token) < 16:
            raise ValueError("stager_token must be at least 16 characters (set LORAFLEET_STAGER_TOKEN)")
        if not 0 <= self.stager_port < 65536:
            raise ValueError(f"stager_port must be in 0..65535, got {self.stager_port}")
        if min(self.stager_cache_bytes, self.download_timeout_s, self.stage_lease_s, self.store_check_timeout_s) <= 0:
            raise ValueError("stager_cache_bytes, download_timeout_s, stage_lease_s and store_check_timeout_s must be > 0")
        if self.engine_start_wait_s < 0 or (self.ready_without_push_s is not None and self.ready_without_push_s < 0):
            raise ValueError("engine_start_wait_s and ready_without_push_s must be >= 0 seconds")
        if self.stager_cache_limit_bytes is not None and self.stager_cache_limit_bytes < self.stager_cache_bytes:
            raise ValueError(f"stager_cache_limit_bytes ({self.stager_cache_limit_bytes}) must be at least "
                             f"stager_cache_bytes ({self.stager_cache_bytes}): the budget is kept below the limit")
        if not 1 <= self.stage_concurrency <= 64:
            raise ValueError(f"stage_concurrency must be in 1..64, got {self.stage_concurrency}")
        if self.max_adapter_file_bytes <= 0:
            raise ValueError(f"max_adapter_file_bytes must be > 0, got {self.max_adapter_file_bytes}")

    def cache_dir_problem(self) -> str | None:
        """Why the cache folder cannot be used, or None; a missing one is made (checked at start)."""
        return cache_dir_problem(self.stager_cache_dir)

    def sources_config(self) -> SourcesConfig:
        return SourcesConfig(local_roots=list(self.local_roots), s3_allow=list(self.s3_allow),
                             s3_endpoint=self.s3_endpoint, s3_access_key=self.s3_access_key,
                             s3_secret_key=self.s3_secret_key, s3_secure=self.s3_secure, s3_region=self.s3_region,
                             max_adapter_file_bytes=self.max_adapter_file_bytes,
                             store_check_timeout_s=self.store_check_timeout_s)


def cache_dir_problem(path: str | Path) -> str | None:
    """Why `path` cannot be a stager's cache folder, or None; a missing one is made. The worker checks the
    one of its stager child too, before the model loads."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--stager-cache-dir {path}: cannot create it ({exc.strerror}); choose a writable folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"--stager-cache-dir {path}: not writable by this process; choose a writable folder"
    return None
