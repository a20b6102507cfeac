"""A local version's tenant folders, and the bounds the stager holds the folder and its files to.

`TenantFolders` is what a directive's version carries (VersionRef.within and .without, from its pool's
`spec.tenantSources`: operator/tenant_sources.py). `within`: the entries the source lies under, bound to
its own tenant and namespace, filled in. `without`: the fixed part of an entry (its segments before the
first placeholder) that lies at or under one of those, a region of the tenant's own folder where other
tenants' folders lie too.

`FolderBounds` resolves them on the stager. A path, symlinks followed, is inside when it lies under a
configured root, under a `within` folder (when any is given), and, for every `without` folder it lies
under, under a `within` folder strictly deeper than that one. Running example: entries `/a/{tenant}/`
and `/a/legacy/{tenant}/`, tenant `legacy`, source `/a/legacy/legacy/m`: within (/a/legacy/,
/a/legacy/legacy/), without (/a/legacy/,). A real folder /a/legacy/legacy/m is inside; a link from it to
/a/legacy/b/x (tenant b's) lies under /a/legacy/ but in no own folder below it, and is refused.

The folders are taken as written inside the roots: a component of one that is a symlink lying inside a
root (other than a configured root) is refused, as a tenant who may write /data/acme/ could otherwise point
its folder /data/acme/adapters/ at another tenant's. Tenant folders must be real directories there; links
above the roots (the administrator's) are followed.

A file is checked where it was opened (`check_opened`: the kernel's path for the descriptor), and its
bytes are hashed from that descriptor: a file swapped for a symlink once the folder was checked is refused,
never read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lorafleet.worker.source_error import SourceError, read_error
from lorafleet.worker.stager_digests import FileIdentity, file_identity


@dataclass(slots=True, frozen=True)
class TenantFolders:
    within: tuple[str, ...] = ()  # local folders, "/path/" or "file:///path/"
    without: tuple[str, ...] = ()


NO_FOLDERS = TenantFolders()


def local_uri_path(uri: str) -> str:
    """The path a local source names (`/abs/dir` or `file:///abs/dir`), unresolved; a relative path or
    '..' is refused (it would depend on the worker's working directory, or escape the roots)."""
    raw = uri[len("file://"):] if uri.startswith("file://") else uri
    if "\x00" in raw or any("\ud800" <= c <= "\udfff" for c in raw):  # no file system takes these
        raise SourceError(f"{uri!r}: not a usable path (a NUL byte or an unpaired surrogate)")
    # '..' first: `file://../x` is relative too, and must be refused as an escape, not passed on.
    if ".." in PurePosixPath(raw).parts:
        raise SourceError(f"{uri!r}: '..' is not allowed in adapter paths (give an absolute path without '..')",
                          "not_allowed")
    if not raw.startswith("/"):
        raise SourceError(f"{uri!r}: local sources must be absolute paths (an absolute path without '..': /abs/dir "
                          f"or file:///abs/dir); a relative path would depend on the worker's working directory")
    return raw


def local_source(uri: str) -> str:
    """The local path of a staged source (`/abs/dir` or `file:///abs/dir`); object-store URIs must have
    been staged by the stager first. A relative path or '..' is refused: it would be read relative to
    the worker's working directory, wherever that is (the admin API checks the adapter roots)."""
    if "://" in uri.removeprefix("file://"):
        raise ValueError(f"{uri} is not staged: the stager downloads object-store sources to local disk and "
                         "pushes local paths")
    return local_uri_path(uri)


def resolve(path: Path) -> Path:
    """`path` with its symlinks followed; a loop among them is refused, naming `path`."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:
        raise read_error(path, exc) from None


class FolderBounds:
    """Where a local source's folder and files may resolve: `roots` (resolved at start, in the order of
    `configured_roots`, the roots as written), and `folders`, resolved once here."""

    def __init__(self, roots: Sequence[Path], configured_roots: Sequence[str], folders: TenantFolders) -> None:
        self.roots, self.folders = list(roots), folders
        self._pinned = {Path(c): r for c, r in zip(configured_roots, roots, strict=True)}  # as resolved at start
        self._within = [self._resolve(w) for w in folders.within]
        self._without = [self._resolve(w) for w in folders.without]

    def problem(self, path: Path) -> str | None:
        """Why the resolved `path` is out of bounds ("outside ...", "inside ..."), or None."""
        if not any(path.is_relative_to(r) for r in self.roots):
            return f"outside the allowed local roots ({', '.join(map(str, self.roots)) or 'none configured'})"
        own = self.folders.within
        if own and not any(path.is_relative_to(w) for w in self._within):
            return f"outside its tenant's folders ({', '.join(own)})"
        for spelled, region in zip(self.folders.without, self._without, strict=True):
            below = [(s, w) for s, w in zip(own, self._within, strict=True) if w != region and w.is_relative_to(region)]
            if path.is_relative_to(region) and not any(path.is_relative_to(w) for _, w in below):
                return (f"inside {spelled}, where other tenants' folders lie, and in none of its tenant's "
                        f"folders below it ({', '.join(s for s, _ in below) or 'none'})")
        return None

    def check(self, path: Path, what: str) -> None:
        """SourceError `not_allowed` ("{what} {problem}") when the resolved `path` is out of bounds."""
        if (problem := self.problem(path)) is not None:
            raise SourceError(f"{what} {problem}", "not_allowed")

    def _resolve(self, folder: str) -> Path:
        """A tenant folder resolved. Refused when a component of it is a symlink that lies inside the roots,
        unless a configured root that still leads where it did at start: the administrator's links above the
        roots are followed, none a tenant could have made below them."""
        spelled = PurePosixPath(local_uri_path(folder))
        for depth in range(2, len(spelled.parts) + 1):
            part = Path(*spelled.parts[:depth])
            try:
                is_link = stat.S_ISLNK(os.lstat(part).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                break  # nothing below it exists either
            except OSError as exc:
                raise read_error(part, exc) from None
            if not is_link or self._pinned.get(part) == resolve(part):
                continue
            if any((resolve(part.parent) / part.name).is_relative_to(r) for r in self.roots):
                raise SourceError(f"{folder}: {part} is a symlink inside the local roots; a tenant's folder and the "
                                  f"folders leading to it there must be real directories (a link could lead one "
                                  f"tenant's folder into another's): replace the link with the directory",
                                  "not_allowed")
        return resolve(Path(spelled))

    def check_opened(self, file: Path, fd: int) -> FileIdentity:
        """The identity (stager_digests.file_identity) of the file open as `fd`, once where it lies
        (`opened_path`, not where `file` leads now) is in bounds; SourceError `not_allowed` otherwise."""
        real = opened_path(fd, file)
        self.check(real, f"{file}: the file opened lies at {real},")
        return file_identity(os.fstat(fd))


def opened_path(fd: int, file: Path) -> Path:
    """Where the file open as `fd` (opened as `file`) lies: the kernel's path for it, which no later change
    to the links along `file` alters. Without /proc (not Linux): where `file` leads, refused unless it is
    the file open."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        real = resolve(file)
        now, opened = os.stat(real), os.fstat(fd)
        if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
            raise SourceError(f"{file}: replaced while it was read; stage it again", "changed") from None
        return real
