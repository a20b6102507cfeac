"""AsyncOpenAI clients for the tests, closed on the test's own event loop when it ends.

A client left open is freed later by the garbage collector; openai's client then schedules its own close on
whatever loop runs at that moment. When that is a later test's loop, the close unregisters the socket fd
number its connection once had, which the later test's server may have been given meanwhile: that server
stops accepting, and its client waited out the SDK's 600 s timeout (a hang seen late in full runs). So every
test client is made here, closed by `close_openai_clients` (an autouse fixture in the modules that use
them), and has a timeout well under the suite's."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

_OPEN: list[tuple[AsyncOpenAI, asyncio.AbstractEventLoop | None]] = []  # each with the loop it was made on
TIMEOUT_S = 120.0


def openai_client(base_url: str, api_key: str = "sk-any") -> AsyncOpenAI:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=TIMEOUT_S)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    _OPEN.append((client, loop))
    return client


@pytest.fixture(autouse=True)
async def close_openai_clients():
    yield
    running = asyncio.get_running_loop()
    while _OPEN:
        client, loop = _OPEN.pop()
        if loop is running:  # one of another loop, closed since, holds no socket of this loop's: let go
            await client.close()
