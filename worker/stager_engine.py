"""EngineLink: the stager's side of its engine's admin API (`PUT` and `GET /admin/v1/state`).

A push may reach the engine twice (worker/stager_push.py): at once with what needs no download, then once its
downloads are in. The engine applies a generation once (the same one again is a no-op), so the stager numbers
what it forwards itself, `max(push generation, last forwarded + 1)`, and reports the push generation each one
carries out as `generation_applied`: the operator compares it with what it pushed.

Running example: push 7 {sql: v2 (downloading), chat: canary at 0 %} is forwarded as 7 with sql still at v1,
then as 8 with sql at v2; the engine reports 8, the stager 7. Push 8 next is forwarded as 9, reported as 8.
An engine generation this stager did not forward (the engine restarted: 0; the stager restarted, the engine
keeping what the one before forwarded, maybe only a push's first step), or one whose push then failed to reach
the engine, is reported as 0: not applied, and the operator pushes again. A forward's generation is noted before
it is sent: a report read while the engine has applied it and not answered yet says it is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

from aiohttp import ClientConnectorError, ClientSession, ClientTimeout

from lorafleet.worker.directives import DesiredState, ReportedState
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.state_json import decode, encode

MAX_KEPT = 16  # engine generations whose push generation is remembered (the engine reports its latest)


class EngineStarting(APIError):
    """The engine cannot take a call yet: its model is loading (its admin API answers 503 `not_ready`), or its
    process does not listen yet. A push waits for it (stager_push.py)."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message, type="server_error", code="engine_starting")


def refused_for_good(exc: BaseException) -> bool:
    """Whether the engine refused a call in a way asking again does not change (a 4xx such as a wrong admin token;
    not a 409 or 429), as opposed to starting, away, or an error that may pass."""
    status = getattr(exc, "engine_status", None)
    return status is not None and 400 <= status < 500 and status not in (409, 429)


