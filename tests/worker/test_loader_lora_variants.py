"""VeLoRA and MonteCLoRA adapters: plain LoRA at inference (their extra tensors serve training only), so
they are served, and give PEFT's own output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
from tests.worker.test_peft_adapter import (
    BASE_NAME,
    IDS,
    make_adapter,
    peft_modules,
    tiny_base,
    unmerged_logits,
)

peft = pytest.importorskip("peft")

VARIANTS = {
    "velora_random": lambda: dict(velora_config=peft.VeloraConfig(num_groups=4, init_type="random")),
    "velora_batch_average": lambda: dict(velora_config=peft.VeloraConfig(num_groups=8)),
    "monteclora": lambda: dict(monteclora_config=peft.MontecloraConfig(num_samples=3, sample_scaler=0.5)),
}
EXTRA = {"velora": "lora_velora_embed", "monteclora": "lora_monteclora_sampler"}


@pytest.fixture(scope="module")
def model_config() -> dict:
    return tiny_base().config.to_dict()


def _extra_keys(path, variant: str) -> list[str]:
    return [k for k in load_file(str(path / "adapter_model.safetensors")) if EXTRA[variant.split("_")[0]] in k]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_is_served_as_peft_serves_it(variant, tmp_path, model_config):
    path = tmp_path / variant
    pm = make_adapter(path, seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                      **VARIANTS[variant]())
    assert _extra_keys(path, variant)  # PEFT saves the variant's own tensors beside lora_A/lora_B
    weights = load_peft_adapter(path, model_config, dtype=torch.float32, base_model_name=BASE_NAME)
    expected = peft_modules(pm)
    assert {k: (m.rank, m.scale) for k, m in weights.modules.items()} == expected

    ours = unmerged_logits(weights, IDS)
    loaded = peft.PeftModel.from_pretrained(tiny_base(), str(path)).eval()
    with torch.no_grad():
        theirs = loaded(IDS).logits
        base = tiny_base()(IDS).logits
    assert (theirs - base).abs().max() > 1e-2  # the adapter does change the output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(ours, pm(IDS).logits, rtol=0, atol=1e-4)


def test_variant_tensors_are_refused_without_the_variant_config(tmp_path, model_config):
    path = tmp_path / "velora"
    make_adapter(path, r=4, lora_alpha=8, target_modules=["q_proj"], **VARIANTS["velora_random"]())
    config = json.loads((path / "adapter_config.json").read_text())
    config["velora_config"] = None
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="unexpected tensor .*lora_velora_embed"):
        load_peft_adapter(path, model_config, dtype=torch.float32)


def test_variant_tensor_of_a_module_without_lora_weights_is_refused(tmp_path, model_config):
    path = tmp_path / "monteclora"
    make_adapter(path, r=4, lora_alpha=8, target_modules=["q_proj"], **VARIANTS["monteclora"]())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    stray = "base_model.model.model.layers.1.mlp.up_proj.lora_monteclora_sampler.std_prior"
    tensors[stray] = torch.zeros(4)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=f"tensor '{stray}' belongs to a module without lora_A/lora_B"):
        load_peft_adapter(path, model_config, dtype=torch.float32)
