"""Where the benchmarks put their results: one JSON file per run, named by what ran, when and on what."""

from __future__ import annotations

import json
import re
from pathlib import Path


def write_json(out_dir: str | Path, stem: str, date: str, device: str, res: dict) -> Path:
    """res as `<out_dir>/<stem>_<yyyymmdd>_<device>.json` (the folder made if missing); prints and returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}_{date.replace('-', '')}_{device}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return path


def device_tag(name: str) -> str:
    """A GPU's short name for file names: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200" (the first
    model-number word; else the last word), "cpu" for a CPU run."""
    found = re.search(r"\b[A-Z]+\d+[A-Za-z]*\b", name)
    return (found.group(0) if found else name.split()[-1]).lower()
