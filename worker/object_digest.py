"""What a downloaded object's bytes are checked against when its adapter's directive gives no sha256
(object_fetch.Fetch): the full-object SHA-256 checksum the store keeps for an object uploaded with one (sent
when asked with `x-amz-checksum-mode: ENABLED`), else the ETag of an object uploaded in one part, which S3 and
most stores set to the hex MD5 of its content. The hashes run over the bytes as they are written, across the
answers that bring them: the rest of a cut body (a ranged GET) continues them, an answer of the whole object
restarts them.

Not every ETag of 32 hex digits is its object's MD5 (objects encrypted by some stores, some gateways), so a
mismatch is first taken for bytes altered in transit and the object is downloaded once more, within the same
attempt and deadline. A second download that hashes to the ETag is kept; one that hashes as the first did has
stable bytes and an ETag that is no MD5 of them: they are kept, logged once, and that bucket's ETags are not
compared again by this process. Unless an object of that bucket hashed to its ETag before and this one is not
stored encrypted (no `x-amz-server-side-encryption` answer header): the bucket's ETags are MD5s, and bytes
that miss theirs the same way twice are altered the same way twice (a faulty proxy or disk), not kept.
Without a sha256 in the directive, the first object a process reads from a bucket cannot be told so.

Two downloads that differ from each other and from the ETag (or a checksum missed twice: a checksum is always
of the content), or that miss an MD5 ETag as above, fail the download as the store's fault (BytesAltered:
502 `bytes_altered`, tried again by the next push), naming the object, what it should hash to and what came.
That object's failure only: the store answered, so it is not marked down and the push's other versions still
call it.

Nothing is compared for an ETag with a `-N` suffix (a multipart upload), an object encrypted with a KMS or
customer key (`x-amz-server-side-encryption: aws:kms*`, `…-customer-algorithm`: their ETags are documented to
be no MD5s), or an answer sent with a `Content-Encoding` (the bytes received are not the bytes stored).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import re
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

CHECKSUM_MODE = {"x-amz-checksum-mode": "ENABLED"}  # asks the store for the object's checksum, if it keeps one
_MD5_HEX = re.compile(r"[0-9a-f]{32}")


class ObjectDigest:
    """The hashes of one object's bytes as written to its file, and the values its answers say they must have."""

    def __init__(self) -> None:
        self.etag: str | None = None  # the hex MD5 the object's ETag stands for; None: not compared
        self.encrypted = False  # an answer said the object is stored encrypted (any server-side encryption)
        self.checksum: str | None = None  # the hex SHA-256 of its x-amz-checksum-sha256
        self._md5 = self._sha256 = None

    def answered(self, headers: Mapping[str, str], listed_etag: str | None, *, whole: bool) -> None:
        """An answer's `headers` before its bytes: one of the object from its first byte (`whole`) restarts
        the hashes; one of the rest keeps them (its If-Match held it to the same object)."""
        if whole:
            self.etag = md5_etag(headers.get("ETag") or listed_etag)
            self.checksum = sha256_checksum(headers)
            self._md5 = hashlib.md5(usedforsecurity=False) if self.etag else None
            self._sha256 = hashlib.sha256() if self.checksum else None
        if headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity"):
            self.etag = self.checksum = None
        sse = headers.get("x-amz-server-side-encryption", "").strip().lower()
        customer_key = "x-amz-server-side-encryption-customer-algorithm" in headers
        self.encrypted = (self.encrypted and not whole) or bool(sse) or customer_key
        if sse.startswith("aws:kms") or customer_key:
            self.etag = None  # the checksum is of the content still

    def update(self, chunk: bytes) -> None:
        for h in (self._md5, self._sha256):
            if h is not None:
                h.update(chunk)

    @property
    def md5(self) -> str | None:
        return self._md5.hexdigest() if self.etag and self._md5 is not None else None

    @property
    def sha256(self) -> str | None:
        return self._sha256.hexdigest() if self.checksum and self._sha256 is not None else None


