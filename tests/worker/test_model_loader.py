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
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
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


def _shards(model: Path, *shards: dict, weight_map: dict | None = None) -> None:
    """Shard i (1-based) holds shards[i - 1]; the index maps every tensor to its shard unless given."""
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, tensors in zip(names, shards, strict=True):
        save_file(tensors, str(model / name))
    write_index(model, weight_map if weight_map is not None else
                {t: name for name, tensors in zip(names, shards, strict=True) for t in tensors})


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    _shards(tmp_path, {"a": torch.zeros(2), "b": torch.zeros(1)}, {"b": torch.ones(1)})
    with pytest.raises(ModelConfigError, match="tensor 'b' is in two weight files") as exc:
        next(iter_weights(tmp_path))  # refused from the headers, before any tensor is read
    assert "model-00001-of-00002.safetensors" in str(exc.value)
    assert "model-00002-of-00002.safetensors" in str(exc.value)


def test_a_tensor_in_two_unindexed_files_is_refused(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "part-1.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "part-2.safetensors"))
    with pytest.raises(ModelConfigError, match="tensor 'a' is in two weight files, .*part-1.*part-2"):
        list(iter_weights(tmp_path))


def test_index_naming_a_tensor_no_shard_holds_is_refused(tmp_path):
    _shards(tmp_path, {"a": torch.zeros(2)}, {"b": torch.ones(3)}, weight_map={
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"})
    with pytest.raises(ModelConfigError, match=r"places tensor 'c' in model-00002-of-00002.safetensors, but no shard"):
        list(iter_weights(tmp_path))


def _tiny_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def _assert_same_weights_as_transformers(model_dir: Path) -> None:
    ours = dict(iter_weights(model_dir))
    theirs = _tiny_state(model_dir)
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.fixture(scope="module")
def sharded_tiny(tmp_path_factory):
    """The tiny Llama saved in four shards, and its weights (another seed than tiny_llama_dir's)."""
    from tests.worker.conftest import make_tiny_llama

    whole = make_tiny_llama(tmp_path_factory.mktemp("whole"), seed=5, rope="default")
    from transformers import LlamaForCausalLM

    sharded = tmp_path_factory.mktemp("sharded")
    LlamaForCausalLM.from_pretrained(whole).save_pretrained(sharded, max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    return sharded


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_model_safetensors_wins_over_an_index_as_in_transformers(tiny_llama_dir, sharded_tiny, tmp_path):
    model = _copy(sharded_tiny, tmp_path / "both")
    (model / "model.safetensors").write_bytes((tiny_llama_dir / "model.safetensors").read_bytes())
    assert weight_files(model) == [model / "model.safetensors"]
    _assert_same_weights_as_transformers(model)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(dict(iter_weights(model))[name], dict(iter_weights(tiny_llama_dir))[name])
    assert not torch.equal(dict(iter_weights(model))[name], dict(iter_weights(sharded_tiny))[name])


def test_tensors_the_index_places_elsewhere_or_omits_are_read_as_in_transformers(sharded_tiny, tmp_path):
    model = _copy(sharded_tiny, tmp_path / "model")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor)
    first, second = [shard for shard, tensors in sorted(by_shard.items()) if len(tensors) > 1][:2]
    moved, omitted = by_shard[first][0], by_shard[second][0]
    weight_map[moved] = second  # the index places it in a shard that does not hold it
    del weight_map[omitted]  # the shard holds a tensor the index does not name
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    ours = dict(iter_weights(model))
    assert moved in ours and omitted in ours
    _assert_same_weights_as_transformers(model)
