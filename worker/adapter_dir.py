"""A local `--adapters DIR` registered at start-up: every PEFT subfolder is one adapter (name = folder name).

One broken adapter does not stop the others (as vLLM and LoRAX serve the rest): each that cannot be
loaded is logged (`adapter shout not served: ...`) and listed in the report, a subfolder without
adapter_config.json is skipped with one log line, and only a folder where no adapter loads at all is
refused (EngineError), since the worker would then serve none of what it was asked to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lorafleet.worker.engine_errors import EngineError

log = logging.getLogger("lorafleet.worker.engine")


class AdapterRegistry(Protocol):
    def register_adapter(self, name: str, path: str | Path) -> str: ...


@dataclass(slots=True)
class AdapterDirReport:
    keys: list[str] = field(default_factory=list)  # `name@version` of each adapter registered
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it is not served
    skipped: list[str] = field(default_factory=list)  # subfolders without adapter_config.json


def register_adapter_dir(engine: AdapterRegistry, directory: str | Path) -> AdapterDirReport:
    """Register every PEFT subfolder of `directory`; EngineError when none can be registered."""
    directory = Path(directory)
    if not directory.is_dir():
        raise EngineError(f"adapters directory {directory} does not exist")
    report = AdapterDirReport()
    for path in sorted(p for p in directory.iterdir() if p.is_dir()):
        if not (path / "adapter_config.json").is_file():
            report.skipped.append(path.name)
            log.info("%s skipped: no adapter_config.json there, so not a PEFT adapter", path)
            continue
        try:
            report.keys.append(engine.register_adapter(path.name, path))
        except (ValueError, KeyError, OSError, RuntimeError) as exc:  # this adapter's; the others still load
            report.failed[path.name] = str(exc) or type(exc).__name__
            log.warning("adapter %s not served: %s", path.name, report.failed[path.name])
    if report.keys:
        return report
    if report.failed:
        reasons = "; ".join(f"{name}: {why}" for name, why in report.failed.items())
        raise EngineError(f"no adapter under {directory} can be served ({reasons})")
    raise EngineError(f"{directory} holds no PEFT adapter (no subfolder with adapter_config.json)")
