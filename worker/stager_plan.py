"""What a push forwards to the engine (worker/stager_push.py), from the copies staged so far: an adapter whose
stable version is not staged keeps what was forwarded for it (`keep_stable`)."""

from __future__ import annotations

from lorafleet.worker.directives import AdapterDirective, DesiredState, VersionRef
from lorafleet.worker.staged_copy import Staged

Key = tuple[str, str]  # (adapter name, version)


def version_refs(desired: DesiredState) -> list[tuple[str, VersionRef]]:
    """(name, ref) of every version of `desired`, in its order: the order a push stages them in."""
    return [(a.name, ref) for a in desired.adapters for ref in (a.stable, a.canary) if ref is not None]


def keep_stable(old: AdapterDirective, a: AdapterDirective, local: dict[str, VersionRef]) -> AdapterDirective:
    """What to forward for `a` when its stable version is not staged (it failed, or is not staged yet): the
    stable version forwarded until now, with the rest of this push, so that a push which also removes a bad
    canary or turns its weight to 0 (the kill switch) is not undone by a typo in its new stable version. The
    canary is this push's, if staged; warm, pinned and priority are this push's. A name that changed owner
    keeps what was forwarded, unchanged: its old weights must not go to the new owner."""
    if old.tenant != a.tenant:
        return old
    canary = local.get(a.canary.version) if a.canary is not None and a.canary.version != old.stable.version else None
    return AdapterDirective(a.name, a.tenant, old.stable, canary, a.canary_weight if canary else 0,
                            a.warm, a.pinned, a.priority)


def forwardable(desired: DesiredState, copies: dict[Key, Staged], old: dict[str, AdapterDirective],
                old_copies: dict[Key, Staged]) -> tuple[dict[str, AdapterDirective], dict[Key, Staged]]:
    """The directives (local paths) to forward for `desired` given the staged `copies` of its versions, and
    the copies they use. An adapter whose stable version has no copy keeps what `old` (forwarded until now,
    with `old_copies`) gave it, or is left out when it had nothing."""
    forwarded: dict[str, AdapterDirective] = {}
    staged: dict[Key, Staged] = {}
    for a in desired.adapters:
        local: dict[str, VersionRef] = {}
        for ref in (a.stable, a.canary):
            s = copies.get((a.name, ref.version)) if ref is not None else None
            if s is not None:
                staged[(a.name, ref.version)] = s
                local[ref.version] = VersionRef(ref.version, str(s.path), s.sha256)
        if a.stable.version in local:
            canary = local.get(a.canary.version) if a.canary is not None else None
            forwarded[a.name] = AdapterDirective(a.name, a.tenant, local[a.stable.version], canary,
                                                 a.canary_weight if canary else 0, a.warm, a.pinned, a.priority)
        elif a.name in old:  # keep serving the stable version already local
            forwarded[a.name] = kept = keep_stable(old[a.name], a, local)
            for v in kept.versions:
                if (a.name, v) in old_copies and (a.name, v) not in staged:
                    staged[(a.name, v)] = old_copies[(a.name, v)]
    return forwarded, staged
