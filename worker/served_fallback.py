"""The fallback: the stable version a new one replaces, served while the new one loads (ServedAdapters).

The engine makes a new stable version current only once it is resident on the GPU; until then it keeps the
version serving until now, and so does the served table, as the `fallback` that a failed load sends users
back to (`ServedAdapters.mark_failed`). What a push may switch at once is only what is GPU-resident: a copy
in CPU memory may never fit on the GPU (more pages than the pool lets an adapter have), and switching to it
would retire the one version that serves.

Running example (stable and canary swapped, worker/served_adapters.py): {sql: stable v1, canary v2}, then
{sql: stable v2, canary v1} with v2 not resident: v2 loads to become current, v1 is registered again as its
canary, so the engine keeps it registered at the switch (worker/adapter_versions.py). A push meanwhile that
no longer names v1 as the canary ({sql: stable v2}, or {sql: stable v2, canary v3}) makes v2 current again
(its files not read again): the engine then retires v1 at the switch instead of keeping it, its GPU slot and its pinned or warm
flags with it.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from lorafleet.worker.adapter_host import AdapterHost
from lorafleet.worker.canary import VersionSplit
from lorafleet.worker.directives import AdapterDirective
from lorafleet.worker.openai_protocol import APIError

if TYPE_CHECKING:
    from lorafleet.worker.served_adapters import ServedAdapter

log = logging.getLogger(__name__)
_BOUNDS_TEXT = ((re.compile(r"resolves to [^,]*,"), "resolves to a folder"),
                (re.compile(r"outside the allowed local roots \([^)]*\)"), "outside the allowed local roots"),
                (re.compile(r"inside [^,]*, where other tenants' folders lie"),
                 "inside a folder where other tenants' folders lie"))


def gpu_resident(held: list[dict[str, Any]]) -> set[str]:
    """Keys of the versions resident on the GPU, without a load error: those a push may switch to at once."""
    return {a["key"] for a in held if a.get("tier") == "gpu" and not a.get("error")}


def drops_kept(d: AdapterDirective, old: ServedAdapter, current: set[str]) -> bool:
    """True when `d` keeps `old`'s stable version, still loading to replace the fallback that the engine
    keeps as its canary (`current`: the engine's current keys), but names that fallback no longer as the
    canary: the stable version must be made current again, so the switch retires the fallback."""
    kept = old.fallback
    if kept is None or kept != old.split.canary or f"{d.name}@{kept}" not in current:
        return False
    return d.stable.version == old.split.stable and (d.canary is None or d.canary.version != kept)


def make_current_again(engine: AdapterHost, name: str, stable: str) -> None:
    """Make `name@stable` current again, keeping nothing at the switch (see `drops_kept`, `drop_kept_canary`),
    without reading its files again. A failure changes nothing that serves: the version stays registered and
    loading, the fallback stays registered after the switch."""
    try:
        engine.make_adapter_current(f"{name}@{stable}", if_resident=True)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        log.warning("adapter %s@%s: making it current again failed (%s); the version it replaces stays registered "
                    "after the switch until the name is pushed again", name, stable, exc)


def keep_serving(served: ServedAdapter, old: ServedAdapter) -> None:
    """A new stable version that failed to register leaves the one serving until now in place (the
    engine still holds it as current: only a registered new version replaces it), so a bad rollout is
    reported (the failed version's error) instead of answering every request 503. Not for a name given to
    another tenant: the old owner's weights never answer the new one, who gets the failure (503)."""
    previous = old.split.stable
    if previous == served.split.stable or previous in old.errors or old.tenant != served.tenant:
        return
    if served.sources.get(previous, old.sources[previous]) != old.sources[previous] or previous in served.errors:
        return  # pushed again from another source, or failed itself: not what was serving
    served.sources[previous] = old.sources[previous]
    served.split = VersionSplit(previous)


def keep_registered(served: ServedAdapter, old: ServedAdapter | None, version: str, uri: str, held: bool,
                    exc: BaseException) -> bool:
    """Whether `version` keeps being served from the source it was registered from when a push names it with
    another that could not be registered (other weights under the same version, a folder missing or refused):
    so while the engine holds it for the same owner and it did not fail; the refusal is noted in
    `served.refused` (the state report's error for it). Else the version fails. A refused change had marked a
    version that serves failed, and its requests were answered 503."""
    before = old.sources.get(version) if old is not None else None
    if before is None or before == uri or not held or old.tenant != served.tenant or version in old.errors:
        return False
    served.sources[version] = before
    served.refused[version] = f"not served from {uri}, kept from {before}: {exc or type(exc).__name__}"
    log.warning("adapter %s@%s keeps the weights registered from %s; the push's %s cannot be used: %s",
                served.name, version, before, uri, exc)
    return True


def keep_fallback(served: ServedAdapter, old: ServedAdapter, current: str | None) -> None:
    """A new stable version registered but not loaded yet: the engine keeps `current`, the version
    serving until now, until the new one is resident. The table keeps it too, as the fallback that
    `mark_failed` sends requests back to if the new one fails to load, instead of answering them all
    503 (also when it is the new one's canary: a swap). Once the engine has switched (the new version
    loaded), the next push retires it as usual, or keeps it as the canary. Not for a name given to another
    tenant: its requests wait for its own version, and never reach the old owner's (not even by naming it)."""
    if current is None or current == served.split.stable or old.tenant != served.tenant:
        return  # switched already (loaded, or a promoted canary), or another owner's
    if current not in (old.split.stable, old.fallback) or current in old.errors:
        return
    served.sources.setdefault(current, old.sources[current])  # or served as the canary (a swap) anyway
    served.fallback = current


def versions_still_served(served: ServedAdapter | None, ran_on: str) -> set[str]:
    """The versions of `served` whose request series stay after a request ran on `ran_on`: its table's,
    less a fallback (not the canary too) once a request ran on the stable version replacing it, which the
    engine has retired by then."""
    if served is None:
        return set()
    versions = set(served.sources)
    if served.fallback not in (None, ran_on, served.split.canary) and ran_on == served.split.stable:
        versions.discard(served.fallback)
    return versions


def still_held(engine: AdapterHost, key: str) -> bool:
    """Whether the engine still holds `key` registered (not retired): a fallback the table keeps until the next
    push is retired by the engine as soon as the version replacing it has loaded (a kept canary stays)."""
    return any(a["key"] == key and not a.get("retired") for a in engine.describe_adapters())


def cut_source_folders(message: str, table: dict[str, ServedAdapter]) -> str:
    """`message` with the folders above each local source of `table` cut: a load error names the file it read,
    under folders that are the worker's disk, cache and tenant-folder layout, which a tenant is not shown; so are
    the paths a source refused for lying out of bounds names (worker/tenant_folders.py: where it resolves to, the
    allowed roots, other tenants' regions)."""
    if "/" not in message:  # most errors (a context too long, a bad parameter) name no path: no pass over the table
        return message
    for served in table.values():
        for source in served.sources.values():
            path = source.removeprefix("file://").rstrip("/")
            if path.startswith("/") and (above := path.rpartition("/")[0] + "/") != "/" and above in message:
                message = message.replace(above, "")
    for pattern, said in _BOUNDS_TEXT:
        message = pattern.sub(said, message)
    return message


def listed_versions(served: ServedAdapter, engine: AdapterHost | None) -> list[str]:
    """The versions of `served` a request may name: its table's, less a fallback the engine retired (the stable
    version replacing it loaded) that the table keeps until the next push; it would be resolved only to be
    refused by the engine (AdapterHost: the engine the table was applied to)."""
    fallback = served.fallback
    gone = (fallback is not None and engine is not None and fallback not in (served.split.stable, served.split.canary)
            and not still_held(engine, f"{served.name}@{fallback}"))
    return sorted(v for v in served.sources if not (gone and v == fallback))


def fall_back(served: ServedAdapter, engine: AdapterHost | None) -> None:
    """The new stable version of `served` failed: its users go back to the old one (the fallback), unless the
    engine retired that, as it does once the new version has loaded (the table learns it at the next push):
    then nothing is left to go back to, and the failure is the answer (503), as without one."""
    split, fallback = served.split, served.fallback
    served.fallback = None
    if engine is None or still_held(engine, f"{served.name}@{fallback}"):
        swapped = split.canary == fallback  # the old one was its canary: now it takes all users
        served.split = VersionSplit(fallback, *(() if swapped else (split.canary, split.canary_weight)))
    else:
        served.sources.pop(fallback, None)  # gone from the engine: not reported, resolved or counted as served


def drop_unserved_failures(table: dict[str, ServedAdapter], engine: AdapterHost) -> None:
    """Remove from the engine the versions a push failed to register that no request reaches (not in their
    split, nor the fallback), yet the engine holds from an earlier registration: the old stable version kept
    as a swap's canary whose files are gone, a canary whose new files failed. They would keep their GPU slot
    and memory until a push no longer named them; their error stays reported."""
    unserved = [f"{served.name}@{version}" for served in table.values()
                for version in set(served.errors) - {served.split.stable, served.split.canary, served.fallback}]
    if not unserved:
        return  # the usual push: nothing to look up
    held = {a["key"]: a for a in engine.describe_adapters()}
    for key in unserved:
        if key in held and not held[key].get("current"):
            try:
                engine.remove_adapter_version(key)
            except (ValueError, KeyError) as exc:
                log.info("dropping %s, which failed: %s", key, exc)


def drop_kept_canary(engine: AdapterHost, name: str, stable: str, demoted: str) -> None:
    """A swap asked the engine to keep `demoted` (its old stable version) at the switch to `stable`, as the
    canary, which its registration failed to become (its files gone, say): it retires at the switch after all.
    Only while the engine still serves it and waits to switch (looked up now, not when the push began); once
    switched, the push's end drops it with its failures (`drop_unserved_failures`)."""
    current = {a["key"] for a in engine.describe_adapters() if a.get("current")}
    if f"{name}@{demoted}" in current:
        make_current_again(engine, name, stable)  # waits to switch, keeping nothing


def replay_failures(old_table: dict[str, ServedAdapter], table: dict[str, ServedAdapter], seen: set[str],
                    mark_failed) -> None:
    """Failures recorded while a push built `table` (a request's load failed, and `mark_failed` wrote to
    `old_table`, the one published then): recorded again on `table` for the versions it serves from the same
    source. `seen`: keys already failed when the push handled them, which it registered again (a retry)."""
    for name, served in table.items():
        old = old_table.get(name)
        for version, why in list(old.errors.items()) if old is not None else ():
            if (f"{name}@{version}" not in seen and version not in served.errors
                    and old.sources.get(version) == served.sources.get(version)
                    and old.tenant == served.tenant):  # a new owner: the old one's failure (its quota) is not its
                mark_failed(f"{name}@{version}", why)


def unregister(name: str, engine: AdapterHost) -> None:
    try:
        engine.unregister_adapter(name)
    except KeyError as exc:
        log.info("unregistering %s: %s", name, exc)


def drop_gone(old_table: dict[str, ServedAdapter], table: dict[str, ServedAdapter], engine: AdapterHost) -> None:
    """After a push: names it no longer serves leave the engine, and so do versions it no longer names."""
    for name, old in old_table.items():
        if name not in table:
            unregister(name, engine)
            continue
        for version in set(old.sources) - set(table[name].sources):
            try:
                engine.remove_adapter_version(f"{name}@{version}")
            except (ValueError, KeyError) as exc:  # e.g. still the engine's current version
                log.info("dropping %s@%s: %s", name, version, exc)


def loaded_over(old: ServedAdapter | None, name: str, inplace: bool, base_model: str | None) -> ServedAdapter | None:
    """What vLLM's load_lora_adapter of `name` replaces: None for a new name; `old`, the name's entry, with
    `inplace` (vLLM's load_inplace), as a push's new stable version replaces the one serving (its owner,
    pinning and warmth kept): requests move to the new weights once they have loaded, the old version serving
    meanwhile (`served_loaded`: the fallback) and the requests in flight finishing on it. A name with a canary is
    refused: which of the two the new weights replace would be a guess."""
    if name == base_model:
        raise APIError(400, f"adapter name {name!r} is the served model name of the base model; give the adapter "
                            "another name", code="adapter_exists", param="lora_name")
    if old is not None and not inplace:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded; unload it first, or replace its "
                            "weights with load_inplace.", code="adapter_exists", param="lora_name")
    if old is not None and old.split.canary is not None:
        raise APIError(400, f"adapter {name!r} serves a canary ({old.split.canary}); roll its versions out with a "
                            "push, not load_inplace", code="adapter_exists", param="lora_name")
    return old


def served_loaded(name: str, version: str, path: str, old: ServedAdapter | None) -> ServedAdapter:
    """The table's entry of `name@version` loaded from `path` over `old` (`loaded_over`)."""
    from lorafleet.worker.served_adapters import ServedAdapter  # the table's own module imports this one

    served = ServedAdapter(name, old and old.tenant, VersionSplit(version), {version: path},
                           warm=bool(old and old.warm), pinned=bool(old and old.pinned))
    if old is not None:
        keep_fallback(served, old, old.split.stable)  # none when the same weights came again
    return served
