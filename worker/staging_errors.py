"""The refusal a failed stage of an adapter answers with (the stager's API and its reports)."""

from __future__ import annotations

import asyncio
import errno

from lorafleet.worker.disk_cache import CacheDiskError, CacheLimitError
from lorafleet.worker.object_digest import BytesAltered
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.source_error import BodyCut
from lorafleet.worker.sources import SourceError

_STATUS = {"not_allowed": 403, "bad_uri": 400, "missing": 404, "digest_mismatch": 422, "too_large": 413,
           "not_a_file": 422,  # a FIFO or device where an adapter file should be
           "changed": 409,  # the objects kept changing while downloaded (an upload in progress)
           # A local file the stager may not read, a symlink loop, another read error: the source's to fix.
           "permission_denied": 403, "symlink_loop": 422, "unreadable": 422}
READ_ERROR_KINDS = ("permission_denied", "symlink_loop", "unreadable")  # worker/source_error.py
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # writing the node's disk cache, never an object store's answer
# The store's answer about the object: it may not be read (a withdrawal, a bucket policy).
_REFUSED = ("AccessDenied", "AllAccessDisabled")
# About the stager's own key, token, account or clock: the node's to fix, for every adapter alike.
_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccountProblem", "ExpiredToken", "InvalidToken",
                "TokenRefreshRequired", "RequestTimeTooSkewed")


_BUSY = ("RequestTimeout", "SlowDown", "TooManyRequests")  # answers of a store that cannot serve now


def _s3_answer(exc: BaseException) -> tuple[str, int | None] | None:
    """(code, HTTP status) of an S3 error answer; None for any other failure. An answer that is not S3's XML
    (a proxy's or gateway's page: minio's InvalidResponseError, or ServerError without a body) has code ""."""
    name = type(exc).__name__
    if name == "S3Error":
        status = getattr(getattr(exc, "response", None), "status", None)
    elif name == "InvalidResponseError":
        status = getattr(exc, "_code", None)
    elif name == "ServerError":
        status = getattr(exc, "status_code", None)
    else:
        return None
    return (getattr(exc, "code", "") or "") if name == "S3Error" else "", status if isinstance(status, int) else None


def is_refusal(exc: BaseException) -> bool:
    """The store answered that this object may not be read, or does not exist (403, 404): an answer, never
    papered over with a cached copy. Its other answers (busy, throttling, a request timeout, restarting) and
    the stager's own credential problems are not."""
    answer = _s3_answer(exc)
    if answer is None or answer[0] in _CREDENTIALS:
        return False
    return answer[0] in (*_REFUSED, "NoSuchBucket", "NoSuchKey") or answer[1] in (403, 404)


def is_busy(exc: BaseException) -> bool:
    """An S3 answer that the store cannot serve now (5xx, throttling, a request timeout): it counts as down."""
    answer = _s3_answer(exc)
    return answer is not None and (answer[0] in _BUSY or (answer[1] is not None and (answer[1] >= 500
                                                                                     or answer[1] == 429)))


def is_object_fault(exc: BaseException) -> bool:
    """A failure that may be one object's own although it reads as an outage: the store's 5xx answer other
    than one asking clients to back off (503, throttling), or a body cut short (a reset, or one that ended
    cleanly short of its size: BodyCut). Never a stall or a timeout,
    which speak for the whole read path (a store whose listings answer while its data servers are down)."""
    answer = _s3_answer(exc)
    if answer is not None:
        return answer[1] is not None and answer[1] >= 500 and answer[1] != 503 and answer[0] not in _BUSY
    return isinstance(exc, BodyCut) or type(exc).__name__ in ("ProtocolError", "IncompleteRead")


def source_status(kind: str) -> int:
    """The HTTP status a SourceError of `kind` is answered with."""
    return _STATUS.get(kind, 400)


def staging_error(exc: Exception, uri: str) -> APIError:
    """The refusal a failed stage of `uri` answers with (its message is what reports show)."""
    if isinstance(exc, SourceError):
        return APIError(source_status(exc.kind), str(exc), code=exc.kind)
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        said = str(exc)  # a local folder's read says which, and why
        return APIError(504, said if said.startswith(uri) and uri else f"{uri}: download timed out",
                        type="server_error", code="download_timeout")
    if isinstance(exc, CacheLimitError):
        return APIError(507, f"{uri}: the adapter cache cannot take it: {exc.strerror}; raise the cache volume's size "
                             f"and --stager-cache-limit-bytes (the chart's worker.adapterCache sizeLimit and "
                             f"limitBytes), or serve fewer adapters per pool", type="server_error", code="cache_limit")
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return APIError(507, f"{uri}: the node's adapter disk cache is full ({exc.strerror}, writing "
                             f"{exc.filename or 'the cache'}); give the cache volume room for one more adapter above "
                             f"--stager-cache-bytes (LORAFLEET_STAGER_CACHE_BYTES), or lower it",
                        type="server_error", code="cache_disk_full")
    if isinstance(exc, CacheDiskError):  # read-only after an error remount, an I/O error: the node's, not the store's
        return APIError(500, f"{uri}: the node's adapter disk cache cannot be written ({exc.strerror}, writing "
                             f"{exc.filename or 'the cache'}); check the cache volume (--stager-cache-dir)",
                        type="server_error", code="cache_disk_error")
    if isinstance(exc, BytesAltered):  # names the object, what it should hash to and what came
        return APIError(502, str(exc), type="server_error", code="bytes_altered")
    name = type(exc).__name__
    code, status = _s3_answer(exc) or ("", None)
    answered = code not in _CREDENTIALS  # a 403 or 404 of any other code is the store's answer (is_refusal)
    if code in ("NoSuchBucket", "NoSuchKey") or (answered and status == 404):
        return APIError(404, f"{uri}: {exc}", code="missing")
    if code in _REFUSED or (answered and status == 403):  # the store answered: the stager may not read it
        hint = "; check the bucket's policy" if code in _REFUSED or not code else ""  # else its code says (archived...)
        return APIError(403, f"{uri}: the object store refused the stager ({code}: {str(exc)[:200]}){hint}",
                        code="store_refused")
    if code in _CREDENTIALS:
        return APIError(502, f"{uri}: the object store does not accept the stager's credentials ({code}: "
                             f"{str(exc)[:200]}); check its key (LORAFLEET_S3_ACCESS_KEY / _SECRET_KEY), token "
                             f"and the node's clock", type="server_error", code="stager_credentials")
    if not code and status is not None and 300 <= status < 500 and status not in (408, 429):
        # A gateway's or proxy's page about this object (a redirect, never followed; a 400): its answer, not
        # an outage that would leave the push's other versions untried.
        what = "a redirect, which the stager does not follow" if status < 400 else "not an S3 error answer"
        return APIError(502, f"{uri}: the object store (or a gateway before it) answered {status}, {what}; check "
                             f"--s3-endpoint names the store itself ({name}: {str(exc)[:200]})", type="server_error",
                        code="store_answer")
    return APIError(502, f"{uri}: object store unavailable ({name}: {str(exc)[:200]})", type="server_error",
                    code="object_store_unavailable")
