"""written_in_time: a streamed answer's write, bounded by the client's progress rather than by its length.

aiohttp's `write` returns at once while the transport's buffer is below its high-water mark, and otherwise
waits until the client has taken enough bytes for the buffer to fall below the low-water mark: a client that
reads slowly keeps one write waiting for a while, one that stopped reading keeps it waiting for ever. So the
limit is on windows without progress: the write may take as long as it needs while each `limit_s` window sees
the buffer shrink; a window in which the client took no byte ends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


def _buffered(transport) -> int:
    return 0 if transport is None or transport.is_closing() else transport.get_write_buffer_size()


async def written_in_time(write: Awaitable[None], transport, limit_s: float) -> bool:
    """Await `write` (its error raised); False, the write cancelled, once a `limit_s` window passed in which
    `transport`'s send buffer did not shrink (the client took no bytes)."""
    task = asyncio.ensure_future(write)
    size = _buffered(transport)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=limit_s)
            if done:
                task.result()
                return True
            now = _buffered(transport)
            if now >= size:
                task.cancel()
                return False
            size = now
    except asyncio.CancelledError:
        task.cancel()
        raise
