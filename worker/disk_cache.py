"""DiskCache: the node-local disk tier of staged adapter directories, with a byte budget.

Entries are directories `root/<key>`; a key is content-addressed (the adapter's sha256) when the
digest is known. Writes are atomic: an entry is filled in `root/.tmp-<key>-<random>` and renamed into
place only when complete, verified and on disk (fsync before the rename), so a reader never sees half a
download and a crash or power loss leaves only a temp directory (removed at the next start). Over budget, least recently used entries go first,
except the protected ones. `protect` may be a function naming them: it is called under the cache's
lock, so an entry its owner protects before looking it up is either kept or already gone (`get`
answers None), never deleted after `get` handed out its path.

Fills in flight count against the budget too: a fill that knows how many bytes it will write (a download,
once its objects are listed) reserves them (`reserve`), and the least recently used entries not
protected go then, before its bytes arrive, so several downloads at once stay within the budget instead of
going past it by what they are writing. The reservation ends with the fill: its entry's real size counts
instead, or nothing if it failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Set
from pathlib import Path

_TMP = ".tmp-"
Protect = Set[str] | Callable[[], Set[str]]  # cache keys, or a function naming them when the trim runs


class CacheDiskError(OSError):
    """Writing the node's disk cache failed (full, read-only, an I/O error): the node's to fix, never the
    object store's answer."""

    @classmethod
    def of(cls, exc: OSError) -> CacheDiskError:
        return exc if isinstance(exc, cls) else cls(exc.errno, exc.strerror or str(exc), exc.filename)


class CacheLimitError(OSError):
    """A download that would take the cache past its hard limit (the volume's size) with the copies it must keep:
    refused before its bytes arrive, rather than the volume filling (an emptyDir past its sizeLimit gets the pod
    evicted, and its successor downloads the same set)."""

    def __init__(self, nbytes: int, kept: int, limit: int) -> None:
        super().__init__(errno.EDQUOT, f"{nbytes} bytes do not fit beside the {kept} bytes of copies this worker "
                                       f"must keep, within the cache's limit of {limit} bytes")
        self.nbytes, self.kept, self.limit = nbytes, kept, limit


def cache_write(fn: Callable[[], object]) -> object:
    """Run `fn`, a write to the disk cache, its OSError raised as a CacheDiskError."""
    try:
        return fn()
    except OSError as exc:
        raise CacheDiskError.of(exc) from exc


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    """Swap directories `a` and `b` in one step (renameat2 RENAME_EXCHANGE): a reader of `b` finds the old
    copy or the new one, never none (the engine may be reading the copy being replaced)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), _RENAME_EXCHANGE) == 0:  # -100: AT_FDCWD
        return
    err = ctypes.get_errno()
    if err not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), str(b))
    # A file system without the exchange: two renames, the old copy put back if the second fails.
    aside = a.with_name(a.name + "-old")
    os.rename(b, aside)
    try:
        os.rename(a, b)
    except OSError:
        os.rename(aside, b)
        raise
    os.rename(aside, a)


def _sync_tree(path: Path) -> int:
    """Flush every regular file under `path`, then the directories that name them, to disk, in one walk;
    returns the files' bytes (what dir_bytes counts)."""
    total = 0
    for root, _dirs, files in os.walk(path, topdown=False):  # symlinked folders are not entered
        for name in files:
            f = os.path.join(root, name)
            if not stat.S_ISREG(os.lstat(f).st_mode):  # symlinks and special files are neither synced nor counted
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
        _sync(Path(root))
    return total


