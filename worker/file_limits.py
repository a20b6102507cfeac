"""Limits on adapter files: a file is checked before a byte of it is read, so a huge one is refused
instead of filling memory or the disk, and a FIFO or a device (`/dev/zero`) instead of blocking the
reader or never ending. The stager answers with a `SourceError`, the loader with an `AdapterError`;
both carry the `FileLimitError` message, which names the file, its size and the limit.

Per file: the weights at most `max_bytes` (the stager's and the engine's `--max-adapter-file-bytes`, default
`MAX_FILE_BYTES`), `adapter_config.json` at most `MAX_CONFIG_BYTES`, and every other file staged beside them
(tokenizer files, the README) at most `MAX_SIDE_FILE_BYTES`: the loader parses tokenizer JSON into Python
objects, some 25 times its size in memory, so a 4 GiB one would take the worker down.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
MAX_FILE_BYTES = 4 << 30  # a rank-64 LoRA of every projection of a 70B model is ~1.6 GiB in bf16
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few KiB of JSON
MAX_SIDE_FILE_BYTES = 64 << 20  # tokenizer files: Llama-3's tokenizer.json is 9 MB, Gemma-3's 33 MB
WEIGHTS_FILE = "adapter_model.safetensors"


class FileLimitError(ValueError):
    """An adapter file refused before it is read. `kind`: too_large | not_a_file | changed (the
    `SourceError` kinds)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def limit_for(name: str, max_bytes: int | None) -> int | None:
    """The most bytes file `name` may have; None: no size limit."""
    if max_bytes is None:
        return None
    if name == WEIGHTS_FILE:
        return max_bytes
    return min(max_bytes, MAX_CONFIG_BYTES if name == CONFIG_FILE else MAX_SIDE_FILE_BYTES)


def check_size(where: str, size: int, max_bytes: int | None, *, fix: str | None = None) -> None:
    """Raise FileLimitError when the file `where` (a path or an object URI, ending in the file's name)
    is over its limit at `size` bytes. `fix`: how to raise the limit, for the message."""
    name = where.rsplit("/", 1)[-1]
    limit = limit_for(name, max_bytes)
    if limit is None or size <= limit:
        return
    if name == CONFIG_FILE:
        what, todo = CONFIG_FILE, f"an {CONFIG_FILE} is a few KiB of JSON; check the file"
    elif name != WEIGHTS_FILE and limit < (max_bytes or 0):
        what, todo = f"a {name}", "the adapter's tokenizer and side files are a few MB at most; check the file"
    else:
        what, todo = "one adapter file", "check that it is the adapter's file"
        if fix:
            todo += f", or {fix}"
    raise FileLimitError(
        f"{where}: {_bytes(size)}, over the limit of {_bytes(limit)} for {what}; refused "
        f"before reading it ({todo})",
        "too_large",
    )


def check_file(file: Path, max_bytes: int | None, *, fix: str | None = None) -> int:
    """The size of `file` (symlinks followed), once it is known to be a regular file within its limit;
    stat only, nothing is opened. Raises FileLimitError, or OSError when it does not exist."""
    info = os.stat(file)
    _check(file, info, max_bytes, fix)
    return info.st_size


def read_chunks(
    file: Path, max_bytes: int | None, *, chunk_bytes: int | None = None, fix: str | None = None,
    opened: Callable[[Path, int], None] | None = None,
) -> Iterator[bytes]:
    """The bytes of `file` (in pieces of `chunk_bytes`; None: in one), checked as `check_file` before
    the first read. A file that grows past the size it had when opened is refused (kind `changed`).
    `opened(file, fd)` is called once it is open, before anything is read (it may raise): the bytes are
    those of the file it saw, whatever `file` names by then."""
    check_file(file, max_bytes, fix=fix)  # before open: a FIFO's open waits for a writer, a device's may act
    # O_NONBLOCK: a file swapped for a FIFO since the stat still opens at once; fstat then refuses it.
    with os.fdopen(os.open(file, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        if opened is not None:
            opened(file, f.fileno())
        info = os.fstat(f.fileno())
        _check(file, info, max_bytes, fix)
        left = info.st_size
        while left > 0 and (chunk := f.read(min(left, chunk_bytes or left))):
            left -= len(chunk)
            yield chunk
        if f.read(1):
            raise FileLimitError(
                f"{file}: grew beyond the {info.st_size} bytes it had when opened (still being "
                f"written?); retry once it is complete",
                "changed",
            )


def read_limited(file: Path, max_bytes: int | None, *, fix: str | None = None,
                 opened: Callable[[Path, int], None] | None = None) -> bytes:
    """All of `file`, read once, checked as `read_chunks` (`opened` as there)."""
    return b"".join(read_chunks(file, max_bytes, fix=fix, opened=opened))  # one piece: joined without a copy


def _check(file: Path, info: os.stat_result, max_bytes: int | None, fix: str | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise FileLimitError(
            f"{file}: not a regular file (a {_file_type(info.st_mode)}); an adapter file must be "
            f"a plain file, as a pipe or device could block the reader or never end",
            "not_a_file",
        )
    check_size(str(file), info.st_size, max_bytes, fix=fix)


def _file_type(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
    )
    return next((kind for test, kind in kinds if test(mode)), "special file")


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes ({n / (1 << shift):.1f} {unit})"
    return f"{n} bytes"