class EngineLink:
    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.generation = 0  # of the last forward the engine took (0: none since the stager started)
        self._content: DesiredState | None = None  # what it carried (under generation 0)
        self.known = False  # what the engine holds: forwarded by this stager, or adopted from the engine (adopt)
        self._pushes: dict[int, int] = {}  # engine generation -> the push generation it carries out

    async def call(self, method: str, path: str, body: DesiredState | None = None, *,
                   timeout_s: float = 120.0) -> tuple[int, dict]:
        """The engine's status and JSON answer; `body` sent as JSON. Both are encoded and decoded off the event
        loop when large (state_json.py). Raises `EngineStarting` while the engine's model loads (503 `not_ready`)
        or nothing listens on its port yet."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        data = None
        if body is not None:
            data = await encode(body.to_dict)
            headers["Content-Type"] = "application/json"
        try:
            async with ClientSession(timeout=ClientTimeout(total=timeout_s)) as session, session.request(
                    method, self.url + path, data=data, headers=headers) as resp:
                data = await decode(await resp.read(), lambda answer: answer)
        except ClientConnectorError as exc:
            if isinstance(exc, TimeoutError):  # a connect that timed out: not a process still starting
                raise
            raise EngineStarting(f"engine not listening yet ({exc})") from None
        if resp.status >= 400 and resp.status != 409:
            error = (data or {}).get("error", {}) if isinstance(data, dict) else {}
            message = error.get("message", str(data)[:200]) if isinstance(error, dict) else str(data)[:200]
            if resp.status == 503 and isinstance(error, dict) and error.get("code") == "not_ready":
                raise EngineStarting(f"engine starting: {message}")
            refused = APIError(502, f"engine refused {method} {path}: {resp.status} {message}", type="server_error",
                               code="engine_error")
            refused.engine_status = resp.status  # a 4xx: a refusal that asking again does not change
            raise refused
        return resp.status, data

    async def wait_started(self, stop: asyncio.Event, limit_s: float, poll_s: float = 0.5) -> bool:
        """Poll the engine until it answers as a started engine does (`EngineStarting` otherwise). False: `stop`
        was set or `limit_s` passed first (the forward that follows then fails with the engine's own answer)."""
        deadline = time.monotonic() + limit_s
        while True:
            try:
                await self.call("GET", "/admin/v1/state", timeout_s=5.0)
                return True
            except EngineStarting:
                pass
            except Exception:  # hung or refusing: not starting, and the forward meets the same
                return True
            remaining = deadline - time.monotonic()
            if stop.is_set() or remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(poll_s, remaining))

    def holds(self, state: DesiredState) -> bool:
        """Whether the engine holds `state` (its generation aside): the last forward it took, or what it was
        found to hold (`adopt`)."""
        return self.known and self._content == replace(state, generation=0)

    def held(self) -> DesiredState | None:
        """What the engine was last given (forwarded, or found to hold at the start: adopted) under the push
        generation it carries out (0 when not known), or None when that is not known."""
        if not self.known or self._content is None:
            return None
        return replace(self._content, generation=self._pushes.get(self.generation, 0))

    def carries(self, push_generation: int) -> None:
        """What the engine holds is what push `push_generation` asks for now: reported as applied. (Under the
        engine's generation 0, until a forward: an engine found to hold nothing, asked for nothing yet.)"""
        if self.known:
            self._note(self.generation, push_generation)

    async def forward(self, state: DesiredState) -> None:
        """Send `state` (local paths) under an engine generation it has not applied; reported as `state`'s."""
        if not self.known:  # not adopted (an engine without the route, a failed look-up): a generation it applied
            # already would be answered 200 and ignored, so this one is numbered above what it reports
            _, data = await self.call("GET", "/admin/v1/state")
            self.generation = max(self.generation, int((data or {}).get("generation_applied") or 0))
        generation = max(state.generation, self.generation + 1)
        try:
            self._note(generation, state.generation)  # before the engine applies it: a report may come first
            status, data = await self.call("PUT", "/admin/v1/state", replace(state, generation=generation))
            if status == 409:  # it applied a higher one (forwarded before this stager started): go above it
                self._pushes.pop(generation, None)
                generation = max(generation, int((data or {}).get("generation_applied") or 0)) + 1
                self._note(generation, state.generation)
                status, data = await self.call("PUT", "/admin/v1/state", replace(state, generation=generation))
            if status == 409:
                raise APIError(502, f"engine refused generation {generation}: {(data or {}).get('error')}",
                               type="server_error", code="engine_error")
        except BaseException:
            # What it holds is not this push: reported as not applied, so that the operator pushes again.
            self._pushes = {g: p for g, p in self._pushes.items() if p != state.generation}
            raise
        self.generation, self._content = generation, replace(state, generation=0)
        self.known = True
        self._pushes.pop(0, None)  # from now on, an engine reporting 0 has restarted: it holds nothing of this

    async def adopt(self) -> DesiredState | None:
        """What the engine holds, when it can be known without a forward: the push an earlier stager sent it (a
        stager restarted beside a running engine), or nothing (a new pod's engine, which serves nothing yet).
        From then on the engine is taken to hold it, as if this stager had forwarded it. None: not known (it
        serves what no push gave it, start-up `--adapters` or a vLLM load; or it cannot tell: an older engine)."""
        status, data = await self.call("GET", "/admin/v1/directives")
        if status != 200 or not isinstance(data, dict):
            return None
        # Numbered above it in any case: the same generation again would be answered 200 and ignored (an earlier
        # stager may have forwarded this push's number with other content: its first step, say).
        self.generation = max(self.generation, int(data.get("generation_applied") or 0))
        served, pushed = set(data.get("served") or ()), data.get("directives")
        state = await asyncio.to_thread(DesiredState.from_dict, pushed) if pushed is not None else DesiredState(0)
        refs = [ref for a in state.adapters for ref in (a.stable, a.canary) if ref is not None]
        if not served <= set(state.by_name()) or not all(r.sha256 and r.uri.startswith("/") for r in refs):
            return None  # what a stager forwards is a local path and its digest: this came from elsewhere
        self._content, self.known = replace(state, generation=0), True  # held under the generation it applied
        return state

    async def report(self) -> ReportedState:
        """The engine's report, its `generation_applied` as the push generation it carries out."""
        report = await asyncio.to_thread(ReportedState.from_dict, (await self.call("GET", "/admin/v1/state"))[1])
        # Always mapped: an engine generation this stager did not forward may carry only a push's first step.
        report.generation_applied = self._pushes.get(report.generation_applied, 0)
        return report

    def _note(self, generation: int, push_generation: int) -> None:
        self._pushes[generation] = push_generation
        for old in sorted(self._pushes)[:-MAX_KEPT]:
            del self._pushes[old]
