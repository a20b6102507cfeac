"""`python -m lorafleet.worker` on a base model directory whose tokenizer or weight files are broken: one
line naming the file and the problem (exit 1), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.worker.test_worker_main import assert_one_line_error, run_worker


def _truncate_tokenizer(d: Path) -> None:
    data = (d / "tokenizer.json").read_bytes()
    (d / "tokenizer.json").write_bytes(data[: len(data) // 2])


def _tokenizer_not_utf8(d: Path) -> None:
    (d / "tokenizer.json").write_bytes(b"\xff\xfe\x00garbage")


def _tokenizer_config_not_json(d: Path) -> None:
    (d / "tokenizer_config.json").write_text('{"bos_token": ')


def _tokenizer_config_wrong_type(d: Path) -> None:
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))


def _shard(d: Path, duplicate: bool) -> None:
    """model.safetensors split in two shards (one tensor in both when `duplicate`)."""
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({n: tensors[n] for n in first}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in second + first[:1] * duplicate}, str(d / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _tensor_in_two_shards(d: Path) -> None:
    _shard(d, duplicate=True)


def _index_without_weight_map(d: Path) -> None:
    _shard(d, duplicate=False)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


@pytest.mark.parametrize(("breakage", "needles"), [
    (_truncate_tokenizer, ["tokenizer.json: not a readable tokenizers file"]),
    (_tokenizer_not_utf8, ["tokenizer.json: not a readable tokenizers file"]),
    (_tokenizer_config_not_json, ["tokenizer_config.json: not valid JSON"]),
    (_tokenizer_config_wrong_type, ["tokenizer_config.json: chat_template must be a string"]),
    (_tensor_in_two_shards, ["is in two weight files", "model-00001-of-00002", "model-00002-of-00002"]),
    (_index_without_weight_map, ["weight_map"]),
])
def test_broken_base_model_files_are_one_line(tiny_llama_dir, tmp_path, breakage, needles):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    breakage(model)
    out = run_worker("--model", str(model), "--port", "0")
    assert_one_line_error(out, 1, "cannot start", *needles)
