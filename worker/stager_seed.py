"""Seeding: the stager serves every adapter folder under `--stager-adapters` at start.

Each folder is its own adapter (name = folder name, version = digest prefix). A folder that cannot
be served (no safetensors, a name that is no adapter name, a digest that does not verify) is reported
in `GET /v1/state` and never holds the others back; one that failed for a reason that may pass (store
down or busy, timeout, the node's disk full, objects changing: an upload in progress, credentials the store
does not accept now: a token that expired, a node's clock off) is tried again with
backoff, and every retry pushes what is staged by then. The store's refusal (access denied), a folder without
its adapter files (a pickle-only one looks the same as one whose upload has not begun: a push names it again
once there), a digest that does not verify or files over the limit are reported and not tried again. A push
from elsewhere (`PUT /v1/directives`) ends the seed: from then on the directives rule.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorafleet.worker.directives import UNSTAGED, AdapterDirective, DesiredState, DirectiveError, VersionRef
from lorafleet.worker.staging_errors import staging_error
from lorafleet.worker.tenants import UNOWNED

if TYPE_CHECKING:
    from lorafleet.worker.stager import Stager

log = logging.getLogger("lorafleet.stager")
# Failures (staging_error codes) that may pass by themselves: the folder is tried again.
PASSING = ("object_store_unavailable", "download_timeout", "bytes_altered", "changed", "cache_disk_full", "cache_disk_error", "cache_limit",
           "stager_credentials",  # an expired token is renewed, a node's skewed clock set right
           "store_answer")  # a gateway's page: an auth proxy rotating its tokens, a maintenance redirect


@dataclass(slots=True)
class SeedReport:
    """What one seed pass could not serve, reported with the push it made."""

    uri: str
    errors: dict[str, str] = field(default_factory=dict)  # folder -> why it is not served
    adapter_errors: dict[tuple[str, str], str] = field(default_factory=dict)  # (name, UNSTAGED) -> error
    retrying: list[str] = field(default_factory=list)  # folders whose failure may pass: tried again
    began: float = field(default_factory=time.monotonic)  # the seed's first pass (readiness waits so long at most)

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "errors": dict(self.errors), "retrying": list(self.retrying),
                "seeding_s": round(time.monotonic() - self.began, 1)}


async def seed(stager: Stager, uri: str, began: float | None = None) -> SeedReport:
    """Stage the folders under `uri` the seed does not serve yet, then push every folder served; the
    report names the others. `began`: the seed's first pass (time.monotonic())."""
    report = SeedReport(uri) if began is None else SeedReport(uri, began=began)
    served = {a.stable.uri: a for a in stager.desired.adapters} if stager.seed_report is not None else {}
    push_start = time.monotonic()  # a store that fails one folder is not tried again for the others
    try:
        folders = await stager.store_threads.within(stager.store_threads.run(stager.sources.list_adapters, uri),
                                                    stager.config.download_timeout_s, f"{uri}: the listing")
    except Exception as exc:
        stager.store.failed(exc, push_start)
        raise
    stager.store.answered(push_start)
    for folder in folders:
        if folder in served:
            continue
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        try:
            AdapterDirective(name, UNOWNED, VersionRef(UNSTAGED, folder))  # a bad name: no download
            s = await stager.stage(folder, None, push_start=push_start)
        except DirectiveError as exc:
            report.errors[folder] = f"{folder}: not served: {exc} (rename the folder)"
        except Exception as exc:
            refusal = staging_error(exc, folder)
            report.errors[folder] = report.adapter_errors[(name, UNSTAGED)] = refusal.message
            if refusal.code in PASSING:
                report.retrying.append(folder)
        else:
            served[folder] = AdapterDirective(name, UNOWNED, VersionRef(s.sha256[:12], folder, s.sha256))
    for folder, message in report.errors.items():
        log.warning("seeding %s: %s", folder, message)
    await stager.apply(DesiredState(max(1, stager.generation + 1), list(served.values())), seed=report)
    return report


async def seed_until_done(stager: Stager, uri: str) -> None:
    """Seed, and again with backoff while a folder may still stage or the push did not reach the
    engine (it may still be starting), until a push from elsewhere takes over."""
    delay, began = 0.2, time.monotonic()
    while stager.desired is None or stager.seed_report is not None:
        try:
            report = await seed(stager, uri, began)
            if not report.retrying:
                log.info("serving the adapters under %s (%d folders not served)", uri, len(report.errors))
                return
            log.warning("staging %d adapters under %s failed (retrying)", len(report.retrying), uri)
        except Exception as exc:
            log.warning("staging the adapters under %s: %s (retrying)", uri, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)
