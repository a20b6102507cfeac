"""README.md and docs/ARCHITECTURE.md against the code: the flags, environment variables, metric names,
files and benchmark commands they name must exist, so that the docs and the code cannot drift apart
unnoticed. Only names are checked here, never wording."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from lorafleet.operator.operator_config import OperatorConfig
from lorafleet.worker.adapter_metrics import AdapterMetrics
from lorafleet.worker.cli import build_parser
from lorafleet.worker.disk_cache import DiskCache
from lorafleet.worker.metrics import WorkerMetrics
from lorafleet.worker.sources import adapter_digest
from lorafleet.worker.stager_config import StagerConfig
from lorafleet.worker.stager_metrics import StagerMetrics
from lorafleet.worker.worker_config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
DOCS = {"README.md": README, "docs/ARCHITECTURE.md": ARCHITECTURE}


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section (up to the next `## `)."""
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def inline_code(text: str) -> list[str]:
    """Inline code spans (`...`) outside fenced blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def flags_and_env(config_cls: type) -> tuple[set[str], set[str]]:
    parser = build_parser(config_cls, env={})
    flags = {s for a in parser._actions for s in a.option_strings}
    env = {m[1] for a in parser._actions if a.help and (m := re.search(r"\[env (LORAFLEET_[A-Z0-9_]+);", a.help))}
    return flags, env


WORKER_FLAGS, WORKER_ENV = flags_and_env(WorkerConfig)
OPERATOR_FLAGS, OPERATOR_ENV = flags_and_env(OperatorConfig)
STAGER_FLAGS, STAGER_ENV = flags_and_env(StagerConfig)


def test_worker_flags_in_readme_exist():
    spans = [s for s in inline_code(section(README, "The worker service")) if s.startswith("--")]
    assert spans, "the worker section names no flag: the README's layout changed"
    unknown = {s.split()[0] for s in spans} - WORKER_FLAGS
    assert not unknown, f"README names worker flags that `python -m lorafleet.worker` lacks: {sorted(unknown)}"


def test_worker_usage_line_names_real_flags():
    usage = next(s for s in inline_code(README) if s.startswith("python -m lorafleet.worker "))
    unknown = set(re.findall(r"--[a-z][a-z0-9-]*", usage)) - WORKER_FLAGS
    assert not unknown, f"the README's worker usage line names unknown flags: {sorted(unknown)}"


def test_operator_flags_in_readme_exist():
    spans = [s for s in inline_code(section(README, "On Kubernetes")) if s.startswith("--")]
    unknown = {s.split()[0] for s in spans} - OPERATOR_FLAGS
    assert not unknown, f"README names operator flags that `python -m lorafleet.operator` lacks: {sorted(unknown)}"


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_environment_variables_exist(doc):
    names = set(re.findall(r"\bLORAFLEET_[A-Z0-9_]*[A-Z0-9]\b", DOCS[doc])) - {"LORAFLEET_CACHE"}
    unknown = names - WORKER_ENV - OPERATOR_ENV - STAGER_ENV
    assert not unknown, f"{doc} names environment variables no process reads: {sorted(unknown)}"


def test_readme_flag_example_matches_its_variable():
    # "`--max-num-seqs` = `LORAFLEET_MAX_NUM_SEQS`": the rule the generated flags follow.
    for flag, env in re.findall(r"`(--[a-z0-9-]+)` = `(LORAFLEET_[A-Z0-9_]+)`", README):
        assert env == "LORAFLEET_" + flag[2:].replace("-", "_").upper()
        assert flag in WORKER_FLAGS and env in WORKER_ENV


def test_metric_names_exist(tmp_path):
    metrics = WorkerMetrics()
    metrics.register(AdapterMetrics().collectors())
    stager = StagerMetrics(DiskCache(tmp_path, 1 << 20))  # the stager's own /metrics
    exposition = metrics.render().decode() + generate_latest(stager.registry).decode()
    # A name, with `{a,b}` alternatives inside it (lorafleet_page_pool_{kv,adapter}_pages); `{tier}` after
    # a name is its labels. A prefix such as lorafleet_stager_* is not a name.
    pattern = r"\blorafleet_(?:[a-z0-9_]|\{[a-z0-9_]+(?:,[a-z0-9_]+)+\}(?=_))*[a-z0-9](?![\w*])"
    for doc, text in DOCS.items():
        for raw in set(re.findall(pattern, text)):
            names = [raw]
            if m := re.fullmatch(r"(.*)\{([a-z0-9_,]+)\}(.*)", raw):
                names = [m[1] + part + m[3] for part in m[2].split(",")]
            for name in names:
                assert re.search(rf"^# TYPE {re.escape(name)} ", exposition, re.M), \
                    f"{doc} names the metric {name}, which neither the worker nor the stager exports"


def test_bench_result_files_exist():
    results = ROOT / "bench" / "results"
    text = README + ARCHITECTURE
    for name in set(re.findall(r"\b[a-z][a-z0-9_-]*_h200[a-z0-9_]*\.json\b", text)):
        assert (results / name).is_file(), f"bench/results/{name} is named in the docs but missing"
    for stem in set(re.findall(r"\b(kernels_[a-z][a-z_]*[a-z])\b(?![./])", text)):
        assert list(results.glob(f"{stem}*.json")), f"no bench/results/{stem}*.json, named in the docs"


def test_repository_paths_exist():
    paths = set()
    for span in inline_code(README):
        paths |= set(re.findall(r"(?<![\w/.$])((?:bench|charts|crds|docs|examples|worker|operator|kernels)"
                                r"/[\w./-]*\w)", span))
    paths |= set(re.findall(r"\b((?:bench|examples|worker|kernels|operator)/[\w-]+\.py)\b", README))
    assert "charts/lorafleet/files/grafana-dashboard.json" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README names paths that do not exist: {missing}"


_HELPS = """
import contextlib, io, json, runpy, sys
sys.path[0] = "bench"  # as `python bench/X.py` has it: its neighbours, not the repository's root
helps = {}
for script in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), None
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # noqa: BLE001 - reported as that script's failure
            code, err = 1, io.StringIO(repr(exc))
    helps[script] = [code, out.getvalue(), err.getvalue()]
