"""CORS, for browser clients calling the API from another origin (vLLM's --allowed-origins): off unless
--allowed-origins lists origins. Keys travel in the Authorization header, never in cookies, so no
credentials are allowed: a page can call the API only with a key it holds itself.

A preflight (OPTIONS with Access-Control-Request-Method) of a route is answered 204 before any key is
asked for, with the allow headers when its Origin is listed; every response to a listed origin
(errors, aiohttp's own refusals among them, and streams, whose headers go out before their first event; not
a 400 aiohttp answers for a request it cannot parse at all: see `allow_origins`) names it, and exposes the
headers clients read (which adapter version answered, when to retry)."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

ANY = "*"
_ORIGIN = re.compile(r"https?://[^/?#@\s]+", re.IGNORECASE)  # scheme://host[:port], as a browser sends it
_EXPOSED = "X-Lorafleet-Adapter, Retry-After, X-Should-Retry"  # x-should-retry: a 504 past --request-timeout-s
_MAX_AGE_S = "600"


def parse_origins(value: str | None) -> frozenset[str]:
    """The origins of a comma-separated list, or of a JSON list as vLLM's flag takes ('*': any); ValueError
    naming one that is no origin."""
    listed: Any = (value or "").split(",")
    if (value or "").lstrip().startswith("["):
        try:
            listed = json.loads(value)
        except ValueError:
            listed = None
        if not isinstance(listed, list) or not all(isinstance(o, str) for o in listed):
            raise ValueError(f"allowed_origins: {value!r} is not a JSON list of origins")
    origins = frozenset(o.strip().rstrip("/").lower() for o in listed if o.strip())
    for origin in sorted(origins - {ANY}):
        if not _ORIGIN.fullmatch(origin):
            raise ValueError(f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], or * for "
                             f"any)")
    return origins


def allow_origins(app: web.Application, origins: frozenset[str]) -> None:
    """Answer preflights and name the caller's origin on every response, for `origins` (none: nothing)."""
    if not origins:
        return

    def allowed(request: web.BaseRequest) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None or not (ANY in origins or origin.lower() in origins):
            return None
        return ANY if ANY in origins else origin

    @web.middleware
    async def preflight(request: web.Request, handler):
        no_route = isinstance(request.match_info.http_exception, web.HTTPNotFound)  # its 404 answers
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers or no_route:
            return await handler(request)
        origin = allowed(request)
        if origin is None:  # no allow headers: the browser refuses the call
            return web.Response(status=204)
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, PUT, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                "Authorization, Content-Type"),
            "Access-Control-Max-Age": _MAX_AGE_S, "Vary": "Origin"})

    async def name_origin(request: web.BaseRequest, response: web.StreamResponse) -> None:
        origin = allowed(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = _EXPOSED
        if ANY not in origins and "Origin" not in response.headers.getall("Vary", ()):
            response.headers.add("Vary", "Origin")  # the answer depends on the caller's origin

    app.middlewares.insert(0, preflight)
    # The signal reaches every response prepared for a request routed to this app, aiohttp's refusals made
    # there too: a body over client_max_size (--max-body-bytes: 413, raised by request.read() in the handler,
    # under error_middleware), no route or method (404, 405), an Expect it does not know (417, before the
    # middlewares). Not the 400 of aiohttp's HTTP protocol (web_protocol.RequestHandler.handle_error) for a
    # request line or header (one over 8190 bytes too) that its parser refuses, or a chunk size that arrives
    # with them: that answer is made for a placeholder request, never routed, so no middleware and no signal
    # of this app runs, and the caller's Origin was never parsed, so there is no origin to name. Only a
    # request handler class of our own in place of aiohttp's could add a header there, and then only `*`.
    app.on_response_prepare.append(name_origin)
