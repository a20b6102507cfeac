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
_SCALARS = frozenset({str, int, float, bool, type(None)})
_STR = frozenset({str})
CHUNK_ITEMS = 8192  # items of a list or dict that json's C encoder takes in one call (a few ms, GIL held)


def dumps(obj: Any) -> str:
    """`json.dumps(obj)`, the same text, written a chunk a call (`_pieces`)."""
    return "".join(_pieces(obj))


def _pieces(obj: Any) -> list[str]:
    out: list[str] = []
    _write(obj, out)
    return out


def _write(obj: Any, out: list[str]) -> None:
    """Append the JSON of obj to out in pieces, a long list or dict CHUNK_ITEMS items a `json.dumps` call. The C
    encoder holds the GIL for its whole call: in a thread, one call over a /tokenize answer of millions of
    tokens and strings still stalled the event loop for a third of a second; between calls other threads run
    (and the pieces are joined once, at the end, not copied into ever longer strings)."""
    if isinstance(obj, list) and (len(obj) > CHUNK_ITEMS or _nested(obj)):
        brackets, chunks = "[]", (obj[i:i + CHUNK_ITEMS] for i in range(0, len(obj), CHUNK_ITEMS))
    elif isinstance(obj, dict) and _STR.issuperset(map(type, obj)) and (len(obj) > CHUNK_ITEMS
                                                                           or _nested(obj.values())):
        items = list(obj.items())
        brackets, chunks = "{}", (dict(items[i:i + CHUNK_ITEMS]) for i in range(0, len(items), CHUNK_ITEMS))
    else:
        out.append(json.dumps(obj))
        return
    out.append(brackets[0])
    for i, chunk in enumerate(chunks):
        _items(chunk, out, ", " if i else "")
    out.append(brackets[1])


def _items(chunk: list | dict, out: list[str], sep: str) -> None:
    """Append sep, then a non-empty chunk's items without its brackets."""
    out.append(sep)
    if not _nested(chunk if isinstance(chunk, list) else chunk.values()):
        out.append(json.dumps(chunk)[1:-1])
        return
    for j, item in enumerate(chunk.items() if isinstance(chunk, dict) else chunk):
        if j:
            out.append(", ")
        if isinstance(chunk, dict):
            out.append(f"{json.dumps(item[0])}: ")
            item = item[1]
        _write(item, out)


def _nested(values: Any) -> bool:
    """Whether a value among these is itself a list or dict of more than CHUNK_ITEMS items."""
    if _SCALARS.issuperset(map(type, values)):  # the common case, checked without a Python step per value
        return False
    return any(isinstance(v, (list, dict)) and len(v) > CHUNK_ITEMS for v in values)


async def encode(build: Callable[[], Any]) -> bytes:
    """The JSON of `build()`, both run in the default executor. `build` must read only what the event loop
    does not change meanwhile (a report made for this answer, a message already parsed)."""
    return await asyncio.to_thread(lambda: b"".join(piece.encode() for piece in _pieces(build())))


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
