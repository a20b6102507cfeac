"""An engine admin API stand-in for the stager's tests: what it was pushed, reported back at tier cpu."""

from __future__ import annotations

import asyncio

from aiohttp import web

HANG_S = 30.0  # a hang detector, not a measurement


class EngineAdminStub:
    """`PUT` and `GET /admin/v1/state`: takes every push and reports the last one; subclasses change what a push
    does (`put_state`) and which generation the report names (`applied_generation`). `GET /admin/v1/directives`
    answers the last push, as the engine does, or, with `unpushed` names, that it serves what no push gave it
    (start-up adapters: a stager cannot know what it holds)."""

    def __init__(self) -> None:
        self.pushes: list[dict] = []
        self.unpushed: list[str] = []

    def applied_generation(self) -> int:
        return self.pushes[-1]["generation"] if self.pushes else 0

    def report(self) -> dict:
        last = self.pushes[-1] if self.pushes else {"adapters": []}
        return {"generation_applied": self.applied_generation(), "adapters": [
            {"name": a["name"], "version": ref["version"], "tier": "cpu"}
            for a in last["adapters"] for ref in (a["stable"], a["canary"]) if ref is not None]}

    async def put_state(self, request: web.Request) -> web.Response:
        """Take every push (subclasses refuse some, or hold their answers)."""
        self.pushes.append(await request.json())
        return web.json_response(self.report())

    async def get_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.report())

    async def get_directives(self, request: web.Request) -> web.Response:
        last = self.pushes[-1] if self.pushes and not self.unpushed else None
        served = [a["name"] for a in last["adapters"]] if last else self.unpushed
        return web.json_response({"generation_applied": self.applied_generation(), "directives": last, "served": served})

    async def serve(self, aiohttp_server) -> str:
        app = web.Application()
        app.add_routes([web.put("/admin/v1/state", self.put_state), web.get("/admin/v1/state", self.get_state),
                        web.get("/admin/v1/directives", self.get_directives)])
        return str((await aiohttp_server(app)).make_url(""))


def split(push: dict, name: str) -> tuple[str, str | None, int]:
    """(stable version, canary version, canary weight) of adapter `name` in an engine push."""
    a = next(a for a in push["adapters"] if a["name"] == name)
    return a["stable"]["version"], (a["canary"] or {}).get("version"), a["canary_weight"]


async def until(condition) -> None:
    """Poll `condition` until it holds; HANG_S bounds the wait (a hang detector, not a measurement)."""
    async with asyncio.timeout(HANG_S):
        while not condition():
            await asyncio.sleep(0.01)
