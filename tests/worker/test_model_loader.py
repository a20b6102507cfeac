"""model_loader: which weight files of a model dir are read, and what is refused (never unpickled)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorafleet.worker.model_config import ModelConfigError
from lorafleet.worker.model_loader import iter_weights, weight_files


class _Tripwire:
    """Unpickling this writes `path`: a test that finds the file knows a pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "unpickled"))


def write_pickle(path: Path, tripwire: Path) -> None:
    path.write_bytes(pickle.dumps({"model.norm.weight": _Tripwire(tripwire)}))


def write_index(model: Path, weight_map) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_index_reads_its_shards(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    assert {name: t.numel() for name, t in iter_weights(tmp_path)} == {"a": 2, "b": 3}


@pytest.mark.parametrize(("index_text", "needle"), [
    ('{"weight_map": ', "not valid JSON"),
    ('{"metadata": {}}', "no \"weight_map\""),
    ('[1, 2]', "no \"weight_map\""),
    ('{"weight_map": ["model.safetensors"]}', "must map tensor names"),
    ('{"weight_map": {"a": 3}}', "must map tensor names"),
    ('{"weight_map": {}}', "names no shards"),
])
def test_broken_index_is_refused_naming_the_index(tmp_path, index_text, needle):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(ModelConfigError, match="model.safetensors.index.json") as exc:
        weight_files(tmp_path)
    assert needle in str(exc.value)


def test_index_naming_a_file_outside_the_model_dir_is_refused(tmp_path):
    model, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    model.mkdir()
    elsewhere.mkdir()
    save_file({"a": torch.zeros(2)}, str(elsewhere / "model.safetensors"))
    write_index(model, {"a": "../elsewhere/model.safetensors"})
    with pytest.raises(ModelConfigError, match="not safetensors files in its directory"):
        weight_files(model)


@pytest.mark.parametrize("shard", ["pytorch_model.bin", "model.pt"])
def test_pickle_named_by_an_index_is_never_loaded(tmp_path, shard):
    tripwire = tmp_path / "tripwire"
    model = tmp_path / "model"
    model.mkdir()
    write_pickle(model / shard, tripwire)
    write_index(model, {"model.norm.weight": shard})
    with pytest.raises(ModelConfigError, match=shard):
        list(iter_weights(model))
    assert not tripwire.exists()


def test_dir_of_only_pickles_is_refused_unread(tmp_path):
    tripwire = tmp_path / "tripwire"
    model = tmp_path / "model"
    model.mkdir()
    write_pickle(model / "pytorch_model.bin", tripwire)
    with pytest.raises(ModelConfigError, match="only pickle checkpoints"):
        list(iter_weights(model))
    assert not tripwire.exists()


@pytest.mark.parametrize("content", [b"", b"\x00" * 7, b"not a safetensors file at all, but long enough"])
def test_unreadable_safetensors_is_refused_naming_the_file(tmp_path, content):
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelConfigError, match="model.safetensors is not a readable safetensors file"):
        list(iter_weights(tmp_path))


def test_truncated_safetensors_is_refused(tmp_path):
    save_file({"a": torch.zeros(1000)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelConfigError, match="not a readable safetensors file"):
        list(iter_weights(tmp_path))


def test_a_load_logs_its_progress_file_by_file(tmp_path, caplog):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    with caplog.at_level("INFO", logger="lorafleet.worker.model_loader"):
        assert len(list(iter_weights(tmp_path))) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert "2 safetensors file(s)" in lines[0]
    assert "model-00001-of-00002.safetensors: file 1/2" in lines[1]
    assert "model-00002-of-00002.safetensors: file 2/2" in lines[2]
