"""One whole copy of the base model per GPU (no tensor parallelism, so no adapter is ever split into shards
that could disagree between GPUs): a model whose weights do not fit the GPU is refused before anything is
allocated, with a message that says why, and the weights' size it is judged by is the model's own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorafleet.worker.llama import LlamaModel
from lorafleet.worker.model_config import ModelConfig, ModelConfigError
from lorafleet.worker.model_loader import check_fits_one_device, weight_bytes

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)
LLAMA3_70B = LLAMA3_8B | dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
GIB = 1 << 30


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_are_the_models_parameters(tiny_llama_dir, tied):
    config = dataclasses.replace(ModelConfig.from_dir(tiny_llama_dir), tie_word_embeddings=tied)
    model = LlamaModel(config, dtype=torch.bfloat16, device="meta")
    params = {id(p): p for p in model.parameters()}.values()  # a tied head is one tensor
    assert weight_bytes(config, torch.bfloat16) == sum(p.numel() * p.element_size() for p in params)
    assert weight_bytes(config, torch.float32) == 2 * weight_bytes(config, torch.bfloat16)


def test_llama3_8b_fits_an_h100_and_70b_is_refused_naming_why():
    assert round(weight_bytes(ModelConfig(**LLAMA3_8B), torch.bfloat16) / 1e9, 1) == 16.1  # 8.03 B parameters
    check_fits_one_device(ModelConfig(**LLAMA3_8B), torch.bfloat16, 79 * GIB, "cuda:0")
    with pytest.raises(ModelConfigError) as err:  # 131 GiB of weights: no 80 GB card holds them
        check_fits_one_device(ModelConfig(**LLAMA3_70B), torch.bfloat16, 79 * GIB, "cuda:0")
    message = str(err.value)
    assert "131.42 GiB in bfloat16" in message and "79.00 GiB free on cuda:0" in message, message
    assert "no tensor parallelism" in message, message
    with pytest.raises(ModelConfigError, match="float32"):  # 8B in float32 (32 GB) on a 24 GiB card
        check_fits_one_device(ModelConfig(**LLAMA3_8B), torch.float32, 24 * GIB, "cuda:0")


def test_loading_onto_a_gpu_too_small_is_refused_before_anything_is_allocated(tiny_llama_dir, monkeypatch):
    """load_model asks the device's free memory before it builds the model: on a machine without a GPU, a device
    that says it has a byte too little is refused with the reason, and nothing touches CUDA after that."""
    from lorafleet.worker.model_loader import load_model

    config = ModelConfig.from_dir(tiny_llama_dir)
    need = weight_bytes(config, torch.float32)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (need - 1, need))
    with pytest.raises(ModelConfigError, match="no tensor parallelism"):
        load_model(tiny_llama_dir, dtype=torch.float32, device="cuda:0")
    assert asked == [torch.device("cuda:0")]


@pytest.mark.gpu
def test_a_worker_refuses_a_model_its_gpu_cannot_hold_before_allocating(tiny_llama_dir, monkeypatch):
    """The engine's load checks the GPU's free memory first: too little is the clear error, not an OOM."""
    from lorafleet.worker.model_loader import load_model

    free, total = torch.cuda.mem_get_info()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 10, total))
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(ModelConfigError, match="no tensor parallelism"):
        load_model(tiny_llama_dir, dtype=torch.bfloat16, device="cuda")
    assert torch.cuda.memory_allocated() == allocated
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    assert load_model(tiny_llama_dir, dtype=torch.bfloat16, device="cuda") is not None
