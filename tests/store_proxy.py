"""TCP proxies in front of the test's S3 server that make it a slow store: one whose answers pass on a
little at a time (a store on a congested link), too slowly for a download with a short timeout; one whose
answers for some objects wait until the test lets them go (a download in progress for as long as it needs).

    async with trickling_proxy(s3.port) as endpoint:   # "127.0.0.1:PORT", for the stager's s3_endpoint
        ...
    async with stalling_proxy(s3.port, "/adapters/team/big/", released) as endpoint:
        ...                                            # its objects' bytes come once `released` is set
    async with throttling_proxy(s3.port, "/adapters/team/a/", 2) as (endpoint, refused):
        ...                                            # its first 2 GETs answered 503 SlowDown
    async with corrupting_proxy(s3.port, "/adapters/team/a/w", times=1) as (endpoint, answers):
        ...                                            # one byte of the first answer's body flipped
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import Awaitable, Callable

_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")
Hook = Callable[[list[bool]], Awaitable[None]]
# change(head, at, part): what is sent for `part` of an answer: its head when `at` is -1, else its body's bytes
# from offset `at`; a body part returned shorter than it was is sent, and the connection cut after it.
Change = Callable[[bytes, int, bytes], bytes]


@contextlib.asynccontextmanager
async def _proxy(port: int, *, chunk: int, before: Hook | None = None, after: Hook | None = None,
                 held_path: bytes | None = None, answer: Callable[[bytes], bytes | None] | None = None,
                 change: Change | None = None):
    """A TCP proxy to 127.0.0.1:`port`: requests pass at once; each piece of an answer (`chunk` bytes at
    most) waits for `before(held)`, is passed on, then waits for `after(held)`; `held[0]` tells whether the
    connection's last request named `held_path` (one request at a time per connection, as S3 clients send).
    `answer(request line)`: an answer the proxy sends itself instead of passing a bodiless request on, or None.
    `change`: edits the answers to requests naming `held_path` (`_editor`)."""
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
        edit = _editor(change) if change is not None else None
        with contextlib.suppress(OSError):
            while data := await src.read(chunk):
                if before is not None:
                    await before(held)
                cut = False
                if edit is not None and held[0]:
                    data, cut = edit(data)
                dst.write(data)
                await dst.drain()
                if cut:
                    break
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
async def trickling_proxy(port: int, *, chunk: int = 1024, every_s: float = 0.05, path: str | None = None):
    """A TCP proxy to 127.0.0.1:`port` that passes the store's answers on at `chunk` bytes per `every_s`
    (a store on a congested link); requests pass at full speed. `path`: only the answers to requests naming it
    (the weights' object: the listing and the small files come at once, so the download is receiving by then)."""
    async def pace(held: list[bool]) -> None:
        if path is None or held[0]:
            await asyncio.sleep(every_s)

    async with _proxy(port, chunk=chunk, after=pace, held_path=None if path is None else path.encode()) as endpoint:
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
async def answering_proxy(port: int, path: str, times: int, status: bytes, content_type: bytes, body: bytes,
                          headers: bytes = b""):
    """A TCP proxy to 127.0.0.1:`port` that answers the first `times` GETs of objects under `path` (path-style
    `/bucket/prefix/`) itself, with `status` (b"503 Slow Down"), `headers` (each line ending in CRLF) and
    `body`; yields (endpoint, the request lines it answered so)."""
    answered: list[bytes] = []

    def answer(line: bytes) -> bytes | None:
        if len(answered) >= times or not line.startswith(b"GET ") or path.encode() not in line:
            return None
        answered.append(line)
        return (b"HTTP/1.1 " + status + b"\r\n" + headers + b"Content-Type: " + content_type + b"\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body)

    async with _proxy(port, chunk=1 << 16, answer=answer) as endpoint:
        yield endpoint, answered


def _editor(change: Change) -> Callable[[bytes], tuple[bytes, bool]]:
    """Edits one connection's answers: splits each into its head and body (by its Content-Length, which the
    store's object answers have; without one, the body runs to the connection's end) for `change`. Returns
    (the bytes to send, whether to cut the connection after them)."""
    head, pending, left, at = b"", b"", 0, 0

    def edit(data: bytes) -> tuple[bytes, bool]:
        nonlocal head, pending, left, at
        out = b""
        while data:
            if not left:  # a new answer's head, or the rest of one
                pending += data
                end = pending.find(b"\r\n\r\n")
                if end < 0:
                    return out, False
                head, data, pending = pending[:end + 4], pending[end + 4:], b""
                length = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
                left, at = int(length.group(1)) if length else sys.maxsize, 0
                out += change(head, -1, head)
                continue
            part, data = data[:left], data[left:]
            sent = change(head, at, part)
            left, at, out = left - len(part), at + len(part), out + sent
            if len(sent) < len(part):
                return out, True
        return out, False

    return edit


@contextlib.asynccontextmanager
async def corrupting_proxy(port: int, path: str, *, times: int | None = None, etag: str | None = None,
                           cut_at: int | None = None, same_byte: bool = False):
    """A TCP proxy to 127.0.0.1:`port` that alters the answers to GETs naming `path` (path-style `/bucket/key`,
    or the start of keys), keeping their length: one byte of the body flipped, at another offset in each
    answer, in the first `times` (None: every one); `etag`: each one's ETag header replaced by it (32 hex
    digits: as encrypted objects' ETags, no MD5 of their bytes); `cut_at`: the first answer's connection cut
    after that many bytes of its body; `same_byte`: the byte at offset 100 of every answer (altered the same way
    each time, as a faulty proxy or disk does). Yields (endpoint, the status lines of the answers it saw)."""
    answers: list[bytes] = []

    def change(head: bytes, at: int, part: bytes) -> bytes:
        n = len(answers) - 1  # of this answer
        if at == -1:
            answers.append(head.split(b"\r\n", 1)[0])
            return head if etag is None else re.sub(rb"\r\netag:[^\r]*", f'\r\nETag: "{etag}"'.encode(), head,
                                                   flags=re.IGNORECASE)
        if answers[-1].split(b" ")[1] not in (b"200", b"206"):
            return part
        if times is None or n < times:
            flip = 100 + (0 if same_byte else 37 * n) - at  # where in this part, if it is there
            if 0 <= flip < len(part):
                part = part[:flip] + bytes([part[flip] ^ 0xFF]) + part[flip + 1:]
        if cut_at is not None and n == 0 and at + len(part) > cut_at:
            return part[:max(0, cut_at - at)]
        return part

    async with _proxy(port, chunk=1 << 16, held_path=path.encode(), change=change) as endpoint:
        yield endpoint, answers


def throttling_proxy(port: int, path: str, times: int):
    """`answering_proxy` with S3's 503 SlowDown, as a throttled store answers."""
    return answering_proxy(port, path, times, b"503 Slow Down", b"application/xml",
                           b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please '
                           b'reduce your request rate.</Message></Error>')
