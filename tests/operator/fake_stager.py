"""A stager sidecar double that speaks the real HTTP contract on 127.0.0.1 (no engine behind it).

It applies ``DesiredState`` pushes the way the contract says (bearer token, generation rules) and
reports a ``ReportedState``: registered versions at tier ``disk``, warm ones (a canary too) at ``gpu``. A stable version
in ``unavailable`` (name, version) when a push is applied fails to stage, like a real stager's: reported
at tier ``none`` with an error until a later push (a new generation) stages it again.
``restart()`` forgets everything, like a pod whose containers came back empty. ``stall``, while an unset
event: a push is applied but its reply waits for the event (a reply lost, or later than the client waits).
``stall_reads``, while an unset event: a state read waits for it (a sidecar slow to answer).
``mute``: every request is answered 503 and nothing is applied (a sidecar that does not answer sensibly).
``reads`` counts the state reads it was sent (one per pass of a pool that reaches it).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from lorafleet.worker.directives import AdapterState, DesiredState, DirectiveError, ReportedState

from .local_http import start_app

ADAPTER_BYTES = 4096


class FakeStager:
    def __init__(self, token: str, also_accept: tuple[str, ...] = ()) -> None:
        self.tokens_accepted = (token, *also_accept)
        self.tokens: list[str] = []  # the token of every accepted push, in order
        self.applied: DesiredState | None = None
        self.pushes: list[DesiredState] = []  # accepted, in order
        self.refused = 0  # stale generations answered with 409
        self.unavailable: set[tuple[str, str]] = set()  # (name, version) the object store cannot deliver now
        self.failed: set[tuple[str, str]] = set()  # failed when the applied push was staged
        self.stall: asyncio.Event | None = None
        self.stall_reads: asyncio.Event | None = None
        self.mute = False
        self.reads = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    def restart(self) -> None:
        self.applied = None
        self.failed = set()

    def state(self) -> ReportedState:
        states = []
        for d in self.applied.adapters if self.applied else []:
            if (d.name, d.stable.version) in self.failed:
                states.append(AdapterState(d.name, d.stable.version, "none", error="NoSuchKey: store unreachable"))
            else:
                states.append(AdapterState(d.name, d.stable.version, "gpu" if d.warm else "disk",
                                           bytes=ADAPTER_BYTES, pinned=d.pinned))
            if d.canary:  # prefetched beside the stable version by a warm worker
                states.append(AdapterState(d.name, d.canary.version, "gpu" if d.warm else "disk", bytes=ADAPTER_BYTES))
        return ReportedState(generation_applied=self.applied.generation if self.applied else 0, adapters=states,
                             pool_bytes=1 << 20, kv_usage=0.1)

    def _authorized(self, request: web.Request) -> bool:
        if self.mute:
            raise web.HTTPServiceUnavailable(text="muted")
        return request.headers.get("Authorization", "").removeprefix("Bearer ") in self.tokens_accepted

    async def _put(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad token", "type": "auth", "code": 401}}, status=401)
        try:
            desired = DesiredState.from_json(await request.read())
        except DirectiveError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "invalid", "code": 400}}, status=400)
        current = self.applied.generation if self.applied else 0
        if desired.generation < current:
            self.refused += 1
            return web.json_response(self.state().to_dict(), status=409)
        if desired.generation > current or self.applied is None:
            self.pushes.append(desired)
            self.tokens.append(request.headers["Authorization"].removeprefix("Bearer "))
            self.applied = desired
            self.failed = {(d.name, d.stable.version) for d in desired.adapters} & self.unavailable
        if self.stall is not None:
            await self.stall.wait()
        return web.json_response(self.state().to_dict())

    async def _get(self, request: web.Request) -> web.Response:
        self.reads += 1
        if self.stall_reads is not None:
            await self.stall_reads.wait()
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad token", "type": "auth", "code": 401}}, status=401)
        return web.json_response(self.state().to_dict())

    async def start(self) -> None:
        app = web.Application()
        app.router.add_put("/v1/directives", self._put)
        app.router.add_get("/v1/state", self._get)
        self.runner, self.port = await start_app(app)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def __aenter__(self) -> FakeStager:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
