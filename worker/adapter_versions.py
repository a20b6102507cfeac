"""AdapterVersions: registration and versions, as part of `AdapterPool` (worker/adapter_pool.py).

Keys are `name@version`; `resolve(name)` answers the current version. A new version loads beside the
current one and becomes current once resident (`make_current=False`: a canary, promoted later with
`make_current`). The version it replaces, or one unregistered or removed, retires: no new request
resolves to it, and it is dropped (GPU pages, slot and CPU copy) as soon as nothing holds it: no
reference (requests in flight finish on it), no copy in flight, no queued request it was loaded for.
A dropped version is forgotten: registering the same `name@version` again makes a fresh one (its new
tenant, its new weights). While a retired version is still held, registering it again brings it back
for the new tenant if the weights are the same, and refuses other weights (one key, one content).
Except a current version registered again with `make_current=False` while a new one loads to replace it:
it becomes the new one's canary (stable and canary swapped in one push), so the switch keeps it
registered, not current (`_kept`), instead of retiring it; until the new one is registered or made current
again as current (a push that no longer names the old one as its canary): then the switch retires the old one.
It works on the pool's state declared in `AdapterPool.__init__`.
"""

from __future__ import annotations

import time

from lorafleet.worker.adapter_entry import AdapterEntry, AdapterNotFoundError, Loader, split_key


