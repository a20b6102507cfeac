"""The sidecar's watch over an engine that restarts while it runs (the engine container alone: an OOM, a failed
liveness probe).

The restarted engine holds nothing, and with `--ready-after-push` it stays out of its Service until a push is
applied. The operator would push only at its next pass that notices (the pod is not ready meanwhile, and its
sidecar, which delivered long ago, is no starting one), so the sidecar hands the engine what it last forwarded
itself, from its local copies, as soon as it sees the engine back with nothing applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafleet.worker.stager import Stager

log = logging.getLogger("lorafleet.stager")
WATCH_EVERY_S = 2.0  # how often the engine's applied generation is read


async def watch_engine(stager: Stager) -> None:
    """Until cancelled: every WATCH_EVERY_S, an engine this sidecar delivered to that reports nothing applied
    (generation 0: it restarted) is forwarded what the sidecar last forwarded, under the apply lock."""
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        if not stager.delivered or not stager.engine.known or stager.desired is None:
            continue
        with contextlib.suppress(Exception):  # starting, or away: read again at the next tick
            _, data = await stager.engine.call("GET", "/admin/v1/state", timeout_s=5.0)
            if int((data or {}).get("generation_applied") or 0):
                continue
            async with stager.apply_lock:
                if stager.desired is None:
                    continue
                state = replace(stager.desired, adapters=list(stager.forwarded.values()))
                await stager.engine.forward(state)
            log.warning("the engine restarted holding nothing: forwarded push %d's %d adapters again",
                        state.generation, len(state.adapters))
