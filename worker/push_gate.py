"""The readiness gate on a first push, which the engine and its stager sidecar both keep (`--ready-after-push`,
`--ready-without-push-s`): a pod enters its Service only once its adapters are registered."""

from __future__ import annotations


def awaiting_push(gated: bool, pushed: bool, waited_s: float, limit_s: float | None) -> bool:
    """Whether readiness still waits: gated, nothing pushed yet, and the fallback (`limit_s`; None: none) not past."""
    return gated and not pushed and (limit_s is None or waited_s < limit_s)
