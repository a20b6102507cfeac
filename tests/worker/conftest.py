"""Shared fixtures for worker tests: a tiny random Llama (GQA, llama3 RoPE scaling) saved with
`save_pretrained`, plus a byte-level tokenizer over its vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY_VOCAB = 260  # 256 byte tokens + <s>, </s>, two spare
BOS_ID, EOS_ID = 256, 257


def write_byte_tokenizer(path: Path) -> None:
    """tokenizer.json (byte-level BPE without merges: one token per byte) + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }))


def make_tiny_llama(path: Path, *, tie: bool = False, seed: int = 0, rope: str = "llama3") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rope_scaling = None
    if rope == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32}
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rope_scaling=rope_scaling, tie_word_embeddings=tie,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights give peaked, well separated logits (no argmax near-ties).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def qv_adapters_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """Two PEFT adapters of the tiny Llama on q_proj and v_proj, rank 4: `alpha` and `beta`."""
    from tests.lora_factory import make_peft_adapter

    root = tmp_path_factory.mktemp("qv_adapters")
    make_peft_adapter(tiny_llama_dir, root / "alpha", rank=4, seed=1, targets=["q_proj", "v_proj"])
    make_peft_adapter(tiny_llama_dir, root / "beta", rank=4, seed=2, targets=["q_proj", "v_proj"])
    return root


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tied"), tie=True, seed=1)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 server (tests/s3_server.py) with an `adapters` bucket, one per test module that asks."""
    from tests.s3_server import S3Server

    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        server.client().make_bucket("adapters")
        yield server
