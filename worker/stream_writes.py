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
    `transport`'s send buffer did not shrink (the client took no bytes). Awaited in the caller's own task,
    with a timer per window: a write that does not wait (almost all of them) costs one timer."""
    loop = asyncio.get_running_loop()
    size = _buffered(transport)
    try:
        async with asyncio.timeout(None) as deadline:

            def window_ends() -> None:
                nonlocal size, timer
                if (now := _buffered(transport)) < size:  # the client took bytes: another window
                    size, timer = now, loop.call_later(limit_s, window_ends)
                else:
                    deadline.reschedule(loop.time())  # the write is cancelled, as TimeoutError here

            timer = loop.call_later(limit_s, window_ends)
            try:
                await write
            finally:
                timer.cancel()
    except TimeoutError:
        return False
    return True
