"""aiohttp apps served on 127.0.0.1 at a free port for the operator's tests: fake sidecars, fake
metrics endpoints and stub APIs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


async def start_app(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on 127.0.0.1; returns its runner (``cleanup()`` stops it) and port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` served for the block; yields its base URL."""
    runner, port = await start_app(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
