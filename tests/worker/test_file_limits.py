"""Limits on adapter files (worker/file_limits.py): checked before a byte is read, in the loader too."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lorafleet.worker.file_limits import (
    MAX_CONFIG_BYTES,
    MAX_FILE_BYTES,
    MAX_SIDE_FILE_BYTES,
    FileLimitError,
    check_file,
    read_limited,
)


def test_the_loader_refuses_oversize_files_before_reading_them(tiny_llama_dir, tmp_path):
    """The loader reads a file into memory whole: its size is checked first (the weights here are a
    sparse file of more than 4 GiB, so nothing is written or read)."""
    import torch

    from lorafleet.worker.model_config import ModelConfig
    from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
    from tests.lora_factory import make_peft_adapter

    d = make_peft_adapter(tiny_llama_dir, tmp_path / "x", rank=4, seed=0, targets=["q_proj"])
    weights, config = d / "adapter_model.safetensors", d / "adapter_config.json"
    model_config = ModelConfig.from_dir(tiny_llama_dir)
    good = weights.read_bytes()
    os.truncate(weights, MAX_FILE_BYTES + 1)
    expected = (
        f"{weights}: {MAX_FILE_BYTES + 1} bytes (4.0 GiB), over the limit of {MAX_FILE_BYTES} bytes "
        f"(4.0 GiB) for one adapter file; refused before reading it"
    )
    with pytest.raises(AdapterError, match=re.escape(expected)):
        load_peft_adapter(d, model_config, dtype=torch.float32, strict_base="off")
    weights.write_bytes(good)
    config.write_text(config.read_text() + " " * MAX_CONFIG_BYTES)  # still valid JSON
    expected = (
        f"{config}: {config.stat().st_size} bytes (1.0 MiB), over the limit of {MAX_CONFIG_BYTES} bytes "
        f"(1.0 MiB) for adapter_config.json"
    )
    with pytest.raises(AdapterError, match=re.escape(expected)):
        load_peft_adapter(d, model_config, dtype=torch.float32, strict_base="off")


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json", "merges.txt", "README.md"])
def test_files_beside_the_weights_are_held_to_a_tokenizer_s_size(tiny_llama_dir, tmp_path, name):
    """Tokenizer JSON is parsed into Python objects some 25 times its size: one of the weights' 4 GiB would
    take the worker down (a 99 MB tokenizer.json took 2.4 GB). Every file beside the weights and the config
    is held to MAX_SIDE_FILE_BYTES, by the loader and by a stager's check of a local folder."""
    import torch

    from lorafleet.worker.model_config import ModelConfig
    from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
    from lorafleet.worker.sources import SourceError, Sources, SourcesConfig
    from tests.lora_factory import make_peft_adapter

    d = make_peft_adapter(tiny_llama_dir, tmp_path / "root" / "a", rank=2, seed=0)
    with open(d / name, "wb") as f:  # sparse: nothing is written
        f.truncate(MAX_SIDE_FILE_BYTES + 1)
    expected = f"over the limit of {MAX_SIDE_FILE_BYTES} bytes (64.0 MiB) for a {name}"
    if name in ("tokenizer.json", "vocab.json"):  # what the loader reads of these (merges.txt with a vocab.json)
        with pytest.raises(AdapterError, match=re.escape(expected)):
            load_peft_adapter(d, ModelConfig.from_dir(tiny_llama_dir), dtype=torch.float32)
    src = Sources(SourcesConfig(local_roots=[str(tmp_path / "root")]))
    with pytest.raises(SourceError, match=re.escape(expected)) as err:
        src.verify_local(src.local_path(str(d)), None, str(d))
    assert err.value.kind == "too_large"


def test_the_loaders_limit_is_the_engines_setting(tiny_llama_dir, tmp_path):
    """The worker's loader takes its limit from --max-adapter-file-bytes (EngineConfig), the flag of
    the same name as the stager's, so raising one for both raises it for the worker too."""
    import torch

    from lorafleet.worker.cli import config_from_args
    from lorafleet.worker.model_config import ModelConfig
    from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
    from lorafleet.worker.worker_config import WorkerConfig
    from tests.lora_factory import make_peft_adapter

    d = make_peft_adapter(tiny_llama_dir, tmp_path / "x", rank=4, seed=0, targets=["q_proj"])
    size = (d / "adapter_model.safetensors").stat().st_size
    model_config = ModelConfig.from_dir(tiny_llama_dir)
    with pytest.raises(AdapterError, match=re.escape(f"over the limit of {size - 1} bytes")):
        load_peft_adapter(d, model_config, dtype=torch.float32, strict_base="off", max_file_bytes=size - 1)
    weights = load_peft_adapter(d, model_config, dtype=torch.float32, strict_base="off", max_file_bytes=size)
    assert weights.reload.keywords["max_file_bytes"] == size  # a reload keeps the limit it was loaded under
    config = config_from_args(WorkerConfig, ["--max-adapter-file-bytes", str(size - 1)], env={})
    assert config.engine.max_adapter_file_bytes == size - 1
    with pytest.raises(SystemExit):
        config_from_args(WorkerConfig, ["--max-adapter-file-bytes", "0"], env={})


