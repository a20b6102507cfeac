"""Desired states and state reports as JSON, encoded and decoded off the event loop.

A pool's whole set travels in one push (up to MAX_STATE_BYTES, about 150,000 adapters), and each report
answers for all of it: tens of megabytes whose encoding or parsing takes seconds. On the event loop, those
seconds would stall every request, stream and health check of the process meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")
SMALL_JSON_BYTES = 64 * 1024  # a body at most this large is decoded on the loop (a thread hop costs more)


async def encode(build: Callable[[], Any]) -> bytes:
    """The JSON of `build()`, both run in the default executor. `build` must read only what the event loop
    does not change meanwhile (a report made for this answer, a message already parsed)."""
    return await asyncio.to_thread(lambda: json.dumps(build()).encode())


class NotJSON(ValueError):
    """A body that does not parse as JSON (or nests deeper than the parser's stack)."""


async def decode(raw: bytes, then: Callable[[Any], T]) -> T:
    """`then(the JSON of raw)`: in the default executor for a body over SMALL_JSON_BYTES. A body that is not
    JSON raises NotJSON; what `then` raises goes through."""
    def parse() -> T:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise NotJSON(str(exc)) from None
        return then(data)

    return parse() if len(raw) <= SMALL_JSON_BYTES else await asyncio.to_thread(parse)


async def reply(build: Callable[[], Any], status: int = 200) -> web.Response:
    """A JSON response of `build()`, encoded off the loop (see `encode`)."""
    return web.Response(body=await encode(build), status=status, content_type="application/json")
