"""A TCP proxy in front of the test's S3 server that makes it a slow store: its answers pass on a
little at a time (a store on a congested link), too slowly for a download with a short timeout.

    async with trickling_proxy(s3.port) as endpoint:   # "127.0.0.1:PORT", for the stager's s3_endpoint
        ...
"""

from __future__ import annotations

import asyncio
import contextlib


@contextlib.asynccontextmanager
async def trickling_proxy(port: int, *, chunk: int = 1024, every_s: float = 0.05):
    """A TCP proxy to 127.0.0.1:`port` that passes the store's answers on at `chunk` bytes per `every_s`
    (a store on a congested link); requests pass at full speed."""
    conns: list[asyncio.StreamWriter] = []

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(chunk if slow else 1 << 16):
                dst.write(data)
                await dst.drain()
                if slow:
                    await asyncio.sleep(every_s)
        dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        conns.extend((writer, up_writer))
        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for w in conns:
            w.close()
        await server.wait_closed()
