"""ModelConfig reads both spellings of RoPE settings, and its llama3 frequencies equal transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from lorafleet.worker.model_config import ModelConfig, ModelConfigError

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_released_spelling_rope_theta_and_rope_scaling():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "rope_type": "llama3"}})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.head_dim == 16 and cfg.q_size == 64 and cfg.kv_size == 32


def test_transformers5_spelling_rope_parameters():
    cfg = ModelConfig.from_dict({**BASE, "rope_parameters": {**LLAMA3, "rope_type": "llama3", "rope_theta": 500000.0}})
    old = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "type": "llama3"}})
    assert cfg.rope_theta == old.rope_theta == 500000.0
    assert cfg.rope_scaling == old.rope_scaling
    assert torch.equal(cfg.inv_freq(), old.inv_freq())


def test_default_rope_in_both_spellings():
    a = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    b = ModelConfig.from_dict({**BASE, "rope_theta": 1e4})
    assert a.rope_scaling is None and b.rope_scaling is None and torch.equal(a.inv_freq(), b.inv_freq())


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}, {**LLAMA3, "rope_type": "llama3"}])
def test_inv_freq_equals_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**BASE, rope_theta=10000.0, rope_scaling=rope)
    ours = ModelConfig.from_dict(json.loads(hf.to_json_string()))
    if rope is None:
        expected = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    assert torch.allclose(ours.inv_freq(), expected, rtol=0, atol=0)


def test_eos_list_tied_embeddings_and_head_dim_override():
    cfg = ModelConfig.from_dict({**BASE, "eos_token_id": [7, 9], "tie_word_embeddings": True, "head_dim": 32})
    assert cfg.eos_token_ids == [7, 9] and cfg.tie_word_embeddings and cfg.head_dim == 32 and cfg.q_size == 128


@pytest.mark.parametrize("bad, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "not supported"),
    ({"attention_bias": True}, "biases"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"model_type": "mistral", "sliding_window": 128}, "sliding-window"),
])
def test_unsupported_models_are_refused_with_the_reason(bad, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict({**BASE, **bad})


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("text, match", [
    ('{"vocab_size": ', "not valid JSON"),
    ("[1, 2]", "not an object"),
    (json.dumps({k: v for k, v in BASE.items() if k != "hidden_size"}), "lacks hidden_size"),
    (json.dumps({**BASE, "num_attention_heads": 0}), "num_attention_heads=0"),
    (json.dumps({**BASE, "vocab_size": "100"}), "vocab_size='100'"),
])
def test_config_json_it_cannot_read_is_refused_naming_the_file(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelConfigError, match=match) as exc:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path) in str(exc.value)


@pytest.mark.parametrize("rope", [{"rope_type": "llama3"}, {"type": "linear"}, {"rope_type": "linear", "factor": "2"},
                                  {**LLAMA3, "rope_type": "llama3", "factor": 0}])
def test_rope_scaling_without_a_usable_factor_is_refused_naming_it(rope):
    with pytest.raises(ModelConfigError, match="factor"):
        ModelConfig.from_dict({**BASE, "rope_scaling": rope})


def test_hugging_face_cache_snapshot_is_named_by_its_repo_id(tmp_path):
    """A model served from the HF cache is named for its repo, not its commit hash, so adapters trained on
    that repo pass the base-model check."""
    snapshot = tmp_path / "models--org--tiny-llama" / "snapshots" / ("0123abcd" * 5)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(snapshot).name == "org/tiny-llama"
    plain = tmp_path / "Tiny-Llama"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(plain).name == "Tiny-Llama"


def test_missing_model_directory_is_named_as_missing(tmp_path):
    missing = tmp_path / "nonexistent"
    with pytest.raises(ModelConfigError) as exc:
        ModelConfig.from_dir(missing)
    assert f"--model {missing}: the model directory does not exist" in str(exc.value)
    assert "config.json not found" not in str(exc.value)


def test_hub_id_is_told_the_worker_does_not_download(tmp_path, monkeypatch):
    """`--model org/name` is not fetched from the Hub: say so, and how to serve a model instead."""
    monkeypatch.chdir(tmp_path)  # the id is no relative path here
    with pytest.raises(ModelConfigError) as exc:
        ModelConfig.from_dir("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(exc.value)
    assert "does not download models from the Hugging Face Hub" in message
    assert "pass its local directory" in message
    assert "leave --model unset" in message and "SmolLM2-135M-Instruct (as `make run` does)" in message


def test_a_file_is_refused_as_not_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelConfigError) as exc:
        ModelConfig.from_dir(weights)
    assert f"--model {weights} is a file, not a directory" in str(exc.value)
    assert f"(such as {tmp_path})" in str(exc.value)  # the folder that does hold config.json
