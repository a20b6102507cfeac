"""Staged: an adapter copy the stager hands out, and the check a copy from an earlier run passes before
it is handed out again."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.worker.disk_cache import DiskCache, cache_write, dir_bytes
from lorafleet.worker.sources import ADAPTER_FILES, SourceError, adapter_digest

log = logging.getLogger("lorafleet.stager")
DIGEST_FILE = ".sha256"  # beside the adapter files in a cache entry: the digest they had when staged
SOURCE_FILE = ".source"  # ...and the URI they were staged from (a restarted stager's store-outage fallback)
# ...and every URI whose own objects were downloaded and hashed to that digest. A copy keyed by its digest is
# handed out for a URI only once that URI's objects proved to hold it: a digest is no capability, and a
# tenant bound to its own folders (operator/tenant_sources.py) naming another tenant's digest under a URI of
# its own gets what its folder holds, not the other's cached copy.
ORIGINS_FILE = ".origins"
_MAX_ORIGINS_BYTES = 64 << 10  # past it the list restarts (the URIs left out are checked again, once)
_MAX_SOURCES, _MAX_SOURCES_BYTES = 64, 64 << 10  # URIs whose last use an entry's SOURCE_FILE keeps; its size read
_READ_FAILED = ("unreadable", "permission_denied")  # SourceError kinds that say nothing of what a file holds


@dataclass(slots=True)
class Staged:
    path: Path
    sha256: str
    cached: bool

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "sha256": self.sha256, "cached": self.cached, "bytes": dir_bytes(self.path)}


def verify_staged_copy(cache: DiskCache, key: str) -> Path | None:
    """The entry `key`, written by an earlier run, if its files still hash to the recorded digest (and to
    the key, when the key is the digest); else the entry is dropped (None: download it again). A crash or
    power loss can leave a renamed entry whose data never reached the disk. A read error is not the entry's
    fault: None, the entry kept unverified (a store outage may leave it the only copy)."""
    path = cache.root / key
    try:
        recorded = (path / DIGEST_FILE).read_text().strip()
        digest = adapter_digest(path)
    except (OSError, SourceError, UnicodeDecodeError) as exc:  # SourceError: adapter_digest's
        if _read_failed(exc):  # the entry may be whole, and the only copy
            log.warning("disk cache entry %s could not be read to check it (%s); it is kept, and checked again on "
                        "its next use", key, exc)
            return None
        recorded = digest = None  # a file missing, garbled or no regular file: the entry is broken
    if digest is not None and digest == recorded and (len(key) != 64 or key == digest):
        cache.mark_verified(key)
        return path
    log.warning("disk cache entry %s does not hash to its recorded digest; it is downloaded again", key)
    cache.discard(key)
    return None


def _read_failed(exc: Exception) -> bool:
    """Whether `exc` says a read failed (EIO, descriptors, a permission), nothing of what the files hold."""
    if isinstance(exc, SourceError):
        return exc.kind in _READ_FAILED
    return isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError)


def record_source(path: Path, uri: str) -> None:
    """Note in the cache entry at `path` that `uri` was staged (or served) from it, now: the newest such note
    of a URI is its last copy for `last_copies`. Each URI's own time (a line `uri<TAB>time`, the newest
    _MAX_SOURCES kept): a copy one digest serves to several URIs is the last copy of each as of its own use,
    not of the latest use by any."""
    uses = _uses(path)
    uses[uri] = time.time()
    newest = sorted(uses.items(), key=lambda use: use[1])[-_MAX_SOURCES:]
    try:
        (path / SOURCE_FILE).write_text("".join(f"{u}\t{when:.6f}\n" for u, when in newest))
    except OSError as exc:  # a read-only or full disk: only the fallback after a restart is lost
        log.warning("cannot note %s's source in %s: %s", uri, path, exc)


def _uses(path: Path) -> dict[str, float]:
    """URI -> when it was last staged or served from the entry at `path` (a line without a time, as an older
    version wrote: the note's own time)."""
    lines, written = _noted(path / SOURCE_FILE, _MAX_SOURCES_BYTES)
    uses: dict[str, float] = {}
    for line in lines:
        uri, _, when = line.partition("\t")
        try:
            uses[uri] = float(when) if when else written
        except ValueError:  # a torn line
            continue
    return uses


def extras_digest(path: Path) -> str:
    """sha256 over the names and bytes of the files staged beside the adapter's two (tokenizer files and the
    optional ones; not the entry's own notes, whose names start with "."). The adapter's digest leaves them
    out, so two copies of one digest may differ in them."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.startswith(".") or name in ADAPTER_FILES or not (path / name).is_file():
            continue
        h.update(f"{len(name)}:{name}:{(path / name).stat().st_size}:".encode())
        with open(path / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def variant_key(sha256: str, extras: str) -> str:
    """The cache key of a copy of digest `sha256` whose other files (`extras_digest`) differ from those of the
    copy keyed by `sha256` itself: found again through its URI's last copy, never handed to another URI."""
    return "x-" + hashlib.sha256(f"{sha256}:{extras}".encode()).hexdigest()[:40]


class VariantKept(Exception):
    """A download kept under its variant key (`keep_variant`), at `path`."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


def keep_variant(cache: DiskCache, key: str, tmp: Path, protect: Callable[[], set[str]]) -> None:
    """A download in `tmp` of the digest `key` when the cache already holds a copy of it (another URI's) whose
    other files differ (`extras_digest`): its files are linked into an entry of their own, and VariantKept says
    where, or the loader would check (and serve) the other URI's tokenizer files for this one."""
    kept = cache.get(key) if len(key) == 64 else None
    if kept is None or (extras := extras_digest(tmp)) == extras_digest(kept):
        return

    def link(dest: Path) -> None:
        # One file system: hard links, no copy. Linked, not moved: a fill that fails (a full disk) and is tried
        # again finds every file still in `tmp`, which goes once this fill ends.
        for name in os.listdir(tmp):
            cache_write(lambda n=name: os.link(tmp / n, dest / n))

    raise VariantKept(cache.put(variant_key(key, extras), link, protect=protect))


def note_download(path: Path, uri: str) -> None:
    """Note in the cache entry at `path` that `uri`'s own objects were downloaded and hashed to its digest, now."""
    record_source(path, uri)
    note_origin(path, uri)


def note_origin(path: Path, uri: str) -> None:
    """Note in the cache entry at `path` that `uri`'s own objects hashed to its digest."""
    if has_origin(path, uri):
        return
    try:
        full = (path / ORIGINS_FILE).exists() and (path / ORIGINS_FILE).stat().st_size > _MAX_ORIGINS_BYTES
        with open(path / ORIGINS_FILE, "w" if full else "a") as f:
            f.write(uri + "\n")
    except OSError as exc:  # a read-only or full disk: the URI's next stage downloads it again to check it
        log.warning("cannot note %s as a source of %s: %s", uri, path, exc)


def has_origin(path: Path, uri: str) -> bool:
    """Whether `uri`'s own objects were downloaded and hashed to the digest of the cache entry at `path`."""
    return uri in _noted(path / ORIGINS_FILE, 2 * _MAX_ORIGINS_BYTES)[0]


def _noted(file: Path, max_bytes: int) -> tuple[list[str], float]:
    """The URIs a note of a cache entry lists, and when it was last written; none if it is not what
    record_source or note_origin writes (a FIFO would block the start) or cannot be read."""
    try:
        st = file.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return [], 0.0
        text = file.read_text()
        lines = text.split("\n")[:-1]  # a last line without its newline was torn (a full disk): not a URI
        return [u for u in lines if u], st.st_mtime
    except (OSError, UnicodeDecodeError):  # an entry of an older version, or unreadable
        return [], 0.0


def last_copies(cache: DiskCache) -> dict[str, str]:
    """URI -> cache key of its most recently staged copy, from the entries an earlier run left (each records
    its URI, SOURCE_FILE; one keyed by its digest, every URI it was downloaded from, ORIGINS_FILE): a stager
    restarted while the store is down still serves what it had staged, its copies checked
    (`verify_staged_copy`) on first use as every entry of an earlier run is."""
    found: dict[str, tuple[float, str]] = {}
    for key in cache.entries():
        uses = _uses(cache.root / key)  # each URI's last use (record_source)
        if len(key) == 64:  # keyed by its digest: only for the URIs whose own objects hashed to it
            origins = set(_noted(cache.root / key / ORIGINS_FILE, 2 * _MAX_ORIGINS_BYTES)[0])
            uses = {uri: when for uri, when in uses.items() if uri in origins}
        for uri, when in uses.items():
            if uri not in found or when > found[uri][0]:
                found[uri] = (when, key)
    return {uri: key for uri, (_, key) in found.items()}
