"""PEFT adapter loading and validation, with PEFT itself as the oracle.

Adapters are made with `peft` on a random tiny Llama (hidden 64, 2 layers, GQA). For each, the
ranks/scales we derive must equal those PEFT's own LoraLayers use, and an unmerged forward with our
`LoRAWeights` must equal PEFT's forward and the merged model's. Every refusal is exercised.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.worker.peft_adapter import AdapterError, LoRAWeights, load_peft_adapter
from lorafleet.worker.peft_patterns import is_targeted
from lorafleet.worker.vocab_digest import vocab_digest
from tests.lora_factory import sentencepiece_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

BASE_NAME = "org/tiny-llama"
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_base() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config._name_or_path = BASE_NAME
    model.name_or_path = BASE_NAME
    return model


@pytest.fixture(scope="module")
def model_config() -> dict:
    return tiny_base().config.to_dict()


def make_adapter(path, *, seed: int = 0, **lora_kwargs):
    """Save a PEFT adapter with non-zero random B (PEFT initialises B to 0) and return the PeftModel."""
    cfg = peft.LoraConfig(**{"lora_dropout": 0.0, **lora_kwargs})
    pm = peft.get_peft_model(tiny_base(), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(str(path))
    return pm.eval()


def peft_modules(pm) -> dict[tuple[int, str], tuple[int, float]]:
    """(layer, proj) -> (rank, scaling) as PEFT's own layers hold them."""
    out = {}
    for name, mod in pm.named_modules():
        if isinstance(mod, peft.tuners.lora.LoraLayer) and "default" in mod.r:
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            out[(layer, parts[-1])] = (mod.r["default"], mod.scaling["default"])
    return out


def unmerged_logits(weights: LoRAWeights, ids: torch.Tensor, base=None) -> torch.Tensor:
    """y = W x + scale * B (A x) on every adapted Linear, from our LoRAWeights only."""
    base = base or tiny_base()
    hooks = []
    for (layer, proj), m in weights.modules.items():
        block = base.model.layers[layer]
        linear = getattr(block.self_attn if proj in ALL7[:4] else block.mlp, proj)

        def hook(mod, inputs, out, m=m):
            x = inputs[0]
            return out + m.scale * ((x @ m.a.to(x.dtype).T) @ m.b.to(x.dtype).T)

        hooks.append(linear.register_forward_hook(hook))
    try:
        with torch.no_grad():
            return base(ids).logits
    finally:
        for h in hooks:
            h.remove()


IDS = torch.tensor([[3, 17, 42, 99, 5, 250, 7, 128, 64, 1]])

CASES = {
    "r4_qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8_rslora_all7": dict(r=8, lora_alpha=12, use_rslora=True, target_modules=ALL7),
    "r16_all_linear": dict(r=16, lora_alpha=7, target_modules="all-linear"),
    "r32_regex": dict(r=32, lora_alpha=48, target_modules=r".*\.layers\.1\.(self_attn\.(k|o)_proj|mlp\.up_proj)"),
    "patterns": dict(r=8, lora_alpha=16, target_modules=ALL7,
                     rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 12},
                     # "proj" matches no module: PEFT anchors a key at a name-segment boundary.
                     alpha_pattern={"proj": 99, "v_proj": 3, "model.layers.0.mlp.up_proj": 5}),
    "layers_to_transform": dict(r=6, lora_alpha=9, target_modules=["q_proj", "gate_proj"], layers_to_transform=[1]),
    "layers_pattern": dict(r=6, lora_alpha=9, target_modules=["q_proj"], layers_to_transform=0,
                           layers_pattern=["h", "layers"]),
    # The segment at the name's start: PEFT matches `model.layers` from the name's start.
    "layers_pattern_dotted": dict(r=5, lora_alpha=10, target_modules=["v_proj", "up_proj"], layers_to_transform=[1],
                                  layers_pattern="model.layers"),
    # A training script's list for several architectures: PEFT passes over the names a Llama lacks.
    "other_architectures_names": dict(r=4, lora_alpha=8, target_modules=["q_proj", "fc1", "fc2", "query_key_value"]),
    # A Llama's projections have no bias to train: the file is plain LoRA.
    "bias_all": dict(r=4, lora_alpha=8, bias="all", target_modules=["k_proj", "down_proj"]),
    "bias_lora_only": dict(r=4, lora_alpha=8, bias="lora_only", target_modules=["o_proj"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_peft_ranks_scales_and_outputs(case, tmp_path, model_config):
    pm = make_adapter(tmp_path / case, seed=len(case), **CASES[case])
    weights = load_peft_adapter(tmp_path / case, model_config, dtype=torch.float32, base_model_name=BASE_NAME)
    expected = peft_modules(pm)
    assert set(weights.modules) == set(expected)
    for key, (r, scaling) in expected.items():
        assert weights.modules[key].rank == r, key
        assert weights.modules[key].scale == pytest.approx(scaling, rel=1e-12), key
    assert weights.name == case and weights.base_model == BASE_NAME
    assert weights.nbytes == sum(m.a.numel() * 4 + m.b.numel() * 4 for m in weights.modules.values())

    # Unmerged with our weights == PEFT unmerged == merged into the base (fp32, 1e-4).
    ours = unmerged_logits(weights, IDS)
    with torch.no_grad():
        theirs = pm(IDS).logits
        merged = pm.merge_and_unload()(IDS).logits
        base = tiny_base()(IDS).logits
    assert (theirs - base).abs().max() > 1e-2  # the adapter does change the output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    torch.testing.assert_close(ours, merged, rtol=0, atol=1e-4)


def test_a_layers_pattern_naming_no_segment_of_the_base_targets_nothing_as_in_peft(tmp_path, model_config):
    """PEFT finds the layer index after a `layers_pattern` segment only: with `h` (GPT-2's) on a Llama it targets
    no module and refuses the adapter; its weights must not be served as if the pattern were not there."""
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"], layers_to_transform=[0],
                 layers_pattern="layers")
    config_path = tmp_path / "x" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "layers_pattern": "h"}))
    with pytest.raises(AdapterError):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


