"""Where the benchmarks put their results (one JSON file per run, named by what ran, when and on what), and how
those that drive a worker over HTTP start it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
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


def run_in_processes(script: str, modes: tuple[str, ...], argv: list[str]) -> dict[str, dict]:
    """Run `script --mode M *argv` in a process of its own for each mode (so that no mode inherits another's
    caches: torch's pinned memory), each printing its result as a line `RESULT <json>`; {mode: result}."""
    results = {}
    for mode in modes:
        proc = subprocess.run([sys.executable, script, "--mode", mode, *argv], capture_output=True, text=True, env=os.environ)
        sys.stderr.write(proc.stderr[-4000:])
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"{mode} failed: {proc.returncode}\n{proc.stdout[-4000:]}")
        results[mode] = json.loads(lines[-1][len("RESULT "):])
    return results


def write_gpu_run(out_dir: str | Path, stem: str, args, results: dict) -> Path:
    """A run's arguments and `results` as today's JSON for this machine's GPU (or "cpu"), with torch's version."""
    import time

    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return write_json(out_dir, stem, time.strftime("%Y-%m-%d"), device_tag(name),
                      {"args": vars(args), "gpu": name, "torch": torch.__version__, "results": results})


def start_worker_process(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`cmd` (a `python -m lorafleet.worker ... --port 0`) started with its output in `log`; (the process, its URL)
    once it logs where it listens (RuntimeError with the log's end if it exits first; killed after 10 minutes)."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        for line in log.read_text().splitlines():
            if "Running on http://" in line:
                return proc, line.split("Running on ")[1].split()[0].rstrip("/")
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the worker did not start")
