"""Where the benchmarks put their results: one JSON file per run, named by what ran, when and on what."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(out_dir: str | Path, stem: str, date: str, device: str, res: dict) -> Path:
    """res as `<out_dir>/<stem>_<yyyymmdd>_<device>.json` (the folder made if missing); prints and returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}_{date.replace('-', '')}_{device}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return path
