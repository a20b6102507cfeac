"""A local `--adapters DIR` registered at start-up: every PEFT subfolder is one adapter (name = folder name).

One broken adapter does not stop the others (as vLLM and LoRAX serve the rest): each that cannot be
loaded is logged (`adapter shout not served: ...`) and listed in the report (the worker's GET
/admin/v1/state shows it: worker/served_adapters.py), a subfolder without adapter_config.json is skipped
with one log line, and only a folder where no adapter loads at all is refused (AdapterDirError), since
the worker would then serve none of what it was asked to. A folder whose name is no adapter name (as a
push or load_lora_adapter would be refused: letters, digits, '.', '_', '-') is not served either, as the
stager's seed refuses such a folder under an s3:// --adapters: rename it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lorafleet.worker.directives import is_name
from lorafleet.worker.engine_errors import EngineError

log = logging.getLogger("lorafleet.worker.engine")


class AdapterDirError(EngineError):
    """No adapter of the --adapters folder can be served (the message names each and why): the worker
    refuses to start. `problem` and `fix` word it for the flag (the folder named by it)."""

    def __init__(self, message: str, *, problem: str, fix: str) -> None:
        super().__init__(message)
        self.problem, self.fix = problem, fix


_GIVE_ANOTHER = "give --adapters a directory of PEFT adapter folders"


class AdapterRegistry(Protocol):
    def register_adapter(self, name: str, path: str | Path) -> str: ...


@dataclass(slots=True)
class AdapterDirReport:
    keys: list[str] = field(default_factory=list)  # `name@version` of each adapter registered
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it is not served
    skipped: list[str] = field(default_factory=list)  # subfolders without adapter_config.json


def register_adapter_dir(engine: AdapterRegistry, directory: str | Path) -> AdapterDirReport:
    """Register every PEFT subfolder of `directory`; AdapterDirError when none can be registered."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterDirError(f"adapters directory {directory} does not exist", problem="not a directory",
                              fix=_GIVE_ANOTHER)
    report = AdapterDirReport()
    for path in sorted(p for p in directory.iterdir() if p.is_dir()):
        if not (path / "adapter_config.json").is_file():
            report.skipped.append(path.name)
            log.info("%s skipped: no adapter_config.json there, so not a PEFT adapter", path)
            continue
        if not is_name(path.name):  # else served, but no state report or push could name it
            report.failed[path.name] = (f"{path.name!r} is no adapter name (up to 253 letters, digits, '.', '_' or "
                                        "'-', starting with a letter or digit); rename the folder")
            log.warning("adapter %r not served: %s", path.name, report.failed[path.name])
            continue
        try:
            report.keys.append(engine.register_adapter(path.name, path))
        except (ValueError, KeyError, OSError, RuntimeError) as exc:  # this adapter's; the others still load
            report.failed[path.name] = " ".join(str(exc).splitlines()) or type(exc).__name__  # one line (log, state)
            log.warning("adapter %s not served: %s", path.name, report.failed[path.name])
    if report.keys:
        return report
    if report.failed:
        reasons = "; ".join(f"{name}: {why}" for name, why in report.failed.items())
        raise AdapterDirError(f"no adapter under {directory} can be served ({reasons})",
                              problem=f"no adapter there can be served ({reasons})",
                              fix="fix them (a PEFT adapter folder each: adapter_config.json, "
                                  f"adapter_model.safetensors) or {_GIVE_ANOTHER}")
    raise AdapterDirError(f"{directory} holds no PEFT adapter (no subfolder with adapter_config.json)",
                          problem="no PEFT adapter there (no subfolder with adapter_config.json)",
                          fix=f"put the adapters' folders in it or {_GIVE_ANOTHER}")
