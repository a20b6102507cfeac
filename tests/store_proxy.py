"""TCP proxies in front of the test's S3 server that make it a slow store: one whose answers pass on a
little at a time (a store on a congested link), too slowly for a download with a short timeout; one whose
answers for some objects wait until the test lets them go (a download in progress for as long as it needs).

    async with trickling_proxy(s3.port) as endpoint:   # "127.0.0.1:PORT", for the stager's s3_endpoint
        ...
    async with stalling_proxy(s3.port, "/adapters/team/big/", released) as endpoint:
        ...                                            # its objects' bytes come once `released` is set
    async with throttling_proxy(s3.port, "/adapters/team/a/", 2) as (endpoint, refused):
        ...                                            # its first 2 GETs answered 503 SlowDown
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")
Hook = Callable[[list[bool]], Awaitable[None]]


@contextlib.asynccontextmanager
async def _proxy(port: int, *, chunk: int, before: Hook | None = None, after: Hook | None = None,
                 held_path: bytes | None = None, answer: Callable[[bytes], bytes | None] | None = None):
    """A TCP proxy to 127.0.0.1:`port`: requests pass at once; each piece of an answer (`chunk` bytes at
    most) waits for `before(held)`, is passed on, then waits for `after(held)`; `held[0]` tells whether the
    connection's last request named `held_path` (one request at a time per connection, as S3 clients send).
    `answer(request line)`: an answer the proxy sends itself instead of passing a bodiless request on, or None."""
    conns: list[asyncio.StreamWriter] = []

    async def requests(src: asyncio.StreamReader, dst: asyncio.StreamWriter, held: list[bool],
                       client: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(1 << 16):
                if held_path is not None and data.startswith(_METHODS):  # a request line: whose object?
                    held[0] = held_path in data.split(b"\r\n", 1)[0]
                if answer is not None and data.startswith(_METHODS) and (
                        own := answer(data.split(b"\r\n", 1)[0])) is not None:
                    client.write(own)
                    await client.drain()
                    continue
                dst.write(data)
                await dst.drain()
        dst.close()

    async def answers(src: asyncio.StreamReader, dst: asyncio.StreamWriter, held: list[bool]) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(chunk):
                if before is not None:
                    await before(held)
                dst.write(data)
                await dst.drain()
                if after is not None:
                    await after(held)
        dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        conns.extend((writer, up_writer))
        held = [False]
        await asyncio.gather(requests(reader, up_writer, held, writer), answers(up_reader, writer, held))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for w in conns:
            w.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def trickling_proxy(port: int, *, chunk: int = 1024, every_s: float = 0.05):
    """A TCP proxy to 127.0.0.1:`port` that passes the store's answers on at `chunk` bytes per `every_s`
    (a store on a congested link); requests pass at full speed."""
    async def pace(held: list[bool]) -> None:
        await asyncio.sleep(every_s)

    async with _proxy(port, chunk=chunk, after=pace) as endpoint:
        yield endpoint


@contextlib.asynccontextmanager
async def stalling_proxy(port: int, path: str, released: asyncio.Event):
    """A TCP proxy to 127.0.0.1:`port` whose answers to requests for the objects under `path` (a path-style
    `/bucket/prefix/`) wait until `released` is set; every other answer passes at once."""
    async def stall(held: list[bool]) -> None:
        if held[0]:
            await released.wait()

    async with _proxy(port, chunk=1 << 16, before=stall, held_path=path.encode()) as endpoint:
        yield endpoint


@contextlib.asynccontextmanager
async def answering_proxy(port: int, path: str, times: int, status: bytes, content_type: bytes, body: bytes):
    """A TCP proxy to 127.0.0.1:`port` that answers the first `times` GETs of objects under `path` (path-style
    `/bucket/prefix/`) itself, with `status` (b"503 Slow Down") and `body`; yields (endpoint, the request
    lines it answered so)."""
    answered: list[bytes] = []

    def answer(line: bytes) -> bytes | None:
        if len(answered) >= times or not line.startswith(b"GET ") or path.encode() not in line:
            return None
        answered.append(line)
        return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body)

    async with _proxy(port, chunk=1 << 16, answer=answer) as endpoint:
        yield endpoint, answered


def throttling_proxy(port: int, path: str, times: int):
    """`answering_proxy` with S3's 503 SlowDown, as a throttled store answers."""
    return answering_proxy(port, path, times, b"503 Slow Down", b"application/xml",
                           b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please '
                           b'reduce your request rate.</Message></Error>')
