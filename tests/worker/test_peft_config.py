"""adapter_config.json checks (worker/peft_config.py): a malformed field is an AdapterError that names
it, never a TypeError or a regex error from deep inside PEFT's matching rules."""

from __future__ import annotations

import json

import pytest
import torch

from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
from tests.worker.test_peft_adapter import make_adapter

pytest.importorskip("peft")


@pytest.mark.parametrize(("changes", "field"), [
    ({"target_modules": "q_proj|["}, "target_modules"),
    ({"target_modules": [1]}, "target_modules"),
    ({"target_modules": 5}, "target_modules"),
    ({"exclude_modules": "["}, "exclude_modules"),
    ({"exclude_modules": 5}, "exclude_modules"),
    ({"layers_to_transform": "01"}, "layers_to_transform"),
    ({"layers_to_transform": [0, "1"]}, "layers_to_transform"),
    ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern"),
    ({"alpha_pattern": {"*q_proj": 4}}, "alpha_pattern"),
    ({"base_model_name_or_path": 5}, "base_model_name_or_path"),
], ids=["target_regex", "target_int_item", "target_int", "exclude_regex", "exclude_int",
        "layers_str", "layers_str_item", "rank_pattern_regex", "alpha_pattern_regex", "base_model_int"])
def test_malformed_fields_are_adapter_errors_naming_the_field(changes, field, tmp_path):
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    with pytest.raises(AdapterError, match=field):
        load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32,
                          base_model_name="org/tiny-llama")


def test_well_formed_optional_fields_still_load(tmp_path):
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1],
                 rank_pattern={"v_proj": 4}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 16})
    w = load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32)
    assert sorted(w.modules) == [(1, "q_proj"), (1, "v_proj")]
    assert w.modules[(1, "q_proj")].scale == 4.0 and w.modules[(1, "v_proj")].scale == 2.0
