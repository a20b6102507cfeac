"""API keys -> tenant -> the adapters that tenant may use.

The keys file (JSON or YAML; in Kubernetes a mounted Secret) looks like::

    tenants:
      acme:
        keys: ["sk-acme-1", "sk-acme-2"]
        adapters: ["sql", "acme-*"]     # fnmatch patterns of adapter names
        base_model: true                # may call the base model without an adapter (default true)

A tenant may also use every adapter whose directive names it as `tenant` (see directives.py); an adapter
whose directive names another tenant is that one's alone, whatever the patterns. The name `default` is
reserved: it owns the adapters of no tenant in particular, which only the patterns grant.
Without a keys file the worker is open (development mode): every caller is the `dev` tenant and may
use everything; the server logs that at start-up. A keys file never opens the worker, not even one
that lists no key (every caller is then refused). Keys are kept only as SHA-256 digests.

The file is read again when it changes (Kubernetes swaps a new file into a mounted Secret): a revoked
key stops working and a new one works without a restart. `watch` looks for a change every
KEYS_POLL_S on a thread, never on the event loop: a request's key is checked in memory, so a slow or hung
mount never stalls the server. A file that turns unreadable or malformed
keeps the keys read last, logged; it neither opens the worker nor locks every tenant out.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEV_TENANT = "dev"
# The owner of adapters registered for no tenant in particular (the s3:// --adapters seed's): unowned, so the
# keys file's patterns decide who may use them.
UNOWNED = "default"
KEYS_POLL_S = 1.0  # how often the keys file is looked at for a change

log = logging.getLogger(__name__)


class TenantsError(ValueError):
    """The keys file is unreadable or malformed; the message names the file and the entry."""


class AuthenticationError(Exception):
    """No key, or a key that no tenant holds."""


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    adapter_patterns: tuple[str, ...] = ()
    base_model: bool = True
    is_dev: bool = False  # development mode: may use everything

    def may_use(self, adapter: str | None, owner: str | None = None) -> bool:
        """May this tenant call `adapter` (None = the base model) whose directive names `owner`? An adapter
        with an owner is that tenant's alone: the keys file's patterns grant only adapters nobody owns
        (owner None or UNOWNED: start-up folders, the s3:// seed, vLLM-style loads), so naming an adapter to
        fall within another tenant's pattern gives that tenant nothing."""
        if self.is_dev or (adapter is not None and owner == self.name):
            return True
        if adapter is None:
            return self.base_model
        if owner not in (None, UNOWNED):
            return False
        return any(fnmatch.fnmatchcase(adapter, p) for p in self.adapter_patterns)


def token_bytes(token: str) -> bytes:
    """A header's token as bytes; aiohttp keeps bytes that are not UTF-8 as lone surrogates."""
    return token.encode("utf-8", "surrogatepass")


def _digest(key: str) -> str:
    return hashlib.sha256(token_bytes(key)).hexdigest()


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a changed file: a swapped-in file has another inode, a rewritten one another mtime."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong in a YAML keys file and where, without the text there: PyYAML's own message quotes
    the offending line, which may hold a key, and the message is logged."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return str(exc)  # a ReaderError names the character's code and position only
    what = ": ".join(part for part in (exc.context, exc.problem) if part) or "malformed YAML"
    mark = exc.problem_mark or exc.context_mark
    return what if mark is None else f"{what} (line {mark.line + 1}, column {mark.column + 1})"


def keys_file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be the API keys file (missing, a directory), or None: checked at start-up."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        try:  # a mounted Secret's folder: name the files in it (Kubernetes' own entries start with "..")
            found = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        except OSError:
            found = []
        if not found:
            return (f"--api-keys-file {path} is a directory, not a file, and holds no file: pass the path of "
                    "the JSON/YAML keys file itself")
        return (f"--api-keys-file {path} is a directory, not a file: pass the JSON/YAML keys file itself, "
                f"e.g. --api-keys-file {path / found[0]} (the folder holds {', '.join(found[:3])})")
    if path.exists():
        return f"--api-keys-file {path} is not a regular file: pass a JSON/YAML keys file"
    return (f"--api-keys-file {path} does not exist: pass the path of a JSON/YAML keys file, or leave the flag "
            "unset to run open to everyone (development mode)")


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Tenants:
    """Looks up the tenant of an API key. Open (development mode) only when made without a keys file."""

    def __init__(self, tenants: list[Tenant] | None = None, keys: dict[str, str] | None = None, *,
                 is_open: bool = False) -> None:
        by_name = {t.name: t for t in tenants or []}
        # key digest -> its Tenant, swapped whole when the file changes (read from the event loop, written
        # from the watching thread)
        self._by_digest: dict[str, Tenant] = {}
        for key, name in (keys or {}).items():
            if name not in by_name:
                raise TenantsError(f"key maps to unknown tenant {name!r}")
            self._by_digest[_digest(key)] = by_name[name]
        self._names = sorted(by_name)
        self._is_open = is_open
        self._path: Path | None = None  # the keys file, re-read when it changes
        self._stamp: tuple[int, int, int, int] | None = None
        self.on_gone: Callable[[str], None] = lambda name: None  # each tenant a reload of the file left out

    @property
    def is_open(self) -> bool:
        """Development mode: no keys file was given."""
        return self._is_open

    @property
    def num_keys(self) -> int:
        return len(self._by_digest)

    @property
    def names(self) -> list[str]:
        return self._names

    @property
    def path(self) -> Path | None:
        """The keys file (None: made without one)."""
        return self._path

    @classmethod
    def from_file(cls, path: str | Path | None) -> Tenants:
        if path is None:
            return cls(is_open=True)
        path = Path(path)
        stamp = _stamp(path)  # before reading: a change while it is read is seen at the next call
        tenants = cls._read(path)
        tenants._path, tenants._stamp = path, stamp
        return tenants

    @classmethod
    def _read(cls, path: Path) -> Tenants:
        try:
            text = path.read_text(encoding="utf-8")
        except IsADirectoryError:  # a mounted Secret's folder instead of the file in it
            raise TenantsError(keys_file_problem(path) or f"API keys file {path} is a directory") from None
        except OSError as exc:
            raise TenantsError(f"cannot read API keys file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:  # else it escapes reload_if_changed: every request would fail
            raise TenantsError(f"API keys file {path} is not UTF-8 text (byte {exc.start})") from None
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except ValueError as exc:  # JSONDecodeError: a position, never the text around it
            raise TenantsError(f"API keys file {path} is not valid JSON/YAML: {exc}") from None
        except yaml.YAMLError as exc:
            raise TenantsError(f"API keys file {path} is not valid JSON/YAML: {_yaml_problem(exc)}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "API keys") -> Tenants:
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict):
            raise TenantsError(f"{source}: expected a mapping with a 'tenants' mapping at the top")
        tenants: list[Tenant] = []
        keys: dict[str, str] = {}
        for name, entry in data["tenants"].items():
            where = f"{source}: tenants.{name}"
            if not isinstance(name, str) or not name:
                # YAML reads `1:` as an int: str() would merge it with a tenant "1" (permissions and caps shared).
                raise TenantsError(f"{where}: a tenant name must be a non-empty string; quote it (\"{name}\":)")
            if name == UNOWNED:  # the owner of adapters of no tenant in particular: may_use would grant it them all
                raise TenantsError(f'{where}: "{UNOWNED}" is reserved (the owner of adapters of no tenant in particular, '
                                   'which the patterns grant); name the tenant otherwise')
            if not isinstance(entry, dict):
                raise TenantsError(f"{where}: expected a mapping with keys, adapters, base_model")
            unknown = set(entry) - {"keys", "adapters", "base_model"}
            if unknown:
                raise TenantsError(f"{where}: unknown fields {sorted(unknown)}")
            entry_keys = entry.get("keys", [])
            patterns = entry.get("adapters", [])
            base_model = entry.get("base_model", True)
            if not isinstance(entry_keys, list) or not all(isinstance(k, str) and k for k in entry_keys):
                raise TenantsError(f"{where}.keys: expected a list of non-empty strings")
            if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
                raise TenantsError(f"{where}.adapters: expected a list of name patterns")
            if not isinstance(base_model, bool):
                raise TenantsError(f"{where}.base_model: expected true or false")
            for key in entry_keys:
                if key in keys:
                    raise TenantsError(f"{where}.keys: a key is shared with tenant {keys[key]!r}")
                keys[key] = name
            tenants.append(Tenant(name, tuple(patterns), base_model))
        return cls(tenants, keys)

    def reload_if_changed(self) -> bool:
        """Read the keys file again if it changed since it was read; True if new keys are in force."""
        if self._path is None:
            return False
        stamp = _stamp(self._path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            fresh = self._read(self._path)
        except TenantsError as exc:
            log.error("%s; the keys read before stay in force until the file is fixed", exc)
            return False
        gone = set(self._names) - set(fresh._names)
        self._by_digest, self._names = fresh._by_digest, fresh._names
        for name in sorted(gone):  # a name given again later is another customer: nothing of this one is shared
            self.on_gone(name)
        log.info("API keys file %s changed: keys reloaded for tenants: %s", self._path, ", ".join(self.names))
        return True

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant from its `Authorization` header; raises AuthenticationError. Reads no file:
        `watch` keeps the keys current."""
        if self.is_open:
            return Tenant(DEV_TENANT, is_dev=True)
        token = bearer_token(authorization)
        if token is None:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' with a key issued to your tenant"
            )
        tenant = self._by_digest.get(_digest(token))
        if tenant is None:
            raise AuthenticationError("invalid API key: it belongs to no tenant of this worker")
        return tenant

    async def watch(self, interval: float = KEYS_POLL_S) -> None:
        """Read the keys file again whenever it changed, looking every `interval` seconds on a thread, until
        cancelled. One look at a time: a look stuck on a hung mount delays only the next."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            try:
                await loop.run_in_executor(None, self.reload_if_changed)
            except Exception:  # noqa: BLE001 - the keys read last stay in force; the watch goes on
                log.exception("looking at API keys file %s failed", self._path)
