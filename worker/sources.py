"""Adapter sources: where a PEFT directory may come from, and getting it onto local disk.

A source URI is a local path (`/abs/dir`), `file:///abs/dir`, or `s3://bucket/prefix/`. Only
configured locations are allowed: local paths must lie under one of `local_roots` (after resolving
symlinks, so a link pointing out of a root is refused, and so is `..`), S3 URIs must fall under one
of `s3_allow` (`bucket` or `bucket/prefix/`). Object-store access (minio client; endpoint,
credentials and TLS from the config or `LORAFLEET_S3_*` env vars) happens only in the stager.

Both kinds of source stage the same files (`STAGED_FILES`): the adapter's two, every file the
loader's tokenizer check reads (`vocab_digest.TOKENIZER_FILES`: tokenizer.json, or vocab.json +
merges.txt + added tokens, or a SentencePiece tokenizer.model), and a few optional ones; each is held to the same size limit.

The digest of an adapter directory is sha256 over `adapter_config.json` then
`adapter_model.safetensors` (the bytes of both, in that order) — the same value `load_peft_adapter`
uses as its default version, so a directive's `sha256` and an adapter's version agree. Tokenizer files
are staged but not digested, for local folders and S3 prefixes alike: the loader checks them against
the served base on every load, and digests of copies already cached stay valid.

A local file or folder that cannot be read is refused naming it and why (worker/source_error.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.worker.file_limits import (
    CONFIG_FILE,
    MAX_FILE_BYTES,
    WEIGHTS_FILE,
    FileLimitError,
    check_file,
    check_size,
    read_chunks,
)
from lorafleet.worker.object_digest import DigestCheck
from lorafleet.worker.object_fetch import Fetch
from lorafleet.worker.source_error import SourceError, read_error
from lorafleet.worker.stager_digests import FileIdentity, Identity, LocalDigests
from lorafleet.worker.store_clients import StoreClients
from lorafleet.worker.tenant_folders import NO_FOLDERS, FolderBounds, TenantFolders, local_uri_path, resolve
from lorafleet.worker.vocab_digest import TOKENIZER_FILES

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
OPTIONAL_FILES = ("special_tokens_map.json", "README.md")  # carried along, never read by the loader
# Every file staged, from a local folder or an S3 prefix alike: the tokenizer files are checked on load.
STAGED_FILES = tuple(dict.fromkeys((*ADAPTER_FILES, *TOKENIZER_FILES, *OPTIONAL_FILES)))
MAX_ATTEMPTS = 3  # downloads of one adapter whose objects changed meanwhile
RAISE_LIMIT = "raise the stager's --max-adapter-file-bytes (LORAFLEET_MAX_ADAPTER_FILE_BYTES)"
Etags = list[tuple[str, str]]  # (object name, object_version) of the staged files under a prefix, sorted


def object_version(listed: Any) -> str:
    """What tells a listed object's content from a replaced upload's: its ETag; a store that lists none still
    gives its size and time of upload, so that a replacement is not taken for the copy staged before it (keyed
    by an empty ETag, it was)."""
    if listed.etag:
        return listed.etag
    modified = listed.last_modified.isoformat() if listed.last_modified is not None else ""
    return f"no-etag:{listed.size}:{modified}"


@dataclass(slots=True, frozen=True)
class S3Location:
    bucket: str
    prefix: str  # always ends with "/" (or is "")

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(slots=True)
class SourcesConfig:
    local_roots: list[str] = field(default_factory=list)
    s3_allow: list[str] = field(default_factory=list)  # "bucket" or "bucket/prefix/"
    s3_endpoint: str | None = None  # host:port
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_secure: bool = True
    s3_region: str | None = None
    max_adapter_file_bytes: int = MAX_FILE_BYTES  # per file (worker/file_limits.py): refused before it is read
    store_check_timeout_s: float = 3.0  # read timeout of a quick listing (`object_etags(quick=True)`)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> SourcesConfig:
        env = dict(os.environ if env is None else env)

        def split(name: str) -> list[str]:
            return [v for v in env.get(name, "").split(",") if v]

        cfg = cls(
            local_roots=split("LORAFLEET_LOCAL_ROOTS"),
            s3_allow=split("LORAFLEET_S3_ALLOW"),
            s3_endpoint=env.get("LORAFLEET_S3_ENDPOINT"),
            s3_access_key=env.get("LORAFLEET_S3_ACCESS_KEY") or env.get("AWS_ACCESS_KEY_ID"),
            s3_secret_key=env.get("LORAFLEET_S3_SECRET_KEY") or env.get("AWS_SECRET_ACCESS_KEY"),
            s3_secure=env.get("LORAFLEET_S3_SECURE", "true").lower() not in ("0", "false", "no"),
            s3_region=env.get("LORAFLEET_S3_REGION") or env.get("AWS_REGION"),
        )
        for key, value in overrides.items():
            setattr(cfg, key, value)
        return cfg


def parse_s3(uri: str) -> S3Location:
    if not uri.startswith("s3://"):
        raise SourceError(f"{uri!r} is not an s3:// URI")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise SourceError(f"{uri!r}: no bucket (expected s3://bucket/prefix/)")
    # Object keys are not paths: "a//b" and "a/./b" name other objects than "a/b", so such a prefix is
    # refused rather than rewritten into one its owner did not write. One trailing "/" is the usual form.
    parts = prefix.removesuffix("/").split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts):
        raise SourceError(f"{uri!r}: '..', '.' and empty segments are not allowed in an object prefix")
    return S3Location(bucket, prefix.removesuffix("/") + "/" if prefix else "")


class Sources:
    """Checks URIs against the allow-list and fetches them (local: resolve; S3: download)."""

    def __init__(self, config: SourcesConfig) -> None:
        self.config = config
        self._roots = [Path(r).resolve() for r in config.local_roots]
        self.clients = StoreClients(config)  # worker/store_clients.py
        self.digests = LocalDigests()  # of local folders: an unchanged one is not read again
        self.object_check = DigestCheck()  # of downloaded objects: which buckets' ETags are no MD5s (object_digest.py)

    # ---- checks --------------------------------------------------------------------------------
    def is_s3(self, uri: str) -> bool:
        return uri.startswith("s3://")

    def check_s3(self, uri: str) -> S3Location:
        loc = parse_s3(uri)
        for entry in self.config.s3_allow:
            bucket, _, prefix = entry.partition("/")
            prefix = prefix.strip("/")
            if bucket == loc.bucket and (not prefix or loc.prefix.startswith(prefix + "/")):
                return loc
        raise SourceError(f"{uri}: bucket/prefix not in the allow-list ({', '.join(self.config.s3_allow) or 'empty'}); "
                          f"add it to LORAFLEET_S3_ALLOW", "not_allowed")

    def bounds(self, folders: TenantFolders = NO_FOLDERS) -> FolderBounds:
        """Where a local source's folder and files may resolve: the roots, and `folders` (worker/tenant_folders.py)."""
        return FolderBounds(self._roots, self.config.local_roots, folders)

    def local_path(self, uri: str, folders: TenantFolders = NO_FOLDERS) -> Path:
        """The resolved directory of a local source, refused unless it lies inside a configured root and, given
        `folders` (its tenant's: VersionRef.within, .without), inside them too (`FolderBounds`); so must the
        symlinks among its files. A folder or file in it that cannot be read (a symlink loop, a permission
        error) is refused."""
        bounds = self.bounds(folders)
        path = resolve(Path(local_uri_path(uri)))  # follows symlinks: a link out of a root lands outside it
        bounds.check(path, f"{uri}: resolves to {path},")
        if not str(path).isprintable():  # the path is what is forwarded (a version's uri): that version's failure
            raise SourceError(f"{uri}: resolves to {str(path)!r}, a path with control characters", "unreadable")
        with _as_source_error(path):
            info = _stat(path)
            if info is None or not stat.S_ISDIR(info.st_mode):
                raise SourceError(f"{uri}: no such adapter directory", "missing")
            for f in path.iterdir():  # the loader reads tokenizer files beside the adapter's own
                if f.is_symlink():
                    bounds.check(resolve(f), f"{f}: symlink points")
                    _stat(f)  # a loop that resolve() leaves unresolved (Python 3.13 on)
        return path

    # ---- fetching ------------------------------------------------------------------------------
    def download(self, uri: str, dest: Path, *, progress: Callable[[int, int], None] | None = None,
                 deadline: float | None = None, etags: Etags | None = None) -> Path:
        """Download the adapter files under an allowed S3 prefix into `dest` (created). Only the PEFT
        files (`STAGED_FILES`) are fetched; anything else under the prefix (pickles included) is ignored.
        `progress(done_bytes, total_bytes)` is called when the download starts and as bytes arrive.

        Every object is read at the version the listing saw (If-Match on its ETag; objects listed without one
        are listed again once read): an object replaced
        mid-download would otherwise mix files of two uploads; the download then starts over, up to
        `MAX_ATTEMPTS` times. Each object's bytes are checked against the checksum or ETag the store gives,
        and read once more when they do not match (worker/object_digest.py). `deadline` (time.monotonic())
        ends a slow download with TimeoutError, even
        in the middle of a read, so nothing keeps writing after the caller gave up; a store that stops
        answering fails each request by then too, and an object none of whose bytes came by then raises
        StoreSilent (worker/store_clients.py). `etags` (`object_etags`,
        what the caller keyed its copy by): any other objects are refused (kind `changed`), never kept
        under a key that names other content."""
        loc = self.check_s3(uri)
        client = self.clients.client(deadline=deadline)
        wanted = {loc.prefix + n: n for n in STAGED_FILES}
        dest.mkdir(parents=True, exist_ok=True)
        for _ in range(MAX_ATTEMPTS):
            listing = [o for o in client.list_objects(loc.bucket, prefix=loc.prefix) if o.object_name in wanted]
            objects = {o.object_name: (o.size, o.etag) for o in listing}
            _refuse_missing(uri, [n for n in ADAPTER_FILES if loc.prefix + n not in objects])
            if etags is not None and sorted((o.object_name, object_version(o)) for o in listing) != list(etags):
                raise SourceError(f"{uri}: the objects changed since they were listed (a new upload?); stage it "
                                  f"again", "changed")
            with _as_source_error():  # before a byte is downloaded
                for key, (size, _) in sorted(objects.items()):
                    check_size(loc.uri + wanted[key], size, self.config.max_adapter_file_bytes, fix=RAISE_LIMIT)
            for name in wanted.values():  # what an earlier attempt wrote
                (dest / name).unlink(missing_ok=True)
            fetched = Fetch(sum(size for size, _ in objects.values()), progress, deadline, loc.uri, self.object_check)
            if all(fetched.object(client, loc.bucket, key, etag, size, dest / wanted[key])
                   for key, (size, etag) in sorted(objects.items())) and _unchanged(client, loc, wanted, listing,
                                                                                    fetched.unheld):
                return dest
        raise SourceError(f"{uri}: the objects changed during {MAX_ATTEMPTS} download attempts; retry once the "
                          f"upload has finished", "changed")

    def verify_local(self, path: Path, sha256: str | None, where: str, folders: TenantFolders = NO_FOLDERS) -> str:
        """The digest of the local adapter directory `path` (as `verify_digest`). Every file the engine may
        read from it is held to the size limit first, by stat alone: a huge or endless file (a FIFO, a
        device) is refused before a byte of any of them is read. A folder without one of the two adapter
        files is a missing source, as an S3 prefix without it is. Each file hashed is read from the
        descriptor whose real location was found in bounds (the roots, `folders`: `FolderBounds`), whatever
        its name leads to by then. Files unchanged since an earlier call in the same bounds are not read
        again (worker/stager_digests.py)."""
        bounds = self.bounds(folders)
        with _as_source_error(path):
            present = [n for n in STAGED_FILES if _stat(path / n) is not None]
            _refuse_missing(where, [n for n in ADAPTER_FILES if n not in present])
            for name in present:
                check_file(path / name, self.config.max_adapter_file_bytes, fix=RAISE_LIMIT)

        def compute() -> tuple[str, Identity]:
            read: list[FileIdentity] = []
            digest = adapter_digest(path, self.config.max_adapter_file_bytes,
                                    opened=lambda file, fd: read.append(bounds.check_opened(file, fd)))
            return digest, tuple(read)

        return check_digest(self.digests.digest(path, ADAPTER_FILES, compute, key=(path, folders)), sha256, where)

    def object_etags(self, uri: str, *, quick: bool = False, deadline: float | None = None) -> Etags:
        """(name, `object_version`) of the staged files (`STAGED_FILES`, tokenizer files included) under an S3
        prefix: identifies content without a digest. `quick`, `deadline`: which client lists (worker/store_clients.py)."""
        loc = self.check_s3(uri)
        names = {loc.prefix + n for n in STAGED_FILES}
        listing = self.clients.client(quick=quick, deadline=deadline).list_objects(loc.bucket, prefix=loc.prefix)
        return sorted((o.object_name, object_version(o)) for o in listing if o.object_name in names)

    def list_adapters(self, uri: str) -> list[str]:
        """URIs of the adapter directories (folders with adapter_config.json) directly under a prefix."""
        loc = self.check_s3(uri)
        found = []
        for o in self.clients.client().list_objects(loc.bucket, prefix=loc.prefix, recursive=True):
            rest = o.object_name[len(loc.prefix):]
            folder, _, name = rest.partition("/")
            if name == CONFIG_FILE and folder:
                found.append(f"s3://{loc.bucket}/{loc.prefix}{folder}/")
        return sorted(found)


