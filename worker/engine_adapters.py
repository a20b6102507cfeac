"""EngineAdapters: the engine's adapter registry as the HTTP layer's `ServedAdapters` uses it.

Thin and explicit: each verb calls `Engine` or its `AdapterPool`. A canary is registered beside the
current version (`make_current=False`) and promoted with `make_adapter_current`, which retires the
previous stable version. The current version registered as a canary while a new stable version loads
(stable and canary swapped) stays registered once the new one is current (worker/adapter_versions.py).
"""

from __future__ import annotations

from typing import Any

from lorafleet.worker.adapter_entry import AdapterNotFoundError
from lorafleet.worker.engine import Engine, EngineError


class EngineAdapters:
    def __init__(self, engine: Engine, base_model: str | None = None) -> None:
        self.engine = engine
        self.pool = engine.adapter_pool
        self.base_model = base_model  # the name requests use for the base model: no adapter may take it

    def register_adapter(self, name: str, source: str, *, version: str | None = None, tenant: str | None = None,
                         pinned: bool = False, make_current: bool = True, sha256: str | None = None,
                         keep_previous: str | None = None) -> str:
        """Validate and register a local PEFT directory as `name@version` (its files must hash to `sha256`
        when given); returns the key. The base model's name is refused: requests naming it get the base
        model, so such an adapter could never be called."""
        if name == self.base_model:
            raise EngineError(f"adapter name {name!r} is the served model name of the base model; give the "
                              "adapter another name")
        return self.engine.register_adapter(name, source, version, tenant=tenant or "default", pinned=pinned,
                                            make_current=make_current, sha256=sha256, keep_previous=keep_previous)

    def make_adapter_current(self, key: str, *, if_resident: bool = False, keep_previous: str | None = None) -> bool:
        """Make the registered `key` its name's current version; the previous one retires (keep_previous: that
        key, if it is the previous one at the switch, stays registered, the new one's canary). if_resident: only
        now if it is on the GPU, else once it is (the pool checks and switches under its lock). True if `key` is
        current now."""
        try:
            return self.pool.make_current(key, if_resident=if_resident, keep_previous=keep_previous)
        except AdapterNotFoundError as exc:
            raise KeyError(str(exc)) from None

    def unregister_adapter(self, name: str) -> None:
        try:
            self.engine.unregister_adapter(name)
        except EngineError as exc:
            raise KeyError(str(exc)) from None

    def remove_adapter_version(self, key: str) -> None:
        try:
            self.pool.remove(key)
        except AdapterNotFoundError as exc:
            raise KeyError(str(exc)) from None

    def set_adapter_pinned(self, key: str, pinned: bool) -> None:
        if pinned:
            self.pool.pin(key)
        else:
            self.pool.unpin(key)

    def set_adapter_priority(self, key: str, priority: int) -> None:
        self.pool.set_priority(key, priority)

    def set_adapter_tenant(self, key: str, tenant: str) -> None:
        """`key` now belongs to `tenant`: its GPU quota is charged to it (the pool's `set_tenant`)."""
        self.pool.set_tenant(key, tenant or "default")

    def set_adapter_warm(self, key: str, warm: bool) -> None:
        """Keep `key` GPU-resident when room allows (a directive's `warm`), or stop."""
        self.pool.set_warm(key, warm)

    def prefetch_adapter(self, key: str) -> None:
        self.pool.prefetch(key, "gpu")

    def describe_adapters(self) -> list[dict[str, Any]]:
        return self.pool.describe()

    def configure_pool(self, *, eviction: str | None, cpu_bytes: int | None) -> None:
        """The pool-wide settings a push carries; None = the worker's own."""
        self.pool.configure(eviction_policy=eviction, cpu_budget_bytes=cpu_bytes)

    def pool_stats(self) -> dict[str, Any]:
        return self.pool.stats()
