"""ServedAdapters: which adapter names and versions this worker serves, to whom, and in what split.

It is the HTTP layer's view of the registry: the admin push (`DesiredState`) and the vLLM-style load/unload
change it; every inference request resolves its `model` through it. The engine's adapter pool holds the
weights; this holds names, owners (tenants), the stable/canary split and the reason a version failed to load,
so a request for it is answered 503 with that reason instead of waiting. A request resolves to one full key
`name@version` once, on arrival: it keeps that version to the end even if a push switches the stable version
meanwhile (hot update). A push's pool-wide settings (eviction policy, CPU tier budget) go to the engine's pool
when they differ from the last push's; a push without them gives the pool back its own. A directive's `warm`
prefetches its versions and marks them warm in the pool, which brings them back to the GPU by itself after
pressure evicted them (worker/adapter_warmth.py); a push without it unmarks them.

Running example: push gen 3 {sql: stable v1}, then gen 4 {sql: stable v1, canary v2 at 20 %}: v2 is registered
beside v1 (not current), 20 % of users resolve to `sql@v2`; gen 5 {sql: stable v2} makes the registered v2
current without reloading it and retires v1 (once the new table is published; a v2 that never loaded, no user
having reached it, is made current as a new stable version is, below); gen 6 without `sql` unregisters it,
requests in flight finish on the version they hold.

A new stable version that was never a canary (gen 7 {sql: stable v3}) replaces v2 in the engine only once it
has loaded; until then v2 stays in the table as the fallback: if v3 fails to load (`mark_failed`), bare `sql`
requests go back to v2, as a failed canary's users go back to stable. The first push after v3 has loaded
retires v2.

Stable and canary swapped in one push (gen 8 {sql: stable v4, canary v3 at 10 %} after {sql: stable v3, canary
v4 at 10 %}), or a new stable v4 rolled out with v3 kept as its canary: a v4 resident on the GPU becomes
current at once, v3 staying registered (and on the GPU) as the canary. A v4 not on the GPU (only in CPU
memory, which may never fit there, or not loaded) becomes current as a new stable version does, once resident:
v3 stays the engine's current version and the fallback until then, its canary after (a v3 that cannot be
registered again, its files gone, leaves the engine). The split is already the new one: the canary share is
served by v3, the rest waits for v4's load, as after gen 7; if v4 fails to load, every user goes back to v3. A
push before v4 has loaded that no longer names v3 as the canary makes v4 current again, so that v3 retires at
the switch (worker/served_fallback.py). A canary promoted to stable switches at once only if it is resident on
the GPU too, at the switch, checked in the same step (the pool's lock): a directive earlier in the push, or
the engine, may have evicted it since the push began.

A local `--adapters DIR` folder that failed to load at start-up (worker/adapter_dir.py) is reported the way a
pushed version that failed is: an entry of the state's `adapters` with its `error`, its version `unstaged` (as
the stager's seed reports a folder it could not stage: no version of it exists), tier `none` (one whose folder
name is no adapter name is listed only in the state's `startup` section: worker/admin_api.py). It is not
served (a request for it is 404, as for any name not served). It is reported until a push replaces the
start-up set (from then on the directives rule) or a load_lora_adapter of that name succeeds.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.adapter_host import AdapterHost
from lorafleet.worker.canary import CanaryResolver, VersionSplit
from lorafleet.worker.directives import (
    UNSTAGED,
    AdapterDirective,
    AdapterState,
    DesiredState,
    ReportedState,
    is_name,
)
from lorafleet.worker.openai_protocol import APIError
from lorafleet.worker.served_fallback import (
    cut_source_folders,
    drop_gone,
    drop_kept_canary,
    drop_unserved_failures,
    drops_kept,
    fall_back,
    gpu_resident,
    keep_fallback,
    keep_registered,
    keep_serving,
    listed_versions,
    loaded_over,
    make_current_again,
    replay_failures,
    served_loaded,
    unregister,
)
from lorafleet.worker.tenant_folders import local_source
from lorafleet.worker.tenants import Tenant

log = logging.getLogger(__name__)
_KEY_RE = re.compile(r"\b([A-Za-z0-9][A-Za-z0-9._-]*)@([A-Za-z0-9._-]*[A-Za-z0-9_-])")  # name@version in a message


class VersionUnavailable(APIError):
    """503: the version `key` the request resolved to failed to load (its request series count it)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(503, message, type="service_unavailable", code="adapter_load_failed", param="model",
                         headers={"x-should-retry": "false"})  # it cannot load by itself: no client retry helps
        self.key = key