def adapter_digest(path: Path, max_file_bytes: int | None = None,
                   opened: Callable[[Path, int], None] | None = None) -> str:
    """sha256 over adapter_config.json then adapter_model.safetensors. A file that is not a regular file
    (it could block the read or never end) is refused, and so is one over its limit under
    `max_file_bytes` (None: no size limit), before it is read (SourceError), and a missing one is a
    missing source (SourceError `missing`). `opened`: as file_limits.read_chunks'."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        with _as_source_error(Path(path) / name):
            try:
                for chunk in read_chunks(Path(path) / name, max_file_bytes, chunk_bytes=1 << 20, fix=RAISE_LIMIT,
                                         opened=opened):
                    h.update(chunk)
            except FileNotFoundError:  # removed since the folder was checked
                _refuse_missing(str(path), [name])
    return h.hexdigest()


def verify_digest(path: Path, sha256: str | None, where: str, max_file_bytes: int | None = None) -> str:
    """The directory's digest (files held to `max_file_bytes` as in `adapter_digest`); raises SourceError
    when `sha256` is given and differs."""
    return check_digest(adapter_digest(path, max_file_bytes), sha256, where)


def check_digest(digest: str, sha256: str | None, where: str) -> str:
    if sha256 is not None and digest != sha256.lower():
        raise SourceError(f"{where}: sha256 mismatch: expected {sha256}, the files hash to {digest} "
                          f"(corrupt or changed upload; fix the object or the directive's sha256)", "digest_mismatch")
    return digest


def _refuse_missing(where: str, missing: list[str]) -> None:
    """A missing source (404) when `where`, an S3 prefix or a local folder, lacks adapter files."""
    if missing:
        raise SourceError(f"{where}: missing {', '.join(missing)} (a PEFT adapter directory needs both; "
                          f"pickle .bin files are not served)", "missing")


def _stat(path: Path) -> os.stat_result | None:
    """os.stat of `path`, None when it does not exist. Any other failure (a permission error, a symlink
    loop) raises, where Path.exists() would call some of them missing."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


@contextlib.contextmanager
def _as_source_error(where: str | Path = "") -> Iterator[None]:
    """A file refused by its limits (worker/file_limits.py), or a local one that cannot be read (`where`,
    unless the error names the file), as the SourceError the stager answers with: never an OSError, which
    it would answer as a broken object store."""
    try:
        yield
    except FileLimitError as exc:
        raise SourceError(str(exc), exc.kind) from None
    except OSError as exc:
        raise read_error(where, exc) from None


def _unchanged(client: Any, loc: S3Location, wanted: dict[str, str], listing: list, unheld: bool) -> bool:
    """Whether the objects read without an ETag (no If-Match held them to the listed upload), or one of whose
    answers had none or another (`unheld`: nothing showed an If-Match was kept), are still those listed: one
    replaced mid-download left a copy of two uploads, kept under the key of the first."""
    if not unheld and all(o.etag for o in listing):
        return True
    again = [o for o in client.list_objects(loc.bucket, prefix=loc.prefix) if o.object_name in wanted]
    return sorted((o.object_name, object_version(o)) for o in again) == sorted(
        (o.object_name, object_version(o)) for o in listing)