@pytest.mark.parametrize(("pattern", "targeted"), [("blocks|layers", True), ("s)|(b", False)])
def test_a_layers_pattern_alternation_stays_inside_its_segment(pattern, targeted):
    """Grouped, `blocks|layers` names either segment; a pattern that closes the group leaves a branch without
    the layer index, which matches nothing (it raised a TypeError, a 500 through the admin API)."""
    config = {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": pattern}
    assert is_targeted(config, "model.layers.0.self_attn.q_proj") == targeted


def test_pattern_semantics_follow_peft(tmp_path, model_config):
    pm = make_adapter(tmp_path / "p", **CASES["patterns"])
    w = load_peft_adapter(tmp_path / "p", model_config, dtype=torch.float32)
    assert w.modules[(0, "q_proj")].rank == 4 and w.modules[(1, "q_proj")].rank == 4
    assert w.modules[(1, "down_proj")].rank == 12 and w.modules[(0, "down_proj")].rank == 8
    assert w.modules[(0, "v_proj")].scale == pytest.approx(3 / 8)
    assert w.modules[(0, "up_proj")].scale == pytest.approx(5 / 8)
    assert w.modules[(1, "up_proj")].scale == pytest.approx(16 / 8)
    assert w.modules[(0, "q_proj")].scale == pytest.approx(16 / 4)
    assert peft_modules(pm)[(1, "down_proj")] == (12, pytest.approx(16 / 12))


def test_rank_alpha_metadata_travels_with_the_weights(tmp_path, model_config):
    """Pitfall: mixing adapters of different rank/alpha gives wrong results if metadata is lost."""
    make_adapter(tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    cfg = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 32
    (tmp_path / "b" / "adapter_config.json").write_text(json.dumps(cfg))
    wa = load_peft_adapter(tmp_path / "a", model_config, dtype=torch.float32)
    wb = load_peft_adapter(tmp_path / "b", model_config, dtype=torch.float32)
    assert wa.version != wb.version  # different content, different version
    for key, ma in wa.modules.items():
        mb = wb.modules[key]
        assert torch.equal(ma.a, mb.a) and torch.equal(ma.b, mb.b)
        assert (ma.scale, mb.scale) == (2.0, 8.0)
    out_a, out_b = unmerged_logits(wa, IDS), unmerged_logits(wb, IDS)
    assert (out_a - out_b).abs().max() > 1e-2
    for path, ours in ((tmp_path / "a", out_a), (tmp_path / "b", out_b)):
        ref = peft.PeftModel.from_pretrained(tiny_base(), str(path)).eval()
        with torch.no_grad():
            torch.testing.assert_close(ours, ref(IDS).logits, rtol=0, atol=1e-4)


def test_dtype_name_and_version(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=4, target_modules=["q_proj"])
    w = load_peft_adapter(tmp_path / "x", model_config, dtype="bfloat16", name="tenant-a", version="v7")
    assert (w.name, w.version) == ("tenant-a", "v7")
    assert all(m.a.dtype == m.b.dtype == torch.bfloat16 for m in w.modules.values())
    assert w.nbytes == sum(m.a.numel() * 2 + m.b.numel() * 2 for m in w.modules.values())
    again = load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    assert len(again.version) == 12 and again.version == load_peft_adapter(
        tmp_path / "x", model_config, dtype=torch.float32).version


def test_accepts_the_engines_model_config(tmp_path):
    model_config_mod = pytest.importorskip("lorafleet.worker.model_config")
    tiny_base().save_pretrained(tmp_path / "base")
    mc = model_config_mod.ModelConfig.from_dir(tmp_path / "base")
    make_adapter(tmp_path / "x", r=4, lora_alpha=4, target_modules=ALL7)
    w = load_peft_adapter(tmp_path / "x", mc, dtype=torch.float32)
    assert len(w.modules) == 14


# ---- refusals --------------------------------------------------------------------------------------

def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def test_refuses_pickle_weights_without_opening_them(tmp_path, model_config, monkeypatch):
    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load must never run on adapter files")

    monkeypatch.setattr(torch, "load", no_torch_load)
    pm = peft.get_peft_model(tiny_base(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    pm.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    with pytest.raises(AdapterError, match=r"pickle.*adapter_model\.bin.*safetensors"):
        load_peft_adapter(tmp_path / "bin", model_config, dtype=torch.float32)
    # A pickle next to the safetensors weights (hub repos often hold both) is left unopened, as a copy staged
    # from the object store leaves it out: the same folder was served from S3 and refused from a local path.
    make_adapter(tmp_path / "both", r=4, lora_alpha=4, target_modules=["q_proj"])
    shutil.copy(tmp_path / "bin" / "adapter_model.bin", tmp_path / "both" / "adapter_model.bin")
    alone = load_peft_adapter(tmp_path / "both", model_config, dtype=torch.float32)
    (tmp_path / "both" / "adapter_model.bin").unlink()
    assert alone.version == load_peft_adapter(tmp_path / "both", model_config, dtype=torch.float32).version


@pytest.mark.parametrize("kwargs,message", [
    (dict(use_dora=True, target_modules=["q_proj"]), "DoRA"),
    (dict(modules_to_save=["lm_head"], target_modules=["q_proj"]), "modules_to_save"),
    (dict(target_modules=["embed_tokens", "q_proj"]), "embedding LoRA"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
], ids=["dora", "modules_to_save", "embedding", "lm_head"])
def test_refuses_unsupported_features(kwargs, message, tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, **kwargs)
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


def test_refuses_dora_and_embedding_tensors_even_if_config_hides_them(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    _edit_config(tmp_path / "x", use_dora=False)
    with pytest.raises(AdapterError, match="DoRA"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    make_adapter(tmp_path / "e", r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    _edit_config(tmp_path / "e", target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="embedding LoRA"):
        load_peft_adapter(tmp_path / "e", model_config, dtype=torch.float32)


def test_target_modules_that_name_nothing_of_a_llama_and_bias_tensors_are_refused(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(tmp_path / "x", target_modules=["fc1", "dense"])  # an adapter of another architecture
    with pytest.raises(AdapterError, match=r"target_modules \['dense', 'fc1'\] are not projections of a Llama"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    _edit_config(tmp_path / "x", target_modules=["q_proj"], bias="some")
    with pytest.raises(AdapterError, match="bias='some'"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    _edit_config(tmp_path / "x", bias="all")
    tensors = load_file(str(tmp_path / "x" / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # a base with biases
    save_file(tensors, str(tmp_path / "x" / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="LoRA biases are not supported"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


def test_shape_mismatch_names_module_and_shapes(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    bigger = {**model_config, "hidden_size": 96, "head_dim": 24}
    with pytest.raises(AdapterError) as err:
        load_peft_adapter(tmp_path / "x", bigger, dtype=torch.float32)
    msg = str(err.value)
    assert "layer 0 q_proj" in msg and "[r, 96]" in msg and "[96, r]" in msg
    assert "lora_A [4, 64]" in msg and "lora_B [64, 4]" in msg and "different base model" in msg
    with pytest.raises(AdapterError, match=r"layer 1.*1 layers"):
        load_peft_adapter(tmp_path / "x", {**model_config, "num_hidden_layers": 1}, dtype=torch.float32)


@pytest.mark.parametrize("bad", ["shape", "layer", "projection", "b_rank"])
def test_tensors_that_fit_no_projection_are_refused_before_any_copy(tmp_path, model_config, monkeypatch, bad):
    """A tensor of the wrong width, of a layer or projection the base has not, is refused from the file's
    header: a rank-4 lora_A of 33M columns (rank checks pass) cost twice the file's size in memory before."""
    from lorafleet.worker import safetensors_bytes

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    weights = tmp_path / "x" / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in tensors if "layers.0." in k and "lora_A" in k)
    b_key = key.replace("lora_A", "lora_B")
    wrong = {"shape": (key, torch.zeros(4, 4096)), "layer": (key.replace("layers.0.", "layers.7."), tensors[key]),
             "projection": (key.replace("q_proj", "qkv_proj"), tensors[key]),
             "b_rank": (b_key, torch.zeros(tensors[b_key].shape[0], 5000))}[bad]  # lora_B's rank is its 2nd size
    tensors.pop(wrong[0] if bad == "b_rank" else key)
    tensors[wrong[0]] = wrong[1]
    save_file(tensors, weights)
    copies = []
    monkeypatch.setattr(safetensors_bytes, "_tensor", lambda *a: copies.append(a) or torch.zeros(1))
    with pytest.raises(AdapterError, match="different base model|layers|not a Llama projection|share one rank"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    assert copies == []


def test_a_and_b_of_two_ranks_are_named_a_corrupt_file_not_another_base(tmp_path, model_config):
    """lora_A [4, 64] beside lora_B [64, 8] fits the base on both sides: the file is corrupt or mixes two
    adapters, which the refusal says, instead of sending the user to look for another base model."""
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    path = tmp_path / "x" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    first_b = next(k for k in tensors if "q_proj.lora_B" in k)
    save_file({**tensors, first_b: torch.ones(tensors[first_b].shape[0], 8)}, str(path))
    with pytest.raises(AdapterError) as err:
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    msg = str(err.value)
    assert "lora_A [4, 64] has rank 4 and lora_B [64, 8] rank 8" in msg and "corrupt" in msg, msg
    assert "different base model" not in msg


def test_a_rank_above_max_rank_is_refused_from_the_header_before_any_tensor_is_copied(tmp_path, model_config,
                                                                                      monkeypatch):
    """A rank-1024 adapter on a pool of max rank 64 was copied and converted whole (2 GB of host memory for a
    625 MB file, kept by the allocator after) before the pool refused it. Whatever its config says."""
    from lorafleet.worker import safetensors_bytes

    make_adapter(tmp_path / "x", r=8, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(tmp_path / "x", r=2)  # a config that understates it changes nothing

    def no_copy(*args):
        raise AssertionError("a tensor was copied")

    with monkeypatch.context() as patched:
        patched.setattr(safetensors_bytes, "_tensor", no_copy)
        with pytest.raises(AdapterError, match=r"rank 8 \(.*q_proj\.lora_A\.weight\) is above the pool's max_rank 4: "
                                               r"raise --max-lora-rank \(at least 8\)"):
            load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, max_rank=4)
    _edit_config(tmp_path / "x", r=8)
    assert load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, max_rank=8).modules


def test_the_engine_refuses_a_rank_above_its_max_lora_rank_from_the_header(tiny_llama_dir, tmp_path, monkeypatch):
    from lorafleet.worker import Engine, EngineConfig, safetensors_bytes
    from tests.lora_factory import make_peft_adapter

    make_peft_adapter(tiny_llama_dir, tmp_path / "wide", rank=16, seed=1, targets=["q_proj"])
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_pages=64, max_lora_rank=8))
    monkeypatch.setattr(safetensors_bytes, "_tensor", lambda *args: pytest.fail("a tensor was copied"))
    with pytest.raises(AdapterError, match=r"rank 16 .* max_rank 8: raise --max-lora-rank \(at least 16\)"):
        engine.register_adapter("wide", tmp_path / "wide")


def test_refuses_rank_that_disagrees_with_config(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(tmp_path / "x", r=6)
    with pytest.raises(AdapterError, match="gives rank 6.*weights have rank 4"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    _edit_config(tmp_path / "x", r=4, rank_pattern={"layers.1.self_attn.q_proj": 2})
    with pytest.raises(AdapterError, match="layer 1 q_proj.*rank 2"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


def test_pattern_keys_are_compiled_once_per_load_and_bounded(tmp_path, model_config, monkeypatch):
    """A rank_pattern of thousands of keys outgrew the regex module's cache of 500: every key was compiled
    again for every module, with the interpreter lock held, while the admin lock waited (5,000 keys: 15 s on
    a 2-layer model). Keys are compiled once per load, their alpha as PEFT picks it, and at most 4,096."""
    from collections import Counter

    import regex

    from lorafleet.worker import peft_patterns

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    keys = {f"layers.{i}.self_attn.nothing_{i}": 4 for i in range(1000)}
    _edit_config(tmp_path / "x", alpha_pattern={**keys, "layers.1.self_attn.v_proj": 32})
    compiled = []
    real = regex.compile
    monkeypatch.setattr(peft_patterns.regex, "compile", lambda *a, **k: compiled.append(a[0]) or real(*a, **k))
    weights = load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    # checked once, compiled for matching once: not once per module
    assert len(compiled) == 2 * 1001 and max(Counter(compiled).values()) == 2
    assert weights.modules[(1, "v_proj")].scale == 32 / 4 and weights.modules[(0, "v_proj")].scale == 8 / 4
    _edit_config(tmp_path / "x", alpha_pattern={f"k{i}": 4 for i in range(4097)})
    with pytest.raises(AdapterError, match="alpha_pattern has 4097 keys, over the 4096"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


def test_a_safetensors_header_larger_than_any_lora_s_is_refused_before_parsing(tmp_path, model_config):
    """A header listing millions of empty tensors took half a minute and gigabytes to parse before any check."""
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    header = json.dumps({"__metadata__": {"pad": "x" * (3 << 20)}}).encode()
    (tmp_path / "x" / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(AdapterError, match="a safetensors header of 31457.* bytes, over the 2097152"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


def test_refuses_incomplete_or_mismatched_weight_files(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    path = tmp_path / "x" / "adapter_model.safetensors"
    full = load_file(str(path))
    drop_b = {k: v for k, v in full.items() if not ("layers.1.self_attn.q_proj" in k and "lora_B" in k)}
    save_file(drop_b, str(path))
    with pytest.raises(AdapterError, match="layer 1 q_proj has no lora_B"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    save_file({k: v for k, v in full.items() if "layers.1.self_attn.q_proj" not in k}, str(path))
    with pytest.raises(AdapterError, match="selects 1 module.*layer 1 q_proj"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    save_file(full, str(path))
    _edit_config(tmp_path / "x", target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="v_proj has weights but target_modules"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    # q_proj's tensors under mlp: no such module in a Llama layer (another architecture, a bad conversion)
    _edit_config(tmp_path / "x", target_modules=["q_proj", "v_proj"])
    save_file({k.replace("layers.0.self_attn.q_proj", "layers.0.mlp.q_proj"): v for k, v in full.items()}, str(path))
    with pytest.raises(AdapterError, match=r"layers\.0\.mlp\.q_proj\.lora_A.*puts q_proj under mlp, but a Llama "
                                           r"layer has it under self_attn"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="cannot read safetensors"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


def test_refuses_bad_configs(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(tmp_path / "x", peft_type="IA3")
    with pytest.raises(AdapterError, match="only LoRA"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    _edit_config(tmp_path / "x", peft_type="LORA", target_modules=["c_attn"])
    with pytest.raises(AdapterError, match=r"\['c_attn'\] are not projections of a Llama"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    _edit_config(tmp_path / "x", target_modules=["q_proj"], lora_alpha=-1)
    with pytest.raises(AdapterError, match="lora_alpha=-1"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    (tmp_path / "x" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    (tmp_path / "x" / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    with pytest.raises(AdapterError, match="not a directory"):
        load_peft_adapter(tmp_path / "missing", model_config, dtype=torch.float32)


def test_loaded_weights_own_their_memory(tmp_path, model_config):
    """The weights are copied out of the file: a file rewritten in place later (same inode, as `cp`
    over it does) changes nothing loaded. Memory-mapped tensors would follow the file (and SIGBUS once
    it is truncated)."""
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    path = tmp_path / "x" / "adapter_model.safetensors"
    w = load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)  # the file's dtype: no cast
    before = {key: (m.a.clone(), m.b.clone()) for key, m in w.modules.items()}
    with open(path, "r+b") as f:
        f.write(bytes(path.stat().st_size))
    for key, m in w.modules.items():
        assert torch.equal(m.a, before[key][0]) and torch.equal(m.b, before[key][1]), key


@pytest.mark.parametrize("changes,message", [
    (dict(lora_alpha=float("nan")), "lora_alpha=nan must be a finite positive number"),
    (dict(lora_alpha=float("inf")), "lora_alpha=inf must be a finite positive number"),
    (dict(r=float("nan")), "r=nan must be a finite positive number"),
    (dict(lora_alpha=10**400), "lora_alpha=1000.* must be a finite positive number"),
    (dict(alpha_pattern={"q_proj": float("nan")}), "alpha_pattern must map .* finite positive numbers"),
    (dict(alpha_pattern={"q_proj": float("-inf")}), "alpha_pattern must map .* finite positive numbers"),
    (dict(rank_pattern={"q_proj": float("nan")}), "rank_pattern must map .* finite positive numbers"),
    (dict(lora_alpha=2e39), r"layer 0 q_proj: scale 5e\+38 .* not a finite float32"),
    (dict(lora_alpha=1e39, use_rslora=True), r"scale 5e\+38 .* not a finite float32"),
], ids=["alpha-nan", "alpha-inf", "r-nan", "alpha-huge-int", "alpha-pattern-nan", "alpha-pattern-minus-inf",
        "rank-pattern-nan", "scale-overflows-float32", "rslora-scale-overflows-float32"])
def test_refuses_non_finite_ranks_alphas_and_scales(changes, message, tmp_path, model_config):
    """json.loads accepts NaN and Infinity; a NaN or inf scale would poison every output of the adapter."""
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(tmp_path / "x", **changes)
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


def test_weights_must_be_finite_in_the_served_dtype(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    path = tmp_path / "x" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[key][0, 0] = 1e6  # finite in float32, beyond float16's 65504
    save_file(tensors, str(path))
    assert load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32).modules[(0, "q_proj")].b[0, 0] == 1e6
    with pytest.raises(AdapterError, match="layer 0 q_proj: weights contain NaN/inf.*float16"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float16)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    with pytest.raises(AdapterError, match="layer 0 q_proj: weights contain NaN/inf"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)


@pytest.mark.parametrize("rename,first,second", [
    # A second PEFT adapter name saved into the same file.
    (lambda k: k.replace(".lora_A.weight", ".lora_A.other.weight"),
     "layers.0.self_attn.q_proj.lora_A.other.weight", "layers.0.self_attn.q_proj.lora_A.weight"),
    # The same projection under another parent module (which no Llama layer has: refused as such first).
    (lambda k: k.replace("self_attn.q_proj", "mlp.q_proj"), "layers.0.mlp.q_proj.lora_A.weight", None),
], ids=["two-adapter-names", "two-parents"])
def test_refuses_two_tensors_for_one_module(rename, first, second, tmp_path, model_config):
    """Two lora_A (or lora_B) tensors for one (layer, projection): one would silently replace the other,
    mixing the A of one adapter with the B of another."""
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    path = tmp_path / "x" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    extra = {rename(k): torch.full_like(v, 7.0) for k, v in tensors.items() if rename(k) != k}
    save_file({**tensors, **extra}, str(path))
    with pytest.raises(AdapterError, match="are both lora_A of layer 0 q_proj" if second else "puts q_proj under mlp"
                       ) as err:
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32)
    assert first in str(err.value) and (second is None or second in str(err.value))


# ---- base model and tokenizer ----------------------------------------------------------------------

@pytest.fixture
def adapter_on_other_base(tmp_path):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(tmp_path / "x", base_model_name_or_path="meta-llama/Llama-3.2-1B")
    return tmp_path / "x"


def test_base_model_mismatch_strict_refuses(adapter_on_other_base, model_config):
    for strict in (True, "strict"):
        with pytest.raises(AdapterError, match=r"trained on base model 'meta-llama/Llama-3.2-1B'.*'tiny-llama'"):
            load_peft_adapter(adapter_on_other_base, model_config, dtype=torch.float32, strict_base=strict,
                              base_model_name="tiny-llama")


def test_an_unknown_base_name_checks_nothing(adapter_on_other_base, model_config):
    """An empty name (a base whose name is not known) refused every adapter, as if it were the name of
    another base; it says nothing, as no name does."""
    for given in ("", ["", None]):
        w = load_peft_adapter(adapter_on_other_base, model_config, dtype=torch.float32, strict_base=True,
                              base_model_name=given)
        assert w.base_model == "meta-llama/Llama-3.2-1B"


def test_base_model_mismatch_warn_and_off(adapter_on_other_base, model_config, caplog):
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.peft_adapter"):
        for strict in (False, "warn"):
            w = load_peft_adapter(adapter_on_other_base, model_config, dtype=torch.float32, strict_base=strict,
                                  base_model_name="tiny-llama")
            assert w.base_model == "meta-llama/Llama-3.2-1B"
    assert sum("Llama-3.2-1B" in r.getMessage() for r in caplog.records) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lorafleet.worker.peft_adapter"):
        load_peft_adapter(adapter_on_other_base, model_config, dtype=torch.float32, strict_base="off",
                          base_model_name="tiny-llama")
    assert not caplog.records
    with pytest.raises(ValueError, match="strict_base"):
        load_peft_adapter(adapter_on_other_base, model_config, dtype=torch.float32, strict_base="maybe")


def test_base_model_name_matches_across_hub_id_and_local_dir(tmp_path, model_config):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])  # trained on "org/tiny-llama"
    w = load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32,
                          base_model_name="/srv/models/Tiny-Llama/")
    assert w.base_model == BASE_NAME


def _bpe_tokenizer(vocab: dict[str, int]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "c")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


VOCAB = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "d": 5}


def test_tokenizer_mismatch_is_refused(tmp_path, model_config):
    """Pitfall: an adapter trained with another tokenizer produces garbage on this base."""
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    _bpe_tokenizer(VOCAB).save(str(base_dir / "tokenizer.json"))
    digest = vocab_digest(base_dir)
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])

    # Same tokens, other ids: the same text becomes different ids -> refused.
    swapped = {**VOCAB, "a": 5, "d": 0}
    other = _bpe_tokenizer(swapped)
    other.save(str(tmp_path / "x" / "tokenizer.json"))
    assert other.encode("abc d").ids != _bpe_tokenizer(VOCAB).encode("abc d").ids
    with pytest.raises(AdapterError, match="tokenizer whose vocabulary differs"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest=digest)
    load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest=digest, strict_base="warn")

    # The same tokenizer, in tokenizer.json or as vocab.json + merges.txt, is accepted.
    _bpe_tokenizer(VOCAB).save(str(tmp_path / "x" / "tokenizer.json"))
    load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest=digest)
    (tmp_path / "x" / "tokenizer.json").unlink()
    _bpe_tokenizer(VOCAB).model.save(str(tmp_path / "x"))
    assert (tmp_path / "x" / "vocab.json").is_file() and (tmp_path / "x" / "merges.txt").is_file()
    assert vocab_digest(tmp_path / "x") == digest
    load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest=digest)
    # An extra added token (e.g. a new pad token) is a different vocabulary.
    tok = _bpe_tokenizer(VOCAB)
    tok.add_special_tokens(["<pad>"])
    tok.save(str(tmp_path / "x" / "tokenizer.json"))
    with pytest.raises(AdapterError, match="tokenizer"):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest=digest)


def test_a_tokenizer_of_the_same_vocabulary_that_splits_text_otherwise_is_refused(tmp_path, model_config):
    """Vocabulary and merges equal, pre-tokenizer or normalizer not: the same text becomes other ids, so the
    adapter was trained on ids this server never produces. The digest of vocabulary and merges alone took them
    as one tokenizer; each side's ids of a few probe texts now tell them apart (tokenizer.json on both)."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    from lorafleet.worker.vocab_digest import probe_encodings

    vocab = {**VOCAB, **{ch: 6 + i for i, ch in enumerate("▁" + "".join(map(chr, range(33, 127))).replace("a", "")
                                                             .replace("b", "").replace("c", "").replace("d", ""))}}
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    _bpe_tokenizer(vocab).save(str(base_dir / "tokenizer.json"))
    digest, encodings = vocab_digest(base_dir), probe_encodings(base_dir)
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    load = functools.partial(load_peft_adapter, tmp_path / "x", model_config, dtype=torch.float32,
                             tokenizer_digest=digest, tokenizer_encodings=encodings)
    variants = {"pre_tokenizer": pre_tokenizers.Metaspace(), "normalizer": normalizers.Lowercase()}
    for attr, value in variants.items():
        tok = _bpe_tokenizer(vocab)
        setattr(tok, attr, value)
        tok.save(str(tmp_path / "x" / "tokenizer.json"))
        assert vocab_digest(tmp_path / "x") == digest
        with pytest.raises(AdapterError, match="turns text into other ids"):
            load()
        load(strict_base="warn")
    _bpe_tokenizer(vocab).save(str(tmp_path / "x" / "tokenizer.json"))  # the same one: served
    load()
    # The same tokenizer saved by a training script that padded, truncated or framed with an end token: the same
    # ids for text (a false refusal before: every probe padded to 64).
    from tokenizers import processors

    tok = _bpe_tokenizer(vocab)
    tok.enable_padding(length=64, pad_id=5, pad_token="d")
    tok.enable_truncation(64)
    tok.post_processor = processors.TemplateProcessing(single="$A d", special_tokens=[("d", 5)])
    tok.save(str(tmp_path / "x" / "tokenizer.json"))
    load()
    # A normalizer whose regex backtracks past the regex engine's limit: `tokenizers` panics (a BaseException,
    # not an Exception), which must be this adapter's error, not the end of the thread that loads it.
    tok = _bpe_tokenizer(vocab)
    tok.normalizer = normalizers.Replace(Regex("(.|.)*(?!)"), "x")
    tok.save(str(tmp_path / "x" / "tokenizer.json"))
    with pytest.raises(AdapterError, match="not a readable tokenizer file .*failed to build or encode"):
        load()
    saved = json.loads((base_dir / "tokenizer.json").read_text())  # the base's vocabulary, in a model tokenizers
    saved["model"]["type"] = "Nope"  # cannot build
    (tmp_path / "x" / "tokenizer.json").write_text(json.dumps(saved))
    with pytest.raises(AdapterError, match="not a readable tokenizer file"):
        load()


def test_an_adapters_tokenizer_runs_in_a_process_of_its_own_under_a_time_limit(tmp_path, model_config,
                                                                               monkeypatch):
    """A tenant's tokenizer.json of the base's vocabulary is run to compare its ids with the base's; its
    pre-tokenizer's regexes are the tenant's. 400 that backtrack just short of the regex engine's limit ran
    54 s in the worker's process with the interpreter lock held: every stream and /healthz stalled. The probe
    now runs in a child process, killed past PROBE_CPU_S of CPU, and the worker's threads run meanwhile. One that
    turns the probes into millions of ids (a normalizer that writes each character out a thousand times) is
    refused by the child, its output never read: it grew the worker by 486 MB for one version."""
    import time

    from lorafleet.worker import vocab_digest as vd
    from tests.ticker import ticking

    base_dir = tmp_path / "base"
    base_dir.mkdir()
    _bpe_tokenizer(VOCAB).save(str(base_dir / "tokenizer.json"))
    saved = json.loads((base_dir / "tokenizer.json").read_text())
    digest, encodings = vocab_digest(base_dir), vd.probe_encodings(base_dir, isolated=False)
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    split = {"type": "Split", "pattern": {"Regex": "^" + "(.*?)" * 8 + "(?!)"}, "behavior": "Isolated",
             "invert": False}
    saved["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split] * 400}
    (tmp_path / "x" / "tokenizer.json").write_text(json.dumps(saved))
    monkeypatch.setattr(vd, "PROBE_CPU_S", 2)
    load = functools.partial(load_peft_adapter, tmp_path / "x", model_config, dtype=torch.float32,
                             tokenizer_digest=digest, tokenizer_encodings=encodings)
    import resource

    def children_cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    with ticking(0.01) as ticks:
        start, cpu_before = time.perf_counter(), children_cpu_s()
        with pytest.raises(AdapterError, match="ran more than 2 s to encode 9 short texts"):
            load()
        took, cpu = time.perf_counter() - start, children_cpu_s() - cpu_before
    # Killed at its CPU limit, not run to its end: the child's CPU time is the bound (a loaded machine stretches
    # the wall-clock time, 2 s of CPU took up to 14 s); the wall clock only has to be far from the hang limit.
    assert cpu < vd.PROBE_CPU_S + 2 and took < vd.PROBE_TIMEOUT_S / 2, (cpu, took)
    assert max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) < 0.5  # the lock was not held meanwhile
    saved["pre_tokenizer"] = None
    saved["normalizer"] = {"type": "Replace", "pattern": {"Regex": "."}, "content": "a" * 1000}
    (tmp_path / "x" / "tokenizer.json").write_text(json.dumps(saved))
    with pytest.raises(AdapterError, match="turns the probe texts into more than"):
        load()


@pytest.mark.parametrize(("files", "added"), [
    ({"added_tokens.json": {"<tool>": 6}}, "'<tool>'"),
    ({"added_tokens.json": {"d": 4}}, "'d'"),  # the base's token under another id
    ({"tokenizer_config.json": {"added_tokens_decoder": {"6": {"content": "<tool>", "special": True}}}}, "'<tool>'"),
    ({"tokenizer_config.json": {"additional_special_tokens": ["<tool>", {"content": "<call>"}]}}, "'<call>', '<tool>'"),
], ids=["added-tokens-json", "added-under-another-id", "added-tokens-decoder", "additional-special-tokens"])
def test_tokens_added_without_a_whole_vocabulary_are_checked_against_the_base(files, added, tmp_path, model_config):
    """A slow (SentencePiece) tokenizer's save writes tokenizer.model, added_tokens.json and tokenizer_config.json,
    no tokenizer.json: its added tokens went unchecked, and the adapter was served on ids it was never trained
    on. The base's own tokens at their own ids are accepted."""
    base = _bpe_tokenizer(VOCAB)
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    (tmp_path / "x" / "tokenizer.model").write_bytes(sentencepiece_model(sorted(VOCAB, key=VOCAB.get)))
    load = functools.partial(load_peft_adapter, tmp_path / "x", model_config, dtype=torch.float32,
                             base_token_id=base.token_to_id)
    for name, content in files.items():
        (tmp_path / "x" / name).write_text(json.dumps(content))
    with pytest.raises(AdapterError, match=re.escape(f"tokenizer files add tokens the served base model does not "
                                                     f"have (or has under other ids): {added};")):
        load()
    load(strict_base="warn")
    for name in files:  # the base's own tokens, as a copy of its files would list them
        own = {"d": 5, "ab": 3} if name == "added_tokens.json" else {
            "added_tokens_decoder": {"5": {"content": "d"}}, "additional_special_tokens": ["abc"]}
        (tmp_path / "x" / name).write_text(json.dumps(own))
    load()


@pytest.mark.parametrize("files", [
    {"tokenizer.json": b'{"model": {"vocab": {"a": 0'},
    {"tokenizer.json": json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 5}]}).encode()},
    {"tokenizer.json": b"[1, 2]"},
    {"tokenizer.json": b"\xff\xfe\x00garbage"},
    {"tokenizer.json": json.dumps({"model": {"vocab": {"a": "zero"}}}).encode()},
    {"vocab.json": b"{"},
    {"vocab.json": b'{"a": 0}', "tokenizer_config.json": b'{"added_tokens_decoder": {"x": {"content": "b"}}}'},
], ids=["truncated", "added-token-without-content", "not-an-object", "not-utf8", "string-id", "bad-vocab-json",
        "bad-added-tokens-decoder"])
def test_malformed_tokenizer_files_are_an_adapter_error_naming_the_file(files, tmp_path, model_config, caplog):
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    for name, data in files.items():
        (tmp_path / "x" / name).write_bytes(data)
    bad = tmp_path / "x" / list(files)[-1]
    with pytest.raises(AdapterError, match=re.escape(f"{bad}: not a readable tokenizer file")):
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest="0" * 64)
    with caplog.at_level(logging.WARNING):  # 'warn' logs it and serves the adapter; 'off' never reads it
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest="0" * 64,
                          strict_base="warn")
    assert str(bad) in caplog.text
    load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest="0" * 64, strict_base="off")


# ---- merged vs unmerged precision ------------------------------------------------------------------

def test_merged_vs_unmerged_precision(tmp_path, model_config):
    """Pitfall: merged and unmerged forms drift apart when precision is not aligned.

    fp32: the kernel path (x@W^T, then scale * (x@A^T)@B^T added by lora_shrink/lora_expand) equals
    x @ (W + scale*B@A)^T within 1e-4. bf16: the unmerged path accumulates the delta in fp32 and
    rounds once into y, so y is within 1 bf16 ulp (rel 2^-8) of (bf16 base output + exact delta);
    merging in bf16 instead rounds W + scale*B@A to bf16 and loses a small delta almost entirely.
    """
    lora = pytest.importorskip("lorafleet.kernels.lora")
    layout_mod = pytest.importorskip("lorafleet.kernels.lora_layout")
    make_adapter(tmp_path / "x", r=8, lora_alpha=16, target_modules=["q_proj"])
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 64, generator=g)  # q_proj weight [out, in]
    x = torch.randn(16, 64, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        weights = load_peft_adapter(tmp_path / "x", model_config, dtype=dtype)
        m = weights.modules[(0, "q_proj")]
        m.scale *= 1e-3  # a delta ~1000x smaller than W x: below bf16 resolution of W's entries
        layout = layout_mod.pack_lora_layout({(0, 0, 0): (m.a, m.b, m.scale)}, num_layers=2, max_slots=1,
                                             page_elems=256, dtype=dtype)
        batch = layout_mod.make_lora_batch(torch.zeros(16, dtype=torch.int32), torch.tensor([8]))
        xd, wd = x.to(dtype), w.to(dtype)
        y = xd @ wd.T  # the shared base GEMM in the model dtype
        base_out = y.clone()
        xa = torch.zeros(1, 16, batch.max_rank, dtype=torch.float32)
        lora.lora_shrink(x=xd, layout=layout, layer=0, proj_ids=[0], batch=batch, out=xa, backend="reference")
        lora.lora_expand(xa=xa, layout=layout, layer=0, proj_ids=[0], batch=batch, y=y, out_offsets=[0],
                         backend="reference")
        delta64 = m.scale * (xd.double() @ m.a.double().T) @ m.b.double().T
        merged_w = (wd.double() + m.scale * m.b.double() @ m.a.double()).to(dtype)
        merged = xd @ merged_w.T
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), xd.double() @ (wd.double() + m.scale * m.b.double()
                                                                    @ m.a.double()).T, rtol=0, atol=1e-4)
            torch.testing.assert_close(y, merged, rtol=0, atol=1e-4)
        else:
            target = base_out.double() + delta64
            assert ((y.double() - target).abs() <= target.abs() * 2**-8 + 1e-30).all()
            err_unmerged = (y.double() - (xd.double() @ wd.double().T + delta64)).abs().mean()
            err_merged = (merged.double() - (xd.double() @ wd.double().T + delta64)).abs().mean()
            # Merging in bf16 loses the delta; the unmerged path keeps it (error dominated by base GEMM).
            assert (merged_w.double() == wd.double()).float().mean() > 0.5  # most merged entries unchanged
            assert err_merged > err_unmerged


def test_same_weights_other_alpha_in_one_engine_batch(tmp_path):
    """Rank/alpha metadata end to end: two adapters with identical matrices but different lora_alpha,
    served in one engine batch, each give PEFT's logprobs for that adapter alone."""
    worker = pytest.importorskip("lorafleet.worker")
    tiny_base().save_pretrained(tmp_path / "tiny-llama")  # dir name = the adapters' base model name
    make_adapter(tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    _edit_config(tmp_path / "b", lora_alpha=32)
    engine = worker.Engine(worker.EngineConfig(model=str(tmp_path / "tiny-llama"), device="cpu", dtype="float32",
                                               num_pages=64, block_size=4))
    prompt = IDS[0].tolist()
    n = 4
    try:
        engine.register_adapter("a", tmp_path / "a")
        engine.register_adapter("b", tmp_path / "b")
        outs = engine.generate([prompt] * 3, worker.SamplingParams(max_tokens=n, temperature=0.0, logprobs=0),
                               adapters=["a", "b", None])
    finally:
        engine.close()
    firsts = []
    for out, path in zip(outs, [tmp_path / "a", tmp_path / "b", None], strict=True):
        model = tiny_base() if path is None else peft.PeftModel.from_pretrained(tiny_base(), str(path)).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for step in range(n):
                logprobs = torch.log_softmax(model(ids).logits[0, -1], -1)
                token = int(logprobs.argmax())
                assert out.token_ids[step] == token
                assert abs(out.logprobs[step].logprob - logprobs[token].item()) < 1e-4
                ids = torch.cat([ids, torch.tensor([[token]])], 1)
        firsts.append(out.logprobs[0].logprob)
    assert abs(firsts[0] - firsts[1]) > 1e-3 and abs(firsts[0] - firsts[2]) > 1e-3


@pytest.mark.parametrize("linked", ["vocab.json", "tokenizer.json"])
def test_a_tokenizer_file_linked_to_a_secret_never_quotes_it(tmp_path, model_config, linked):
    """A tenant who writes its own adapter folder links a tokenizer file to a JSON file the worker can read (its
    API keys file): the load is refused, and the error it sees names the file, never what the file holds. Read
    again after an eviction (the weights' digest known), the files are checked before anything is parsed, and
    its tokenizer, checked at its first load, is not read again."""
    secret = tmp_path / "keys.json"
    secret.write_text('{"tenants": {"globex": {"keys": ["sk-globex-secret"]}}, "additional_special_tokens": [7]}')
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    _bpe_tokenizer(VOCAB).save(str(base_dir / "tokenizer.json"))
    digest = vocab_digest(base_dir)
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    first = load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest=digest)
    (tmp_path / "x" / linked).symlink_to(secret)
    with pytest.raises(AdapterError) as refused:
        load_peft_adapter(tmp_path / "x", model_config, dtype=torch.float32, tokenizer_digest=digest)
    assert "sk-globex" not in str(refused.value) and "tenants" not in str(refused.value), refused.value
    if linked == "vocab.json":  # what is wrong, in the loader's own words
        assert "vocabulary entries must map strings to integer ids (2 do not)" in str(refused.value)
    again = first.reload()  # the eviction's reload: same bytes, served as before
    assert again.modules.keys() == first.modules.keys()


@pytest.mark.parametrize("name", ["added_tokens.json", "tokenizer_config.json"])
def test_added_tokens_read_through_a_link_are_counted_never_quoted(name, tmp_path, model_config):
    """A folder's added-token files are read when it is loaded, after its source was checked: one swapped for a
    link meanwhile (to another tenant's tokenizer_config.json, or to any JSON map of strings the worker can
    read) had up to five of its strings quoted in the version's error, which its tenant reads. Tokens of a file
    that does not lie in the folder itself when opened are counted, not quoted; the folder's own still are."""
    base = _bpe_tokenizer(VOCAB)
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"sk-live-globex-7f3a9c01": 1} if name == "added_tokens.json"
                                 else {"additional_special_tokens": ["<globex-private-tool>"]}))
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    (tmp_path / "x" / "tokenizer.model").write_bytes(sentencepiece_model(sorted(VOCAB, key=VOCAB.get)))
    (tmp_path / "x" / name).symlink_to(secret)
    load = functools.partial(load_peft_adapter, tmp_path / "x", model_config, dtype=torch.float32,
                             base_token_id=base.token_to_id)
    with pytest.raises(AdapterError, match="1 of them, not quoted as .* lay outside the adapter's folder") as refused:
        load()
    assert "globex" not in str(refused.value).replace(str(tmp_path), ""), refused.value
    (tmp_path / "x" / name).unlink()
    os.link(secret, tmp_path / "x" / name)  # a hard link: its other name may be anywhere
    with pytest.raises(AdapterError, match="1 of them, not quoted"):
        load()
    (tmp_path / "x" / name).unlink()
    (tmp_path / "x" / name).write_bytes(secret.read_bytes())  # the folder's own file: its tokens are shown
    with pytest.raises(AdapterError, match="globex"):
        load()
    # The folder itself swapped for a link after its source was checked: what it leads to is not its own.
    (tmp_path / "x").rename(tmp_path / "x.checked")
    (tmp_path / "x").symlink_to(tmp_path / "x.checked", target_is_directory=True)
    with pytest.raises(AdapterError, match="1 of them, not quoted") as refused:
        load()
    assert "globex" not in str(refused.value).replace(str(tmp_path), ""), refused.value
