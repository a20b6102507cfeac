"""EngineAdapters: the engine's adapter registry as the HTTP layer's `ServedAdapters` uses it.

Thin and explicit: each verb calls `Engine` or its `AdapterPool`. The one thing it adds is
registering a version *beside* the current one without making it current (a canary): the engine's
`register_adapter` always makes a new version current once resident, which would retire the stable
version under a canary split.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lorafleet.worker.adapter_entry import AdapterNotFoundError
from lorafleet.worker.engine import Engine, EngineError

log = logging.getLogger(__name__)


class EngineAdapters:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = engine.adapter_pool

    def register_adapter(self, name: str, source: str, *, version: str | None = None, tenant: str | None = None,
                         pinned: bool = False, make_current: bool = True) -> str:
        """Validate and register a local PEFT directory as `name@version`; returns the key."""
        tenant = tenant or "default"
        if make_current or version is None:
            return self.engine.register_adapter(name, source, version, tenant=tenant, pinned=pinned)
        from lorafleet.worker.peft_adapter import load_peft_adapter

        e = self.engine
        weights = load_peft_adapter(Path(source), e.model_config, dtype=e.dtype, strict_base=e.config.strict_base,
                                    base_model_name=e.model_name, tokenizer_digest=e.tokenizer_digest, name=name,
                                    version=version)
        key = f"{name}@{version}"
        self.pool.add(key, weights, tenant=tenant, pinned=pinned, make_current=False)
        log.info("registered adapter %s from %s beside the current version", key, source)
        return key

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

    def prefetch_adapter(self, key: str) -> None:
        self.pool.prefetch(key, "gpu")

    def describe_adapters(self) -> list[dict[str, Any]]:
        return self.pool.describe()

    def pool_stats(self) -> dict[str, Any]:
        return self.pool.stats()
