"""Every error leaves the worker as an OpenAI-shaped body (`{"error": {...}}`): an APIError as it is,
aiohttp's own HTTP errors (no route, method, body too large) with a message saying what to do, anything
else as a logged 500 that shows no internals."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from lorafleet.worker.app_keys import CONFIG
from lorafleet.worker.openai_protocol import APIError

log = logging.getLogger("lorafleet.worker")


def _error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


_HTTP_ERRORS = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except APIError as err:
        resp = _error_response(err)
        if err.status == 408:  # the rest of its body may still come: this connection cannot carry another request
            resp.force_close()
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind, code = _HTTP_ERRORS.get(exc.status, ("invalid_request_error", "http_error"))
        message = exc.text or exc.reason
        if exc.status == 413:
            limit = request.app[CONFIG].max_body_bytes
            message = f"request body too large: the limit is {limit} bytes (--max-body-bytes)"
        elif exc.status == 404:
            message = f"no route {request.method} {request.path}; see /v1/completions, /v1/chat/completions"
        headers = None
        if exc.status == 405 and isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"{request.method} is not allowed on {request.path}; use {allowed}"
            headers = {"Allow": allowed}  # RFC 9110: a 405 names the methods the resource takes
        return _error_response(APIError(exc.status, message, type=kind, code=code, headers=headers))
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client went away (a body cut short): nobody to answer, nothing to log
        return web.Response(status=499, reason="Client Closed Request")
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(APIError(500, "internal server error; the worker logged the details",
                                        type="server_error", code="internal_error"))


class _ClientFaults(logging.Filter):
    """aiohttp answers a request its parser refuses (a malformed head, a Content-Encoding it cannot decode: br,
    zstd) with a plain 400, before any middleware, and logs it as an ERROR with a traceback: any client could
    fill the log so. Such a fault is logged as one line at INFO instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            log.info("%s: %d %s", record.getMessage(), exc.code, " ".join(str(exc.message).split()))
            return False
        return True


logging.getLogger("aiohttp.server").addFilter(_ClientFaults())
