"""The sidecar's watch over an engine that restarts while it runs (the engine container alone: an OOM, a failed
liveness probe).

The restarted engine holds nothing, and with `--ready-after-push` it stays out of its Service until a push is
applied. The operator would push only at its next pass that notices (the pod is not ready meanwhile, and its
sidecar, which delivered long ago, is no starting one), so the sidecar hands the engine what it last forwarded
itself, from its local copies, as soon as it sees the engine back with nothing applied.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from lorafleet.worker.stager_engine import refused_for_good

if TYPE_CHECKING:
    from lorafleet.worker.stager import Stager

log = logging.getLogger("lorafleet.stager")
WATCH_EVERY_S = 5.0  # how often the engine's applied generation is read (its report: all its adapters)
REFUSED_WAIT_S = 60.0


async def watch_engine(stager: Stager) -> None:
    """Until cancelled: every WATCH_EVERY_S, an engine this sidecar delivered to that reports nothing applied
    (generation 0: it restarted) is forwarded what it was last given (EngineLink.held: this sidecar's last
    forward, or what it found the engine holding at its own start), under the apply lock. A forward the engine
    refuses for good (a 4xx) is said in the log and tried again after REFUSED_WAIT_S only."""
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        if not stager.delivered or stager.engine.held() is None:
            continue
        try:
            _, data = await stager.engine.call("GET", "/admin/v1/state", timeout_s=5.0)
            if int((data or {}).get("generation_applied") or 0):
                continue
            async with stager.apply_lock:
                state = stager.engine.held()
                if state is None:
                    continue
                await stager.engine.forward(state)
            log.warning("the engine restarted holding nothing: forwarded its %d adapters again", len(state.adapters))
        except Exception as exc:  # starting (read again at the next tick), or refused
            if refused_for_good(exc):
                log.warning("the restarted engine refused its adapters again (%s): trying again in %.0f s", exc,
                            REFUSED_WAIT_S)
                await asyncio.sleep(REFUSED_WAIT_S)
