"""The readiness gate on a first push, which the engine and its stager sidecar both keep (`--ready-after-push`,
`--ready-without-push-s`): a pod enters its Service only once its adapters are registered."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

DELIVERED_MARK = ".delivered"  # in the sidecar's cache folder: the pod whose first push reached its engine


def awaiting_push(gated: bool, pushed: bool, waited_s: float, limit_s: float | None) -> bool:
    """Whether readiness still waits: gated, nothing pushed yet, and the fallback (`limit_s`; None: none) not past."""
    return gated and not pushed and (limit_s is None or waited_s < limit_s)


def _pod() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()


def mark_delivered(cache_root: Path) -> None:
    """Remember, for a sidecar restarted in this pod, that a whole push reached the engine (a file the cache
    ignores). Named by the pod: a cache kept on the node (hostPath) says nothing of the next pod's engine."""
    if delivered_here(cache_root):
        return
    with contextlib.suppress(OSError):  # not kept: a restarted sidecar waits for the next push
        partial = cache_root / f"{DELIVERED_MARK}.{os.getpid()}"  # renamed over an earlier pod's mark: never torn
        partial.write_text(_pod())
        partial.replace(cache_root / DELIVERED_MARK)


def delivered_here(cache_root: Path) -> bool:
    """Whether an earlier sidecar of this pod delivered a whole push (not merely forwarded part of its first)."""
    try:
        return (cache_root / DELIVERED_MARK).read_text() == _pod()
    except OSError:
        return False