class AdapterVersions:
    def add(self, key: str, weights=None, *, loader: Loader | None = None, tenant: str = "default",
            pinned: bool = False, make_current: bool = True, keep_previous: str | None = None,
            read_seconds: float = 0.0) -> None:
        """Register `name@version` from CPU `weights` (packed now, read_seconds after the caller read them:
        the disk -> CPU load time; re-read through `weights.reload` if it has one, so the CPU tier alone
        bounds the copies kept) or a `loader` (run in a loader thread on first use). A second version loads
        beside the first, current once resident unless the first is added again (as current; as a canary,
        `make_current=False`, it stays registered beside the second once that is current, as does the key
        `keep_previous` names if it is the current one at the switch: stable and canary swapped); a key's content
        is fixed while it is registered or held."""
        name, version = split_key(key)
        if weights is None and loader is None:
            raise ValueError(f"{key}: give weights or a loader")
        started = time.perf_counter()
        image = self._pack(weights) if weights is not None else None
        if loader is None:  # re-read from the adapter's directory if it has one, else the caller's CPU copy
            loader = getattr(weights, "reload", None) or (lambda: weights)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.retired and self._drop_if_unused(entry):
                entry = None
            if entry is not None:
                if image is not None and entry.digest is not None and image.digest != entry.digest:
                    if entry.replaced:
                        raise ValueError(
                            f"{key} is still in use by requests in flight with the weights it was registered "
                            f"with before; register the new weights as another version, or again once those "
                            f"requests finished")
                    raise ValueError(
                        f"{key} is already registered with different weights; register them as a new "
                        f"version (name@other-version) so no request is served stale weights"
                    )
                if not entry.retired:
                    entry.retire_pending = None  # registered again before the requests that held it came back
                    pinned = entry.pinned = entry.pinned or pinned
                    # Registered again from another place (a push that moved the version's folder): later
                    # loads read from there, as the old one may be gone (a reload is held to the digest).
                    entry.loader, entry.hung = loader, None  # a read stuck on the old place holds nothing back
                    if entry.image is None and image is not None:
                        self._set_image(entry, image)
                else:  # retired but still held (a quick rollback): the same weights come back, for the new owner
                    entry.retired, entry.loader, entry.pinned, entry.retire_pending = False, loader, pinned, None
                self._set_tenant(entry, tenant)  # its owner may have changed: the GPU quota is charged to it
            else:
                entry = AdapterEntry(key, name, version, tenant, loader, pinned=pinned)
                self._entries[key] = entry
                if image is not None:
                    self._set_image(entry, image)
                    self._loaded_from_disk(entry, read_seconds + time.perf_counter() - started)
            if entry.pinned:
                self._pinned_keys.add(key)
            if name not in self._current:
                self._current[name] = key
            elif make_current and self._current[name] != key:
                self._make_pending(entry, keep=keep_previous)
            elif make_current and (loading := self._pending.pop(name, None)) not in (None, key):
                self._kept.pop(name, None)
                self._retire(self._entries[loading])  # it stays current: the version loading to replace it goes
            elif not make_current and self._current[name] == key and name in self._pending:
                self._kept[name] = key  # the old stable version is the new one's canary: kept at the switch
            if pinned:
                self._want(entry)
            self._update_gauges()

    def make_current(self, key: str, *, if_resident: bool = False, keep_previous: str | None = None) -> bool:
        """Make the registered `key` its name's current version now (a canary promoted to stable):
        `resolve(name)` answers it from this call on. The previous current version retires as when a
        new version replaces it: requests holding it finish on it, then it is dropped, and no new
        request resolves to it. A different version still loading to become current is retired too.
        if_resident: only if `key` is on the GPU; else it becomes current once it is, as a new version
        added as current does (the current one serves, and is kept if registered again as a canary, until
        then), its weights not read again. keep_previous: the key that stays registered instead of retiring if it
        is the current version at the switch (the new one's canary: stable and canary swapped; decided then,
        under the pool's lock, not on what the caller saw earlier). True if `key` is current now. Raises
        AdapterNotFoundError for a key that is not registered."""
        with self._lock:
            entry = self._get(key)
            # Checked and switched under one lock: the engine thread cannot evict it in between.
            if if_resident and not entry.resident and self._current.get(entry.name) != key:
                self._make_pending(entry, keep=keep_previous)
                self._update_gauges()
                return False
            self._kept.pop(entry.name, None)
            pending = self._pending.pop(entry.name, None)
            if pending is not None and pending != key:
                self._retire(self._entries[pending])
            if keep_previous is not None:
                self._kept[entry.name] = keep_previous
            self._switch(entry)
            self._update_gauges()
            return True

    def resolve(self, name_or_key: str) -> str:
        """`name` -> current `name@version`; a full key is checked and returned."""
        with self._lock:
            self._advance()  # a finished load of a new version switches here, before anyone resolves
            if "@" in name_or_key:
                entry = self._entries.get(name_or_key)
                if entry is None or entry.replaced:
                    raise AdapterNotFoundError(f"adapter {name_or_key!r} is not registered")
                return name_or_key
            key = self._current.get(name_or_key)
            if key is None:
                raise AdapterNotFoundError(f"adapter {name_or_key!r} is not registered")
            return key

    def unregister(self, name: str) -> None:
        """Remove every version of `name`; versions in use are dropped when their last reference goes."""
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.name == name]
            if not keys:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            self._current.pop(name, None)
            self._pending.pop(name, None)
            self._kept.pop(name, None)
            for key in keys:
                self._retire(self._entries[key], reason="unregister")
            self._update_gauges()

    def remove(self, key: str) -> None:
        """Remove one version (dropped when unused). The current version cannot be removed this way."""
        with self._lock:
            entry = self._get(key)
            if self._current.get(entry.name) == key:
                raise ValueError(f"{key} is the current version of {entry.name}; unregister the name instead")
            if self._pending.get(entry.name) == key:
                del self._pending[entry.name]
                self._kept.pop(entry.name, None)
            self._retire(entry, reason="unregister")
            self._update_gauges()

    # ---- internals -----------------------------------------------------------------------------
    def _get(self, key: str) -> AdapterEntry:
        entry = self._entries.get(key)
        if entry is None or entry.replaced:
            raise AdapterNotFoundError(f"adapter {key!r} is not registered")
        return entry

    def _make_pending(self, entry: AdapterEntry, keep: str | None = None) -> None:
        """`entry` replaces its name's current version once resident (now, if it is); a different version
        loading to replace it retires. The current version is kept registered at the switch if it is `keep`
        then, or if registered again as a canary after this."""
        old_pending = self._pending.get(entry.name)
        self._pending[entry.name] = entry.key
        self._kept.pop(entry.name, None)
        if keep is not None:
            self._kept[entry.name] = keep
        if old_pending is not None and old_pending != entry.key:
            self._retire(self._entries[old_pending])
        if entry.resident:
            self._switch(entry)
        else:
            self._want(entry)

    def _switch(self, entry: AdapterEntry) -> None:
        """Atomic version switch: one assignment under the lock; the old version retires, unless it was
        registered again as a canary while this one loaded (`_kept`): then it stays registered."""
        old_key = self._current.get(entry.name)
        self._current[entry.name] = entry.key
        self._pending.pop(entry.name, None)
        kept = self._kept.pop(entry.name, None)
        if old_key is not None and old_key not in (entry.key, kept):
            self._retire(self._entries[old_key], reason="version")

    def _retire(self, entry: AdapterEntry, reason: str = "version") -> None:
        """No new request resolves to it; requests that wait for its copy still get it, and it is dropped as
        soon as none does (`_drop_if_unused`: here, on release, on abandon). While requests hold it or gave it
        back to take it again later (`detached`: a running request the scheduler lets go of), it only stops
        being pinned or warm: it can leave the GPU and be read again for them, and retires once the last of
        them finishes on it or goes (`release`, `reattached`)."""
        if entry.retired:  # retired already (held by requests that took it): it goes once they are done
            return
        entry.pinned = False  # pinning holds the version being served: a retired one goes once unused
        self._warm.pop(entry.key, None)  # ...and is never brought back to the GPU (adapter_warmth.py)
        if entry.detached or entry.refcount > 0:
            entry.retire_pending = reason
            return
        entry.retired, entry.retire_reason, entry.retire_pending = True, reason, None
        self._wanted.pop(entry.key, None)
        entry.loader = None  # never reloaded: drops the caller's CPU copy with it
        if entry.image is not None and entry.copying is None:
            self._evict_cpu(entry, reason)
        if not entry.on_gpu:
            self._drop(entry, reason=reason)
        else:
            self._drop_if_unused(entry)

    def _drop_if_unused(self, entry: AdapterEntry) -> bool:
        """Drop a retired `entry` that nothing holds: no reference, no copy in flight (its end drops it), no
        queued request it was loaded for. True if it was dropped."""
        if not entry.retired or entry.refcount > 0 or entry.copying is not None or entry.waiters:
            return False
        self._drop(entry, reason=entry.retire_reason)
        return True

    def reattached(self, entry: AdapterEntry, waiter: object) -> None:
        """`waiter`, which gave `entry` back (detached), took it again or went away: a retirement that waited
        for the last such request happens now."""
        entry.detached.discard(waiter)
        if not entry.detached and entry.retire_pending is not None:
            self._retire(entry, entry.retire_pending)