class DiskCache:
    def __init__(self, root: Path, budget_bytes: int, limit_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        # Protected copies may take the cache past its budget (a version replaced while its successor loads), never
        # past this: a fill that would is refused (CacheLimitError) once the others not protected have gone.
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._clock = 0
        self._used: dict[str, int] = {}  # key -> logical time of last use
        self._bytes: dict[str, int] = {}
        self._reserved: dict[str, int] = {}  # temp directory name -> bytes its fill said it will write
        self.evictions = 0
        # Entries an earlier run wrote: complete when renamed, but a crash or power loss may have kept the
        # rename and lost data not yet on disk. Their owner checks them before first use (mark_verified).
        self.unverified: set[str] = set()
        for child in sorted(self.root.iterdir()):
            if child.is_symlink():  # never the cache's own: not followed (its target walked, counted, served)
                with contextlib.suppress(OSError):
                    child.unlink()  # the link alone
            elif child.name.startswith(_TMP):
                shutil.rmtree(child, ignore_errors=True)  # a download interrupted by a crash
            elif child.is_dir():
                self._bytes[child.name] = dir_bytes(child)
                self._used[child.name] = 0
                self.unverified.add(child.name)

    def size_of(self, key: str) -> int:
        """The bytes of entry `key`, as counted when it was written (0: not in the cache)."""
        with self._lock:
            return self._bytes.get(key, 0)

    def get(self, key: str) -> Path | None:
        with self._lock:
            if key not in self._bytes:
                return None
            self._clock += 1
            self._used[key] = self._clock
            return self.root / key

    def put(self, key: str, fill: Callable[[Path], None], *, protect: Protect = frozenset()) -> Path:
        """Create entry `key` by `fill(tmp_dir)`, then trim, keeping `key` and the protected entries;
        `fill` raising leaves nothing behind. A disk that fills up first (smaller than the budget, or shared)
        loses every entry not protected (the protected set read under the lock, as in `trim`), and the fill
        is tried once more: a version wanted now goes before copies no push holds."""
        if "/" in key or key.startswith(".") or not key:
            raise ValueError(f"bad cache key {key!r}")
        keys = protect if callable(protect) else lambda: protect
        try:
            final = self._fill(key, fill)
        except CacheDiskError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._evict_all_but(lambda: {*keys(), key}):
                raise
            final = self._fill(key, fill)
        self.trim(lambda: {*keys(), key})
        return final

    def _fill(self, key: str, fill: Callable[[Path], None]) -> Path:
        tmp = self.root / f"{_TMP}{key}-{uuid.uuid4().hex[:8]}"
        cache_write(tmp.mkdir)
        try:
            fill(tmp)  # its own writes to `tmp` go through cache_write: its other OSErrors are the source's
            # Synced, else a power loss may keep the rename, lose the data, and only two files are rechecked.
            size = cache_write(lambda: _sync_tree(tmp))
            final = self.root / key
            with self._lock:
                self._reserved.pop(tmp.name, None)  # its real size counts from here, in the same step
                there, stale = final.exists(), None
                # A concurrent fill won (the same content); a folder the cache does not count (one an eviction
                # failed to remove) is no entry: replaced, never handed out uncounted and unchecked.
                if there and key in self._bytes and key not in self.unverified:
                    shutil.rmtree(tmp, ignore_errors=True)
                else:  # an earlier run's copy there could not be checked: swapped, never a moment without a copy
                    cache_write(lambda: _exchange(tmp, final) if there else os.rename(tmp, final))
                    stale = tmp if there else None  # the old copy, now
                    self.unverified.discard(key)
                    self._bytes[key] = size
                    cache_write(lambda: _sync(self.root))  # the rename itself
                self._clock += 1
                self._used[key] = self._clock
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:  # a fill that failed: its reservation ends
            with self._lock:
                self._reserved.pop(tmp.name, None)
        return final

    def reserve(self, tmp: Path, nbytes: int, protect: Protect = frozenset()) -> None:
        """The fill writing into `tmp` (the directory `put` gave it) will write `nbytes`: they count against the
        budget from now until the fill ends, and least recently used entries not protected go to make room."""
        nbytes = max(0, int(nbytes))
        with self._lock:
            self._reserved[Path(tmp).name] = nbytes
        total = self.trim(protect)
        if self.limit_bytes is not None and total > self.limit_bytes:
            with self._lock:
                self._reserved.pop(Path(tmp).name, None)
            raise CacheLimitError(nbytes, total - nbytes, self.limit_bytes)

    def _evict_all_but(self, keep: Callable[[], Set[str]]) -> int:
        """Evict every entry not named by `keep()`, called under the lock (the disk is full); how many went."""
        with self._lock:
            kept = keep()
            gone = [k for k in self._bytes if k not in kept]
            for key in gone:
                self._evict(key)
        return len(gone)

    def mark_verified(self, key: str) -> None:
        with self._lock:
            self.unverified.discard(key)

    def discard(self, key: str) -> None:
        """Remove entry `key` (found corrupt); a later `put` creates it again."""
        with self._lock:
            if self._bytes.pop(key, None) is not None:
                shutil.rmtree(self.root / key, ignore_errors=True)
                self._used.pop(key, None)
            self.unverified.discard(key)

    def trim(self, protect: Protect = frozenset()) -> int:
        """Evict least recently used entries until within budget, never a protected one; the bytes left (entries
        and reservations)."""
        with self._lock:
            keep = protect() if callable(protect) else protect
            total = sum(self._bytes.values()) + sum(self._reserved.values())
            for key in sorted(self._bytes, key=lambda k: self._used[k]):
                if total <= self.budget_bytes:
                    break
                if key in keep:
                    continue
                total -= self._evict(key)
            return total

    def _evict(self, key: str) -> int:
        """Remove entry `key` (the lock held); its bytes."""
        shutil.rmtree(self.root / key, ignore_errors=True)
        self._used.pop(key, None)
        self.unverified.discard(key)
        self.evictions += 1
        return self._bytes.pop(key)

    def entries(self) -> list[str]:
        with self._lock:
            return list(self._bytes)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes the fills in flight said they will write."""
        with self._lock:
            return sum(self._reserved.values())
