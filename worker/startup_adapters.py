"""Readiness while `--adapters s3://...` is staged. The stager child seeds the start-up adapters after the
engine is up and registers them through the worker's admin API; until that push is applied the worker
would answer 404 for adapters it is about to serve. So /readyz answers 503 `loading_adapters` until the
seed's push with no folder left to retry is applied here (or a push from elsewhere took over from the
seed). Folders that can never be served (a bad name, no safetensors) do not hold readiness back: each
is reported (the stager's /v1/state, GET /admin/v1/state) and the others are served. A child that exits is
started again (`keep_running`). (A local --adapters
folder is registered before the worker listens; a bad adapter there is logged and the others are served,
and only a folder where none loads stops the start: worker/adapter_dir.py.)

    stager /v1/state: no "seed" yet                         -> loading_adapters
                      seed {retrying: [beta], generation: 1} -> loading_adapters (beta is tried again)
                      seed {retrying: [], generation: 2}     -> ready once generation 2 is applied here
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

if TYPE_CHECKING:
    from lorafleet.worker.stager_client import StagerProcess

log = logging.getLogger("lorafleet.worker")

POLL_S = 0.25  # between two looks at the stager's state while loading
# How long folders whose staging failed for a reason that may pass (the store down at start) hold readiness: one
# that never stages (larger than the cache, a download that always times out) kept the worker unready for good.
RETRYING_READY_S = 120.0
_CALL_TIMEOUT_S = 10.0
_LISTING = "the stager child is listing and staging them"  # nothing pushed by the seed yet


@dataclass(slots=True)
class StartupAdapters:
    """What /readyz says about the start-up adapters under `uri`."""

    uri: str
    is_loaded: bool = False
    detail: str = _LISTING

    def answer(self) -> dict[str, str]:
        return {"status": "loading_adapters", "adapters": self.uri, "detail": self.detail}


STARTUP_ADAPTERS = web.AppKey("startup_adapters", StartupAdapters)


def seed_progress(state: dict[str, Any], generation_applied: int) -> str | None:
    """None once the start-up adapters are registered (or have failed for good, or stayed failing past
    RETRYING_READY_S: tried again all the same), else what is awaited.
    `state`: the stager's GET /v1/state; `generation_applied`: the generation this worker applied."""
    seed = state.get("seed")
    if seed is None:  # the seed has pushed nothing yet, or a push from elsewhere took over from it
        return None if generation_applied > 0 else _LISTING
    if (retrying := seed.get("retrying")) and seed.get("seeding_s", 0.0) < RETRYING_READY_S:
        return (f"{len(retrying)} folders failed for a reason that may pass and are tried again: "
                f"{', '.join(retrying)}; see the stager's log (ready without them after {RETRYING_READY_S:.0f} s)")
    if generation_applied < seed["generation"]:
        return "staged; registering them"
    return None


async def watch_seed(startup: StartupAdapters, *, url: str, token: str,
                     generation_applied: Callable[[], int]) -> None:
    """Poll the stager's state until `seed_progress` says the start-up adapters are loaded."""
    headers = {"Authorization": f"Bearer {token}"}
    async with ClientSession(timeout=ClientTimeout(total=_CALL_TIMEOUT_S), headers=headers) as http:
        while True:
            try:
                async with http.get(url.rstrip("/") + "/v1/state") as resp:
                    resp.raise_for_status()
                    state = await resp.json()
                detail = seed_progress(state, generation_applied())
            except (TimeoutError, ClientError, ValueError) as exc:  # it may be restarting: look again
                detail = f"the stager child did not answer: {exc!r}"
            if detail is None:
                startup.is_loaded = True
                log.info("the adapters under %s are registered: ready", startup.uri)
                return
            startup.detail = detail
            await asyncio.sleep(POLL_S)


RESTART_FIRST_S, RESTART_LAST_S = 1.0, 60.0  # a stager child that exited: started again after (doubling)


async def keep_running(stager: StagerProcess, poll_s: float = 1.0) -> None:
    """Start the stager child again whenever it exits, with a growing pause (reset once it ran RESTART_LAST_S): it
    stages the start-up adapters and tries failed folders again, and a worker whose child had died stayed not
    ready for good while its /healthz answered, so that nothing restarted it."""
    delay, started = RESTART_FIRST_S, time.monotonic()
    while True:
        await asyncio.sleep(poll_s)
        if stager.proc is not None and stager.proc.poll() is None:
            if time.monotonic() - started > RESTART_LAST_S:
                delay = RESTART_FIRST_S
            continue
        code = stager.proc.returncode if stager.proc is not None else None
        log.warning("the stager child exited (%s); starting it again in %.0f s; its log: %s", code, delay,
                    stager.log_path)
        await asyncio.sleep(delay)
        delay, started = min(2 * delay, RESTART_LAST_S), time.monotonic()
        try:
            await asyncio.to_thread(stager.start, 60.0)
        except Exception as exc:  # noqa: BLE001 - tried again after the next pause
            log.warning("starting the stager child again failed: %s", exc)