print("\\n" + json.dumps(helps))  # the last line: after whatever a script's imports wrote past the redirect
"""


def test_bench_commands_use_real_flags():
    """Every `python bench/X.py ...` command the README quotes takes only flags the script has."""
    commands = [s for s in inline_code(README) if s.startswith("python bench/")]
    assert commands
    by_script: dict[str, set[str]] = {}
    for cmd in commands:
        script = cmd.split()[1]
        by_script.setdefault(script, set()).update(re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", cmd))
    # Each script's imports (torch & co.) are paid once: one process runs every `--help` in turn.
    out = subprocess.run([sys.executable, "-c", _HELPS, *sorted(by_script)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    helps = json.loads(out.stdout.splitlines()[-1])
    for script, flags in sorted(by_script.items()):
        code, stdout, stderr = helps[script]
        assert code in (0, None), f"{script} --help failed: {stderr[-2000:]}"
        known = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", stdout))
        assert not flags - known, f"README runs {script} with flags it lacks: {sorted(flags - known)}"


def test_load_adapter_example_version_is_the_digest():
    m = re.search(r'"lora_path\\": \\"\$PWD/(examples/adapters/\w+)\\".*?\n# Success: LoRA adapter '
                  r"'([\w-]+)' added successfully \(\2@([0-9a-f]{12})\)\.", README, re.S)
    assert m, "the README's load_lora_adapter example changed shape"
    assert adapter_digest(ROOT / m[1])[:12] == m[3], f"{m[1]}'s version (its digest's first 12 hex digits) is not {m[3]}"


def test_make_run_address_is_the_default():
    assert "`127.0.0.1:8000`" in README
    parser = build_parser(WorkerConfig, env={})
    helps = {s: a.help for a in parser._actions for s in a.option_strings}
    assert "default: 127.0.0.1]" in helps["--host"] and "default: 8000]" in helps["--port"]


def test_troubleshooting_answers_each_checklist_item():
    """The brief's checklist: hit rate, adapters per batch, cold-load times (object store included), page-pool
    occupancy and thrashing, and a same-request comparison with a worker serving the adapter alone."""
    text = section(README, "Troubleshooting")
    for figure in ('lorafleet_adapter_hits_total{tier="gpu"}', "lorafleet_adapters_per_batch",
                   "lorafleet_adapter_load_seconds", "lorafleet_stager_download_seconds", "lorafleet_page_pool_kv_pages",
                   "lorafleet_adapter_evictions_total", "--max-loras-per-batch", "python -m lorafleet.worker --model"):
        assert figure in text, f"the README's troubleshooting section does not name {figure}"
    flags = {s.split()[0] for s in inline_code(text) if s.startswith("--")}
    assert flags and not flags - WORKER_FLAGS - STAGER_FLAGS, sorted(flags - WORKER_FLAGS - STAGER_FLAGS)
