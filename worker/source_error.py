"""SourceError: why an adapter source cannot be staged, and how a failed read of a local one becomes one.

The stager answers each `kind` with its own status (worker/staging_errors.py); a local file that cannot
be read is named with the reason (`permission_denied`, `symlink_loop`, `unreadable`), never passed on as
an OSError, which would read as a broken object store.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class SourceError(ValueError):
    """A source that is not allowed, malformed, missing, unreadable, or whose digest does not match.
    `kind`: not_allowed | bad_uri | missing | digest_mismatch | too_large | not_a_file | changed |
    permission_denied | symlink_loop | unreadable."""

    def __init__(self, message: str, kind: str = "bad_uri") -> None:
        super().__init__(message)
        self.kind = kind


class BodyCut(ConnectionError):
    """One object's answer from the store broke off or was not the bytes asked: a body that ended cleanly but
    short of the size listed, a rest answered with another range, or encoded. One object's fault while a quick
    listing of its version still answers, as a connection reset in its body is (staging_errors.is_object_fault)."""


def read_error(where: str | Path, exc: OSError | RuntimeError) -> SourceError:
    """`exc`, raised reading the local file or folder `where` (or the one the error names), as the
    refusal naming it and why. RuntimeError: Path.resolve's symlink loop (Python before 3.13)."""
    where = getattr(exc, "filename", None) or where
    if isinstance(exc, FileNotFoundError):
        return SourceError(f"{where}: no such file (removed while it was staged?)", "missing")
    if isinstance(exc, PermissionError):
        return SourceError(f"{where}: permission denied: this process (uid {os.geteuid()}) may not read it; make "
                           f"it readable by that user", "permission_denied")
    if isinstance(exc, RuntimeError) or exc.errno == errno.ELOOP:
        return SourceError(f"{where}: a symlink loop (following its links leads back to them); point the link at "
                           f"the adapter's file or folder", "symlink_loop")
    return SourceError(f"{where}: cannot be read ({exc.strerror or exc})", "unreadable")
