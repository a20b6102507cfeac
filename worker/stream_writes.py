"""written_in_time: a streamed answer's write, bounded by the client's progress rather than by its length.

aiohttp's `write` returns at once while the transport's buffer is below its high-water mark, and otherwise
waits until the client has taken enough bytes for the buffer to fall below the low-water mark: a client that
reads slowly keeps one write waiting for a while, one that stopped reading keeps it waiting for ever. So the
limit is on windows without progress: the write may take as long as it needs while each `limit_s` window sees
the buffer shrink; a window in which the client took no byte ends it. The buffer counts the kernel's send queue
too (Linux), which moves as TCP's window opens, in steps of tens of KiB: a client that takes less than that in a
whole window is taken for one that stopped (at the default 60 s, one reading under 1 KiB/s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Awaitable

from aiohttp import web

try:  # POSIX: the kernel's send queue of a socket (Linux; elsewhere the ioctl fails and counts nothing)
    import fcntl
    import termios
except ImportError:  # pragma: no cover
    fcntl = termios = None

log = logging.getLogger("lorafleet.worker")
LARGE_ANSWER_BYTES = 64 * 1024  # a whole answer larger than this is sent by `sent_in_time`


def _buffered(transport) -> int:
    """Bytes written and not yet taken by the client: the transport's buffer, and on Linux the kernel's send
    queue behind it (megabytes on a fast link: a client reading slowly drains that first, the transport's
    buffer only later, and would look as if it took nothing)."""
    if transport is None or transport.is_closing():
        return 0
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket") if hasattr(transport, "get_extra_info") else None
    if sock is not None and termios is not None and hasattr(termios, "TIOCOUTQ"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            size += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return size


async def written_in_time(write: Awaitable[None], transport, limit_s: float, queued: int = 0) -> bool:
    """Await `write` (its error raised); False, the write cancelled, once a `limit_s` window passed in which
    `transport`'s send buffer did not shrink (the client took no bytes). Awaited in the caller's own task,
    with a timer per window: a write that does not wait (almost all of them) costs one timer."""
    loop = asyncio.get_running_loop()
    size = _buffered(transport) + queued  # `queued`: the bytes the write puts in the buffer, once it runs
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


async def written_or_cut(write: Awaitable[None], request: web.Request, limit_s: float, request_id: str,
                         queued: int = 0) -> None:
    """`written_in_time`, else the connection cut as if the client had left (ConnectionResetError)."""
    if not await written_in_time(write, request.transport, limit_s, queued):
        log.warning("request %s: its client took no bytes for --stream-write-timeout-s %g s: cut off",
                    request_id, limit_s)
        if request.transport is not None:  # close() would wait to send what it never takes
            request.transport.abort()
        raise ConnectionResetError("the client stopped reading")


async def sent_in_time(request: web.Request, response: web.Response, limit_s: float,
                       request_id: str = "") -> web.StreamResponse:
    """A whole (not streamed) answer, sent under the same rule: aiohttp would write a large one and wait for a
    client that stopped reading for as long as the connection lives, its megabytes of logprobs held in the send
    buffer. A client that takes no byte for a `limit_s` window is cut off, as if it had left."""
    body = response.body
    if not isinstance(body, bytes) or len(body) <= LARGE_ANSWER_BYTES:
        return response
    stream = web.StreamResponse(status=response.status, headers=response.headers)
    stream.content_length = len(body)
    await stream.prepare(request)
    view = memoryview(body)
    # In pieces: each write's window starts from the buffer as it is, so a client that reads, however slowly,
    # is never taken for one that stopped (one write of the whole body would fill the buffer at once).
    for start in range(0, len(body), LARGE_ANSWER_BYTES):
        piece = view[start:start + LARGE_ANSWER_BYTES]
        await written_or_cut(stream.write(piece), request, limit_s, request_id, len(piece))
    await written_or_cut(stream.write_eof(), request, limit_s, request_id)
    return stream