def md5_etag(etag: str | None) -> str | None:
    """The hex MD5 an ETag stands for (quotes stripped), None unless it is 32 hex digits (a multipart upload's
    has a `-N` suffix, a weak one `W/`)."""
    value = (etag or "").strip().strip('"').lower()
    return value if _MD5_HEX.fullmatch(value) else None


def sha256_checksum(headers: Mapping[str, str]) -> str | None:
    """The hex SHA-256 of an answer's x-amz-checksum-sha256; None without one, or for a multipart upload's (a
    checksum of its parts' checksums: `-N` suffix, or x-amz-checksum-type COMPOSITE)."""
    value = headers.get("x-amz-checksum-sha256")
    if not value or headers.get("x-amz-checksum-type", "").strip().upper() == "COMPOSITE":
        return None
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None


class BytesAltered(ConnectionError):
    """An object's bytes missed what the store says they hash to in two downloads: the store or the link to it
    alters them. That object's failure (502 `bytes_altered`, tried again by the next push), not an outage: the
    store answered, and the push's other versions still call it."""


class DigestCheck:
    """Checks the objects downloaded from one store (one per Sources, which has one endpoint), remembering the
    buckets whose ETags proved to be no MD5s. Per bucket, not per object: encryption is mostly a bucket's
    default, so every new upload there would be downloaded twice; a bucket of plain objects beside it keeps its
    check. Not per endpoint for that same reason; a gateway's ETags cost one double download per bucket."""

    def __init__(self) -> None:
        self._etag_not_md5: set[str] = set()  # buckets
        self._etag_md5: set[str] = set()  # buckets where an object's bytes hashed to its ETag
        self._lock = threading.Lock()

    def passes(self, bucket: str, digest: ObjectDigest) -> bool:
        """Whether the bytes hash to what the store says (true when it says nothing that can be compared)."""
        if digest.checksum is not None:
            return digest.sha256 == digest.checksum
        if digest.etag is None or bucket in self._etag_not_md5:
            return True
        if digest.md5 == digest.etag:
            with self._lock:
                self._etag_md5.add(bucket)
            return True
        return False

    def settle(self, bucket: str, where: str, first: ObjectDigest, second: ObjectDigest) -> None:
        """The object `where`, whose `first` download did not pass, was downloaded again (`second`): return to
        keep the second's bytes, raise BytesAltered (the store's fault, which may pass) to keep neither."""
        if self.passes(bucket, second):
            return
        if second.checksum is not None:
            raise BytesAltered(f"{where}: received SHA-256 {second.sha256}, not its x-amz-checksum-sha256 "
                                  f"{second.checksum}, in two downloads ({first.sha256} the first): the store or "
                                  f"the link to it alters bytes; not staged")
        if second.md5 != first.md5:
            raise BytesAltered(f"{where}: received MD5 {second.md5}, not its ETag {second.etag}, in two downloads "
                                  f"that differ ({first.md5} the first): the store or the link to it alters bytes "
                                  f"in transit; not staged")
        if bucket in self._etag_md5 and not second.encrypted:
            raise BytesAltered(f"{where}: received MD5 {second.md5}, not its ETag {second.etag}, in two downloads, "
                               f"the same both times, from bucket {bucket} whose ETags are the MD5s of its objects "
                               f"(and this object is not stored encrypted): the store or the link to it alters "
                               f"these bytes the same way each time; not staged")
        with self._lock:  # stable bytes: the ETag is no MD5 of them (an encrypted object, a gateway's ETag)
            noted = bucket in self._etag_not_md5
            self._etag_not_md5.add(bucket)
        if not noted:
            log.warning("%s: its ETag %s is not the MD5 of its bytes (%s in two downloads): bucket %s's ETags are "
                        "taken for no MD5s (encrypted objects, a gateway's) and no longer compared; give directives "
                        "a sha256 to have its adapters' bytes checked", where, second.etag, second.md5, bucket)
