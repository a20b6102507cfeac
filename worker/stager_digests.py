"""LocalDigests: the digests of local adapter folders already hashed, so that a push, which stages every
version again, does not reread the files of the ones that did not change (many adapters on a network
mount would otherwise be read in full on every push).

A digest is kept per folder (and the bounds its files were read in: worker/tenant_folders.py) with the
identity of the files it covers: (size, mtime_ns, inode, ctime_ns, device) of each, as `os.stat` gives
them (symlinks followed), kept only when the files read are the ones stat'ed before and after the read.
Any change to one of those hashes the folder again; so does a file modified less than `settle_ns` before the hash began: a same-size rewrite
within the file system's timestamp granularity would keep its identity, so the digest of a file that
may still be written to is not kept. The least recently used folders go beyond `max_folders`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

MAX_FOLDERS = 4096
SETTLE_NS = 2_000_000_000  # coarser than the timestamps of any file system adapters are kept on

FileIdentity = tuple[int, int, int, int, int]
Identity = tuple[FileIdentity, ...]


def file_identity(info: os.stat_result) -> FileIdentity:
    return info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns, info.st_dev


def _identity(folder: Path, names: Sequence[str]) -> Identity | None:
    """What identifies the files `names` of `folder`; None when one cannot be stat'ed (not kept)."""
    try:
        infos = [os.stat(folder / name) for name in names]
    except OSError:
        return None
    return tuple(map(file_identity, infos))


class LocalDigests:
    def __init__(self, max_folders: int = MAX_FOLDERS, settle_ns: int = SETTLE_NS) -> None:
        self.max_folders, self.settle_ns = max_folders, settle_ns
        self._lock = threading.Lock()  # called from the stager's worker threads
        self._digests: OrderedDict[Hashable, tuple[Identity, str]] = OrderedDict()  # key -> (identity, digest)

    def digest(self, folder: Path, names: Sequence[str], compute: Callable[[], tuple[str, Identity | None]],
               key: Hashable = None) -> str:
        """The digest of the files `names` of `folder`: the one kept while they are unchanged, else the one
        `compute()` returns with the identity of the files it read (None: not known), kept when they are
        the files there before and after it ran, and have settled. `key` (default `folder`): what the
        digest is kept under, e.g. with the bounds the files were read in, so that one read in no bounds
        never answers for a read in some."""
        key = folder if key is None else key
        started = time.time_ns()
        before = _identity(folder, names)
        with self._lock:
            kept = self._digests.get(key)
            if before is not None and kept is not None and kept[0] == before:
                self._digests.move_to_end(key)
                return kept[1]
        digest, read = compute()
        settled = before is not None and all(mtime < started - self.settle_ns for _, mtime, *_ in before)
        # A file swapped away and back while it was read: the digest is of another file than `before`'s.
        unchanged = settled and read in (None, before) and _identity(folder, names) == before
        with self._lock:
            if unchanged:
                self._digests[key] = (before, digest)
                self._digests.move_to_end(key)
                while len(self._digests) > self.max_folders:
                    self._digests.popitem(last=False)
            else:
                self._digests.pop(key, None)
        return digest

    def __len__(self) -> int:
        with self._lock:
            return len(self._digests)
