"""One download attempt of an adapter's objects (sources.Sources.download): progress over all of them, the
attempt's deadline, and a body cut short taken up where it stopped.

A connection the store drops in the middle of an object (a reset, a body that ends before the size the
listing gave) is asked again for the rest only: a ranged GET (`Range: bytes=N-`) under the same `If-Match`,
so the bytes appended are the same object's, up to `RESUMES` times an object while each answer brings some
bytes. Only the rest asked is taken: a 206 must say `Content-Range: bytes N-(size-1)/size`, else the download
fails as the store's fault; a store that ignores the range (200) has its object read again from the start. An
object listed without an ETag (nothing would keep a replaced upload's bytes out of the rest) or sent encoded
(`Content-Encoding`: its bytes as received are not the bytes the range counts) is not resumed, and neither is
a read the deadline ended: the download's time is spent.

Each object's bytes are hashed as they are written, across resumes, and checked against the checksum or ETag
its answers give (worker/object_digest.py): one that does not match is downloaded once more before the download
fails as the store's fault.

If-Match alone is not trusted to hold an object to the upload listed: some gateways drop it. An answer with
no ETag, or another than the one listed (a replaced object whose If-Match was dropped, or a gateway that
rewrites ETags), leaves the attempt unheld: the objects are listed again once read, and read again if they
changed (sources._unchanged). The listing decides: a rewritten ETag alone fails nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

from urllib3.exceptions import HTTPError as Urllib3Error

from lorafleet.worker.disk_cache import cache_write
from lorafleet.worker.object_digest import CHECKSUM_MODE, DigestCheck, ObjectDigest
from lorafleet.worker.source_error import BodyCut, SourceError
from lorafleet.worker.store_clients import StoreSilent

CHUNK_BYTES = 256 << 10  # the most one read of a download takes (it takes what has come, reporting progress)
RESUMES = 4  # ranged GETs for the rest of one object whose connection dropped, each after bytes came


class _Cut(Exception):
    """The body ended (or its connection broke) after `received` of the object's bytes."""

    def __init__(self, received: int, cause: BaseException | None, resumable: bool) -> None:
        super().__init__(received)
        self.received, self.cause, self.resumable = received, cause, resumable