@dataclass(slots=True)
class ServedAdapter:
    name: str
    tenant: str | None  # owner; None = only tenants whose key-file patterns match may use it
    split: VersionSplit
    sources: dict[str, str] = field(default_factory=dict)  # version -> local path
    errors: dict[str, str] = field(default_factory=dict)  # version -> why it cannot be served
    refused: dict[str, str] = field(default_factory=dict)  # version -> why a push's new source for it was not used
    warm: bool = False
    pinned: bool = False
    fallback: str | None = None  # the stable version a new one replaces, kept until the new one has loaded


class ServedAdapters:
    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self.generation = 0
        self.resolver = CanaryResolver()
        self._adapters: dict[str, ServedAdapter] = {}
        self._refused: dict[str, str] = {}  # the push being applied's versions whose source was refused
        self.settings: tuple[str | None, int | None] = (None, None)  # pushed (eviction, cpu_bytes); None: own
        self.startup_errors: dict[str, str] = {}  # start-up folder -> why it is not served (see the module doc)
        self.pushed: DesiredState | None = None  # the last push as sent, while the table is its (admin_api.py)
        self._engine: AdapterHost | None = None  # the one apply() changed: mark_failed asks it about a fallback

    # ---- queries --------------------------------------------------------------------------------
    def get(self, name: str) -> ServedAdapter | None:
        return self._adapters.get(name)

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def served_versions(self) -> dict[str, set[str]]:
        """Each name's versions in the table (stable, canary, a fallback kept while its successor loads)."""
        return {name: set(a.sources) for name, a in self._adapters.items()}

    def visible_to(self, tenant: Tenant) -> list[ServedAdapter]:
        return [a for _, a in sorted(self._adapters.items()) if tenant.may_use(a.name, a.tenant)]

    def resolve(self, model: str, tenant: Tenant, user: str | None) -> str | None:
        """The engine key (`name@version`, None for the base model) that serves `model` for this
        caller; raises APIError 404 (unknown, or another tenant's: the same answer, so that a caller
        cannot learn which adapter names other tenants have), 403 (the base model, to a tenant without
        it) or 503 (failed to load)."""
        if model == self.base_model:
            if not tenant.may_use(None):
                raise APIError(403, f"tenant {tenant.name!r} may not call the base model {model!r}; name one of "
                                    "your adapters (GET /v1/models)", type="permission_error",
                               code="model_not_allowed", param="model")
            return None
        name, at, version = model.partition("@")
        served = self._adapters.get(name)
        if served is None or not tenant.may_use(name, served.tenant) or at and not version:  # `name@`: no version
            raise APIError(404, f"The model `{model}` does not exist on this worker (GET /v1/models lists the "
                                "ones you may use)", type="invalid_request_error", code="model_not_found",
                           param="model")
        if not version:
            version = self.resolver.pick(name, served.split, user)
        if version not in served.sources or version == served.fallback and version not in listed_versions(served, self._engine):
            raise APIError(404, f"adapter {name!r} has no version {version!r} here (versions: "
                                f"{', '.join(listed_versions(served, self._engine))})", code="model_not_found", param="model")
        if version in served.errors:
            raise VersionUnavailable(f"{name}@{version}",
                                     f"adapter {name}@{version} failed to load: {self.redact(served.errors[version], tenant)}")
        return f"{name}@{version}"

    def redact(self, message: str, tenant: Tenant) -> str:
        """`message` without the `name@version` of adapters that `tenant` may not use: an engine error
        about the caller's request (e.g. which pinned adapters hold every slot) must not tell one tenant
        the names of another's adapters; and without the folders above each local source (a load error names
        the file it read: those folders are the worker's disk, cache and tenant-folder layout)."""
        def hide(m: re.Match) -> str:
            served = self._adapters.get(m[1])
            owner = served.tenant if served is not None else None
            return m[0] if tenant.may_use(m[1], owner) else "another tenant's adapter"

        return cut_source_folders(_KEY_RE.sub(hide, message), self._adapters)

    def mark_failed(self, key: str, reason: str) -> None:
        name, _, version = key.partition("@")
        served = self._adapters.get(name)
        if served is not None and version in served.sources:
            served.errors[version] = reason
            split = served.split
            if version == split.canary:  # its share of users goes back to the stable version
                served.split = VersionSplit(split.stable)
            elif version == split.stable and served.fallback not in (None, *served.errors):  # ...a new stable's, to the old
                fall_back(served, self._engine)

    # ---- changes (blocking engine calls: run them off the event loop, one at a time) -------------
    # Copy-on-write: a change registers what is new in the engine, then publishes the new table in one assignment,
    # then retires what is gone. A request never sees a name or version that the engine does not hold yet, and
    # the event loop can read the table while a change runs.
    def adopt(self, engine: AdapterHost, failed: dict[str, str] | None = None) -> None:
        """Take over the adapters the engine registered at start-up (`--adapters DIR`), and report those
        of its folders that failed to load (`failed`: folder name -> why)."""
        table = dict(self._adapters)
        for d in engine.describe_adapters():
            if d.get("current") and d["name"] not in table:
                table[d["name"]] = ServedAdapter(d["name"], None, VersionSplit(d["version"]),
                                                 {d["version"]: d.get("source", "")})
        self._adapters = table
        self.startup_errors = {name: why for name, why in (failed or {}).items() if name not in table}

    def apply(self, state: DesiredState, engine: AdapterHost, refused: dict[str, str] | None = None) -> bool:
        """Make the served set equal `state`. False when it was already applied (same generation);
        APIError 409 for an older generation. Versions that fail to load are recorded, not raised, and so are
        those whose source the admin API refused (`refused`: name@version -> why): each is that version's failure."""
        if state.generation == self.generation and self.generation > 0:
            return False
        if state.generation < self.generation:
            raise APIError(409, f"generation {state.generation} is older than the applied generation "
                                f"{self.generation}; refusing to roll back", code="stale_generation")
        self._engine, self._refused = engine, refused or {}
        settings = (state.eviction, state.cpu_bytes)
        if settings != self.settings:  # first: what this push registers loads under the new settings
            engine.configure_pool(eviction=state.eviction, cpu_bytes=state.cpu_bytes)
            self.settings = settings
        old_table = self._adapters
        promoted: list[tuple[ServedAdapter, str, str | None]] = []  # canaries that become stable (and sha256)
        held = engine.describe_adapters()  # what a swap of stable and canary may switch to now, and what serves
        loaded, current_keys = gpu_resident(held), {a["key"] for a in held if a.get("current")}
        registered = {a["key"] for a in held if not a.get("retired")}  # a retired one requests still hold: not
        seen: set[str] = set()  # keys found failed when the push handled them (replay_failures)
        table = {d.name: self._register(d, old_table.get(d.name), engine, promoted, loaded, current_keys, registered,
                                        seen) for d in state.adapters}
        held = engine.describe_adapters()
        serving = {a["name"]: a["version"] for a in held if a.get("current")}
        loaded = gpu_resident(held)
        # A promoted canary resident on the GPU switches at once; one that is not (no user reached it, or it was
        # evicted) is made current as a new stable version is, once loaded, the old one the fallback meanwhile.
        switch = [(s, v) for s, v, _ in promoted if f"{s.name}@{v}" in loaded]
        current = serving | {served.name: version for served, version in switch}
        for name, served in table.items():
            if name in old_table:
                keep_fallback(served, old_table[name], current.get(name))
        self._adapters = table
        replay_failures(old_table, table, seen, self.mark_failed)
        # Only now: the switch retires the old stable version, which the table published until now still sends
        # bare requests to (they would fail for the rest of the push).
        for served, version, sha256 in promoted:
            if version in served.errors:  # failed meanwhile (replayed): not made current
                continue
            key = f"{served.name}@{version}"
            try:
                if key in loaded:  # unless evicted since: then current once resident, the old one the fallback
                    if not engine.make_adapter_current(key, if_resident=True):
                        keep_fallback(served, old_table[served.name], serving.get(served.name))
                else:
                    engine.register_adapter(served.name, local_source(served.sources[version]), version=version,
                                            tenant=served.tenant, pinned=served.pinned, make_current=True,
                                            sha256=sha256)
            except (ValueError, KeyError, OSError, RuntimeError) as exc:  # as a version that failed to load:
                log.warning("adapter %s cannot be made current: %s", key, exc)  # back to the fallback, if any
                self.mark_failed(key, str(exc) or type(exc).__name__)
        self.generation = state.generation
        self.startup_errors = {}  # the directives rule from now on: what the push failed is its own report
        drop_unserved_failures(table, engine)
        drop_gone(old_table, table, engine)
        return True

    def _register(self, d: AdapterDirective, old: ServedAdapter | None, engine: AdapterHost,
                  promoted: list[tuple[ServedAdapter, str, str | None]], loaded: set[str],
                  current: set[str], held: set[str], seen: set[str]) -> ServedAdapter:
        versions = {d.stable.version: d.stable.uri}
        digests = {d.stable.version: d.stable.sha256}  # the files must hash to it (None: not checked)
        if d.canary is not None:
            versions[d.canary.version] = d.canary.uri
            digests[d.canary.version] = d.canary.sha256
        served = ServedAdapter(d.name, d.tenant, VersionSplit(d.stable.version), warm=d.warm, pinned=d.pinned)
        # The old stable version stays as the canary (stable and canary swapped, or a new stable version with
        # the old one kept as its canary); it is registered again as the canary after the new stable version.
        demoted = old.split.stable if old is not None and old.split.stable != d.stable.version else None
        if demoted not in versions:
            demoted = None
        # Kept at the switch if the engine serves it then (not while a rollout to it still loads): the pool decides.
        keeps = f"{d.name}@{demoted}" if demoted is not None else None
        fallback = False
        for version, uri in versions.items():
            stable = version == d.stable.version
            key = f"{d.name}@{version}"
            failed = old is not None and version in old.errors  # read once: the event loop may write it any time
            if failed:
                seen.add(key)  # handled below (registered again: a retry); one failing from now on is replayed
            # Registered as is; not the old fallback as the canary: the engine retires it once its successor loaded
            # (and once it has, a rollback to it registers it again: the table lists it until this push).
            keep = (old is not None and old.sources.get(version) == uri and not failed
                    and version != demoted and (stable or version != old.fallback) and key in held)
            # The stable version of a swap (module doc): switched now if on the GPU, else registered as current.
            swap = stable and demoted is not None
            if swap and key not in loaded:
                keep = False
            # A version kept registered beside the stable one (a canary) that now becomes stable. One registered
            # again (it had failed) switches in the engine once loaded, like a new version.
            is_promoted = stable and keep and version != old.split.stable and not swap
            for again in (False, True):
                registered = keep
                try:
                    if key in self._refused and not keep:  # one served from that source stays (its weights are held)
                        raise ValueError(self._refused[key])
                    source = local_source(uri)
                    if not keep:
                        engine.register_adapter(d.name, source, version=version, tenant=d.tenant, pinned=d.pinned,
                                                make_current=stable, sha256=digests[version], keep_previous=keeps)
                    elif stable and old is not None and drops_kept(d, old, current):
                        make_current_again(engine, d.name, d.stable.version)  # the old one retires at the switch
                    registered = True
                    if swap and keep:
                        # On the GPU when the push began; if a directive before evicted it, current once resident.
                        # The old one stays registered, on the GPU, as the canary (registered again below as such):
                        # the table published until this push ends still sends most users to it.
                        engine.make_adapter_current(key, if_resident=True, keep_previous=keeps)
                    elif is_promoted:
                        promoted.append((served, version, digests[version]))  # switched once the table is published
                    if keep and old.tenant != d.tenant:  # a new owner: the pool charges its GPU quota to it
                        engine.set_adapter_tenant(key, d.tenant)
                    engine.set_adapter_pinned(key, d.pinned)
                    engine.set_adapter_priority(key, d.priority)
                    engine.set_adapter_warm(key, d.warm)  # brought back after pressure evicted it, or no longer
                    if d.warm:  # displacing only lower ranks (a canary: cold or lower-priority adapters)
                        engine.prefetch_adapter(key)
                except Exception as exc:  # whatever it is, it is this version's: the rest of the push applies
                    if not registered and keep_registered(served, old, version, uri, key in held, exc):
                        break  # served on from where it was registered; the refusal is reported
                    if keep and not again and isinstance(exc, KeyError):
                        # Dropped by the engine since the push looked (its successor switched meanwhile and no
                        # request held it any more): registered again, as a version the engine does not hold.
                        keep = is_promoted = False
                        continue
                    served.errors[version] = str(exc) or type(exc).__name__
                    log.warning("adapter %s@%s cannot be served: %s", d.name, version, exc,
                                exc_info=not isinstance(exc, ValueError | KeyError | OSError | RuntimeError))
                    if stable and not registered:  # the engine still holds the version serving until now
                        fallback = True
                break
            served.sources.setdefault(version, uri)  # set already where keep_registered kept the old source
        if keeps is not None and demoted in served.errors and d.stable.version not in served.errors:
            drop_kept_canary(engine, d.name, d.stable.version, demoted)
        if d.canary is not None and d.canary.version not in served.errors and d.stable.version not in served.errors:
            served.split = VersionSplit(d.stable.version, d.canary.version, d.canary_weight)
        elif fallback and old is not None:
            keep_serving(served, old)
        return served

    def load(self, name: str, path: str, engine: AdapterHost, sha256: str | None = None, inplace: bool = False) -> str:
        """vLLM's load_lora_adapter: register `name` from a local path (its files hashing to `sha256`, when
        given); answers `name@version`. `inplace` (vLLM's load_inplace): see served_fallback.loaded_over."""
        old = loaded_over(self._adapters.get(name), name, inplace, self.base_model)
        try:
            key = engine.register_adapter(name, local_source(path), sha256=sha256, tenant=old and old.tenant,
                                          pinned=bool(old and old.pinned))
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            raise APIError(400, f"cannot load adapter {name!r} from {path}: {exc}", code="adapter_invalid",
                           param="lora_path") from None
        if old is not None and old.warm:  # kept warm as the version it replaces was
            engine.set_adapter_warm(key, True)
        self._adapters = {**self._adapters, name: served_loaded(name, key.partition("@")[2], path, old)}
        self.startup_errors = {n: why for n, why in self.startup_errors.items() if n != name}
        return key

    def unload(self, name: str, engine: AdapterHost) -> None:
        if name not in self._adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", code="model_not_found",
                           param="lora_name")
        self._adapters = {n: a for n, a in self._adapters.items() if n != name}
        unregister(name, engine)

    # ---- report ---------------------------------------------------------------------------------
    def report(self, engine: AdapterHost) -> ReportedState:
        held = {d["key"]: d for d in engine.describe_adapters()}
        states: list[AdapterState] = []
        for name, served in sorted(self._adapters.items()):
            for version in sorted(served.sources):
                if version == served.fallback and f"{name}@{version}" not in held:
                    continue  # the engine retired it: the version replacing it has loaded
                d = held.get(f"{name}@{version}", {})
                error = served.errors.get(version) or served.refused.get(version) or d.get("error")
                states.append(AdapterState(
                    name=name, version=version, tier=d.get("tier", "none"), refcount=d.get("refcount", 0),
                    hits=d.get("hits", 0), bytes=d.get("bytes", 0), pinned=bool(d.get("pinned", served.pinned)),
                    error=error, traffic_percent=served.split.percent_of(version),
                ))
        reported = {(a.name, a.version) for a in states}
        for d in held.values():  # versions on their way out that requests in flight hold (or will take again)
            if d.get("holders", d.get("refcount", 0)) > 0 and (d["name"], d["version"]) not in reported:
                states.append(AdapterState(name=d["name"], version=d["version"], tier=d.get("tier", "none"),
                                           refcount=d["refcount"], hits=d.get("hits", 0), bytes=d.get("bytes", 0),
                                           pinned=bool(d.get("pinned", False)), traffic_percent=0))
        for name, why in sorted(self.startup_errors.items()):  # start-up folders that did not load
            if is_name(name):  # one named unlike an adapter is only in the state's "startup" (admin_api.py)
                states.append(AdapterState(name=name, version=UNSTAGED, tier="none", error=why, traffic_percent=0))
        return ReportedState(generation_applied=self.generation, adapters=states)

    def extras(self) -> dict[str, dict[str, Any]]:
        """Worker-only keys of the state report, per `name@version`."""
        out = {}
        for name, served in self._adapters.items():
            for version in served.sources:
                out[f"{name}@{version}"] = {"tenant": served.tenant,
                                            "traffic_percent": served.split.percent_of(version)}
        for name in self.startup_errors:
            out.setdefault(f"{name}@{UNSTAGED}", {"tenant": None, "traffic_percent": 0})
        return out