def test_the_loader_holds_adapter_config_json_to_a_limit_below_1_mib(tiny_llama_dir, tmp_path):
    """adapter_config.json may have at most 1 MiB, or --max-adapter-file-bytes when that is less (as the
    stager holds it): a config over a lower limit is refused, not read under the 1 MiB bound."""
    import torch

    from lorafleet.worker.model_config import ModelConfig
    from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
    from tests.lora_factory import make_peft_adapter

    d = make_peft_adapter(tiny_llama_dir, tmp_path / "x", rank=4, seed=0, targets=["q_proj"])
    config = d / "adapter_config.json"
    limit = config.stat().st_size - 1
    with pytest.raises(AdapterError, match=re.escape(f"{config}: {limit + 1} bytes")) as err:
        load_peft_adapter(d, ModelConfig.from_dir(tiny_llama_dir), dtype=torch.float32, strict_base="off",
                          max_file_bytes=limit)
    assert f"over the limit of {limit} bytes" in str(err.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "merges.txt"])
def test_the_loader_holds_the_adapters_tokenizer_files_to_the_limit(tiny_llama_dir, tmp_path, name):
    """The tokenizer files the loader compares with the base's (tokenizer.json, or vocab.json + merges.txt)
    are adapter files too: one over the limit is refused before it is read, also when a tokenizer
    mismatch would only be logged (strictness 'warn')."""
    import shutil

    import torch

    from lorafleet.worker.model_config import ModelConfig
    from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
    from tests.lora_factory import make_peft_adapter

    d = make_peft_adapter(tiny_llama_dir, tmp_path / "x", rank=4, seed=0, targets=["q_proj"])
    if name == "merges.txt":
        (d / "vocab.json").write_text('{"a": 0, "b": 1, "ab": 2}')
        (d / name).write_text("#version: 0.2\na b\n")
    else:
        shutil.copy(tiny_llama_dir / name, d / name)
    limit = max((d / f).stat().st_size for f in ("adapter_model.safetensors", name))  # the others fit
    with (d / name).open("a") as f:  # still a valid file of its kind, one byte over the limit
        f.write("\n" * (limit + 1 - (d / name).stat().st_size))
    model_config = ModelConfig.from_dir(tiny_llama_dir)
    for strict_base in (True, "warn"):
        with pytest.raises(AdapterError, match=re.escape(f"{d / name}: {limit + 1} bytes")):
            load_peft_adapter(d, model_config, dtype=torch.float32, strict_base=strict_base, max_file_bytes=limit)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_file_that_is_not_a_regular_file_is_refused_without_opening_it(special, tmp_path):
    path = Path(special) if special.startswith("/") else tmp_path / "adapter_model.safetensors"
    if special == "fifo":
        os.mkfifo(path)  # opening it to read would wait for a writer
    for refuse in (check_file, read_limited):
        with pytest.raises(
            FileLimitError, match=r": not a regular file \(a (character device|FIFO)\)"
        ) as err:
            refuse(path, MAX_FILE_BYTES)
        assert err.value.kind == "not_a_file"


def test_a_file_longer_than_its_size_is_refused():
    """procfs reports size 0 for files that read as more: what was checked must bound what is read."""
    status = Path("/proc/self/status")
    if not status.is_file():
        pytest.skip("no /proc")
    with pytest.raises(FileLimitError, match="grew beyond the 0 bytes it had when opened") as err:
        read_limited(status, MAX_FILE_BYTES)
    assert err.value.kind == "changed"


def test_no_limit_reads_any_regular_file(tmp_path):
    f = tmp_path / "adapter_config.json"
    f.write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    assert len(read_limited(f, None)) == MAX_CONFIG_BYTES + 1  # None: cache entries, already checked
    with pytest.raises(FileLimitError, match="over the limit") as err:
        read_limited(f, MAX_FILE_BYTES)
    assert err.value.kind == "too_large"


async def test_the_stager_child_stages_under_the_workers_limit(tiny_llama_dir, tmp_path, monkeypatch):
    """A worker with s3:// adapters starts a stager child: given --max-adapter-file-bytes, the child gets
    the same limit, so it stages the files the worker will load (and refuses the ones it would not)."""
    from aiohttp import web

    from lorafleet.worker import server, stager_client
    from lorafleet.worker.app_keys import CONFIG
    from lorafleet.worker.cli import config_from_args
    from lorafleet.worker.stager_config import StagerConfig
    from lorafleet.worker.worker_config import WorkerConfig

    started: list[list[str]] = []

    class RecordedStager:  # records the child's arguments instead of starting it
        def __init__(self, *, cache_dir, port, env, args, log_path) -> None:
            started.append(args)
            self.proc, self.log_path = type("Proc", (), {"pid": 0})(), log_path
            self.url, self.token = "http://127.0.0.1:9", "stager-token-for-tests"  # nothing answers there

        def start(self, timeout: float) -> None:
            pass

        def stop(self) -> None:
            pass

    monkeypatch.setattr(stager_client, "StagerProcess", RecordedStager)
    limit = 8 << 30
    app = web.Application()
    app[CONFIG] = config_from_args(WorkerConfig, [
        "--model", str(tiny_llama_dir), "--adapters", "s3://adapters/team/", "--max-adapter-file-bytes", str(limit),
        "--stager-cache-dir", str(tmp_path / "cache")], env={})
    ctx = server._stager_ctx(app)
    await anext(ctx)
    with pytest.raises(StopAsyncIteration):
        await anext(ctx)
    child = config_from_args(StagerConfig, started[0], env={"LORAFLEET_STAGER_TOKEN": "t" * 20})
    assert child.max_adapter_file_bytes == limit