class Fetch:
    """One download attempt's reads: progress over all objects, and the deadline."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None, deadline: float | None,
                 uri: str, check: DigestCheck) -> None:
        self.total, self.done, self.progress, self.deadline, self.uri = total, 0, progress, deadline, uri
        self.check = check  # the store's (per Sources): what it learnt of its buckets' ETags outlives the attempt
        self.unheld = False  # an answer's ETag was not the one listed (or none): nothing showed it was that upload
        self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)

    def _check_deadline(self, where: str = "", silent: bool = False) -> None:
        """Once the deadline passed: TimeoutError, the download ran out of its time (it may have been
        receiving, too slowly); StoreSilent when `silent`, the object `where` was read and none of its
        bytes had come: the store did not answer."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return
        if silent:
            raise StoreSilent(f"{where}: the store sent none of its bytes before the download's deadline "
                              f"({self.done} of {self.total} bytes)")
        raise TimeoutError(f"{self.uri}: download timed out ({self.done} of {self.total} bytes)")

    def object(self, client, bucket: str, key: str, etag: str | None, size: int, path: Path) -> bool:
        """Read `key` into `path`, its bytes checked against what the store says they hash to (worker/object_digest.py:
        read twice when they do not); False when it no longer has the listed `etag` (replaced meanwhile)."""
        where = f"{self.uri}{path.name}"
        first = self._whole(client, bucket, key, etag, size, path, where)
        if first is None or self.check.passes(bucket, first):
            return first is not None
        self.done -= size  # read again from its start: its bytes count once
        second = self._whole(client, bucket, key, etag, size, path, where)
        if second is not None:
            self.check.settle(bucket, where, first, second)
        return second is not None

    def _whole(self, client, bucket: str, key: str, etag: str | None, size: int, path: Path,
               where: str) -> ObjectDigest | None:
        """Read `key` into `path`, resuming a body cut short; its digest, or None when it was replaced."""
        received, resumes, digest = 0, 0, ObjectDigest()
        while True:
            try:
                got = self._part(client, bucket, key, etag, size, path, received, where, digest)
            except _Cut as cut:
                self._check_deadline(where, cut.received == 0 < size)  # a read the deadline ended is not resumed
                if cut.resumable and 0 < cut.received < size and resumes < RESUMES and cut.received > received:
                    received, resumes = cut.received, resumes + 1
                    continue
                if cut.cause is not None:
                    raise cut.cause from None
                raise BodyCut(f"{where}: the store sent {cut.received} of the {size} bytes it listed") from None
            return digest if got else None

    def _part(self, client, bucket: str, key: str, etag: str | None, size: int, path: Path, offset: int,
              where: str, digest: ObjectDigest) -> bool:
        """The object's bytes from `offset` (those before it are in `path`, and hashed in `digest`) appended to
        `path` and hashed; False when the object changed. _Cut with the bytes `path` holds when the body ends
        short or its connection breaks."""
        from minio.error import InvalidResponseError, S3Error

        self._check_deadline()
        headers = {**CHECKSUM_MODE, "If-Match": f'"{etag}"'} if etag else dict(CHECKSUM_MODE)
        try:
            response = client.get_object(bucket, key, offset=offset, request_headers=headers)
        except S3Error as exc:
            if exc.code == "PreconditionFailed":
                return False
            raise
        except InvalidResponseError as exc:  # a 412 without S3's XML body (a gateway's): replaced all the same
            if getattr(exc, "_code", None) == 412:
                return False
            raise
        except Exception:  # its attempts ran out with the download's time (the client's timeouts end there)
            self._check_deadline(where, offset == 0 < size)
            raise
        if bare_etag(response.headers.get("ETag")) != bare_etag(etag):  # If-Match may have been dropped
            self.unheld = True
        # At the deadline the socket is shut down: a read blocked on a stalled store returns at once.
        timer = None
        if self.deadline is not None:
            timer = threading.Timer(max(0.0, self.deadline - time.monotonic()), _shutdown, (response,))
            timer.daemon = True
            timer.start()
        try:
            if offset and response.status != 206:  # the whole object came instead of the rest: read from its start
                self.done -= offset
                offset = 0
            elif offset and response.headers.get("Content-Range", "").strip() != f"bytes {offset}-{size - 1}/{size}":
                raise BodyCut(f"{where}: the store answered the rest of the object from byte {offset} with "
                              f"Content-Range {response.headers.get('Content-Range')!r}, not bytes "
                              f"{offset}-{size - 1}/{size}")
            resumable = bool(etag) and response.headers.get("Content-Encoding", "identity").lower() in ("", "identity")
            if offset and not resumable:  # the rest asked came encoded: its bytes are not the range's
                raise BodyCut(f"{where}: the store sent the rest of the object from byte {offset} encoded "
                              f"({response.headers.get('Content-Encoding')}); it is not appended")
            announced = response.headers.get("Content-Length")
            if announced is not None and int(announced) > size - offset:
                raise SourceError(f"{where}: the store announces {announced} bytes, more than the {size - offset} "
                                  f"it listed; refused before downloading it", "too_large")
            digest.answered(response.headers, etag, whole=not offset)
            received = offset
            f = cache_write(lambda: open(path, "ab" if offset else "wb"))  # noqa: SIM115 - closed below
            try:
                while True:
                    try:
                        chunk = response.read1(CHUNK_BYTES)
                    except Exception as exc:  # a read the deadline ended (the socket shut down) is a timeout
                        self._check_deadline(where, received == 0 < size)
                        if isinstance(exc, (Urllib3Error, ConnectionError)):  # a broken connection: resumed
                            raise _Cut(received, exc, resumable) from None
                        raise
                    if not chunk:
                        break
                    received += len(chunk)
                    if received > size:  # no Content-Length (chunked): what the listing said is the bound
                        raise SourceError(f"{where}: the store sent more than the {size} bytes it listed; the "
                                          f"download was stopped", "too_large")
                    cache_write(lambda c=chunk: f.write(c))
                    digest.update(chunk)
                    self.done += len(chunk)
                    self._report()
            finally:
                cache_write(f.close)  # the last buffered bytes are written here
        finally:
            if timer is not None:
                timer.cancel()
            response.close()
            response.release_conn()
        if received != size:  # the store's fault (a dropped connection), not the adapter's
            raise _Cut(received, None, resumable)
        return True


def _shutdown(response) -> None:
    with contextlib.suppress(ValueError, RuntimeError, OSError):  # already released: the read is over anyway
        response.shutdown()


def bare_etag(etag: str | None) -> str | None:
    """An ETag's value without its quotes and weak prefix (`W/"x"` and `x` name the same upload); None if empty."""
    value = (etag or "").strip().removeprefix("W/").strip().strip('"')
    return value or None
