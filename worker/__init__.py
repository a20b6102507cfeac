"""The GPU worker: engine, scheduler, adapter pool, HTTP service.

`Engine`, `EngineConfig`, `RequestOutput` and `SamplingParams` are imported on first use (PEP 562): the
package itself imports no torch, so `python -m lorafleet.worker --help` (and the stager's) answers
without loading it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorafleet.worker.engine import Engine
    from lorafleet.worker.engine_config import EngineConfig
    from lorafleet.worker.request_output import RequestOutput
    from lorafleet.worker.sampling_params import SamplingParams

_LAZY = {
    "Engine": "lorafleet.worker.engine",
    "EngineConfig": "lorafleet.worker.engine_config",
    "RequestOutput": "lorafleet.worker.request_output",
    "SamplingParams": "lorafleet.worker.sampling_params",
}

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
