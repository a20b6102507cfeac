"""EngineConfig refuses a device or tokenizer it cannot use when it is built, naming the flag, and
says when it serves less context than --max-model-len asks for."""

from __future__ import annotations

import logging

import pytest
import torch

from lorafleet.worker.engine_config import EngineConfig


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "mps"])
def test_unknown_devices_are_refused(device):
    with pytest.raises(ValueError, match="--device must be cpu, cuda or cuda:N"):
        EngineConfig(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused_with_the_way_out(device):
    with pytest.raises(ValueError, match=f"--device {device}: CUDA is not available.*use --device cpu"):
        EngineConfig(device=device)


def test_cuda_index_beyond_the_devices_is_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ValueError, match="CUDA device"):
        EngineConfig(device=f"cuda:{torch.cuda.device_count()}")


def test_tokenizer_dir_must_hold_tokenizer_json(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="--tokenizer .*no tokenizer.json"):
        EngineConfig(tokenizer=str(tmp_path))
    assert EngineConfig(tokenizer=str(tiny_llama_dir)).tokenizer == str(tiny_llama_dir)


def test_max_model_len_beyond_the_model_is_lowered_and_said(caplog):
    config = EngineConfig(max_model_len=100_000, block_size=16)
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.engine_config"):
        assert config.resolve_max_model_len(512, num_pages=1000) == 512
    assert "--max-model-len 100000 is more than the model's max_position_embeddings (512)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.engine_config"):
        assert EngineConfig(max_model_len=256).resolve_max_model_len(512, num_pages=1000) == 256
    assert not caplog.text
