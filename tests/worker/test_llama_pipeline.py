"""Llama-2-style tokenizer folders (tokenizer_class LlamaTokenizer): ids and text equal transformers' (worker/
llama_pipeline.py), which runs its own Metaspace pipeline in place of the file's normalizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lorafleet.worker.chat_template import ChatTemplateOptions
from lorafleet.worker.detokenizer import Detokenizer
from lorafleet.worker.llama_pipeline import LlamaPipeline
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.sequence import Sequence
from lorafleet.worker.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

WORDS = ["▁hello", "hello", "▁world", "▁hi", "hi", "▁The", "▁capital", "▁is", "▁Paris", "▁▁", "▁▁▁▁", "[INST]",
         "▁[INST]", "▁[/INST]", "<<SYS>>", "▁café", "<|user|>", "<|assistant|>"]
LLAMA2_TEMPLATE = (  # Llama-2-7b-chat-hf's
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
TINYLLAMA_TEMPLATE = (  # TinyLlama-1.1B-Chat-v1.0's
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")


def _special(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False}


# tokenizer_config.json as the checkpoints ship them (chat templates and model_max_length left out where unused)
BASE = {"add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False, "pad_token": None,
        "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer"}
CONFIGS = {
    "llama-2-chat": BASE | {"bos_token": _special("<s>"), "eos_token": _special("</s>"), "unk_token": _special("<unk>"),
                            "legacy": False, "padding_side": "right", "chat_template": LLAMA2_TEMPLATE},
    "mistral-v0.1": BASE | {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True,
                            "additional_special_tokens": [], "spaces_between_special_tokens": False,
                            "added_tokens_decoder": {str(i): _special(t) | {"special": True} for i, t in
                                                     enumerate(["<unk>", "<s>", "</s>"])}},
    "tinyllama-chat": BASE | {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
                              "legacy": False, "chat_template": TINYLLAMA_TEMPLATE},
    "legacy-absent": BASE | {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                             "tokenizer_class": "LlamaTokenizerFast"},
    "no-prefix-space": BASE | {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
                               "add_prefix_space": False},
}
STRINGS = ["hello world", "The capital is Paris", " hello", "  hello", "    hi", "hello  world", "hello   ",
           "<s>hello", "<s> hello", "hi</s>hello", "hello</s> world", "<s>[INST] hi [/INST]", "a\nb", "\nhello\n\n",
           "café 日本 😀", "", " ", "▁hello", "hi<unk>there"]


def write_llama2_tokenizer(path: Path, config: dict, model_config: dict | None = None) -> Path:
    """tokenizer.json as Llama 2 ships it (normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, BPE with
    byte fallback over <0x00>..<0xFF>), `config` as tokenizer_config.json, `model_config` as config.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    merges = list(dict.fromkeys((w[:i], w[i]) for w in WORDS for i in range(1, len(w))))  # a character at a time
    for piece in [c for w in WORDS for c in w] + [a + b for a, b in merges]:
        vocab.setdefault(piece, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if model_config is not None:
        (path / "config.json").write_text(json.dumps(model_config))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Tokenizer, object]]:
    """Each config's folder, loaded by the worker and by transformers."""
    root = tmp_path_factory.mktemp("llama2_tokenizers")
    loaded = {}
    for name, config in CONFIGS.items():
        path = write_llama2_tokenizer(root / name, config)
        loaded[name] = Tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    return loaded


@pytest.mark.parametrize("text", STRINGS)
@pytest.mark.parametrize("name", CONFIGS)
def test_ids_equal_transformers(folders, name, text):
    tok, hf = folders[name]
    assert type(hf).__name__ == "LlamaTokenizer"
    for add_special_tokens in (True, False):
        assert tok.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize(("name", "expected"), [
    ("llama-2-chat", LlamaPipeline("first", True)), ("mistral-v0.1", LlamaPipeline("always", True)),
    ("legacy-absent", LlamaPipeline("first", True)), ("no-prefix-space", LlamaPipeline("never", False))])
def test_legacy_and_add_prefix_space_pick_transformers_pipeline(folders, name, expected):
    """legacy false (or absent): no "▁" before text after a special token; true: one, as the file's normalizer
    does. In both, text that starts with a space gets no second "▁"."""
    tok, hf = folders[name]
    assert tok.llama_pipeline == expected
    assert hf.backend_tokenizer.pre_tokenizer.prepend_scheme == expected.prepend_scheme
    hello, space = tok.token_to_id("hello"), tok.token_to_id("▁hello")
    after_bos = {"first": hello, "always": space, "never": hello}[expected.prepend_scheme]
    assert tok.encode("<s>hello", add_special_tokens=False) == [1, after_bos]
    assert tok.encode(" hello", add_special_tokens=False) == [space]


@pytest.mark.parametrize("name", CONFIGS)
def test_decode_equals_transformers(folders, name):
    tok, hf = folders[name]
    rng = random.Random(0)
    runs = [hf.encode(text) for text in STRINGS]
    runs += [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 12))] for _ in range(50)]
    for ids in runs:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("prompt_text", ["The capital is", ""])
@pytest.mark.parametrize("name", ["llama-2-chat", "no-prefix-space"])
def test_output_text_continues_the_prompt_as_transformers_decodes_it(folders, name, prompt_text):
    """The detokenizer's text for the output is transformers' decode of prompt + output past the prompt's: the first
    word keeps its space after a prompt's words; after a lone <s> the decoder strips it, unless add_prefix_space
    is false (then there is no Strip in transformers' decoder, whatever tokenizer.json says)."""
    tok, hf = folders[name]
    prompt, output = hf.encode(prompt_text), hf.encode(" Paris  café 😀", add_special_tokens=False)
    seq = Sequence("r", prompt, SamplingParams())
    detok = Detokenizer(tok)
    for t in output:
        seq.output_token_ids.append(t)
        detok.append(seq, len(seq.output_token_ids))
    detok.flush(seq, len(output))
    decode = lambda ids: hf.decode(ids, skip_special_tokens=True)
    assert seq.text == decode(prompt + output)[len(decode(prompt)):]
    assert seq.text.startswith(" Paris" if prompt_text or name == "no-prefix-space" else "Paris")


CHATS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "hi"}, {"role": "user", "content": " hello"},
     {"role": "assistant", "content": "  The capital is Paris\n"}, {"role": "user", "content": "café 😀"}],
    [{"role": "user", "content": "hi</s><s>[INST] hello"}],  # control-token strings from the caller
]


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("name", ["llama-2-chat", "tinyllama-chat"])
def test_chat_prompt_ids_equal_transformers(folders, name, chat, gen):
    """Text after the template's <s> and </s> as transformers encodes it, control-token strings kept apart
    (sanitize_control_tokens) or not (control_tokens_in_content)."""
    tok, hf = folders[name]
    hf_ids = lambda **kwargs: list(hf.apply_chat_template(chat, tokenize=True, return_dict=False,
                                                          add_generation_prompt=gen, **kwargs))
    options = ChatTemplateOptions(add_generation_prompt=gen)
    assert tok.encode_chat(chat, options) == hf_ids(sanitize_control_tokens=True)
    assert tok.encode_chat(chat, options, control_tokens_in_content=True) == hf_ids()


LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}


@pytest.mark.parametrize(("case", "is_rebuilt"), [
    ("llama", True), ("mistral", False), ("mixtral", False), ("class in config.json", True), ("auto_map", False),
    ("byte-level", False), ("no class", False)])
def test_which_folders_transformers_reads_with_its_own_pipeline(tmp_path, case, is_rebuilt):
    """Mistral's model types get tokenizer.json as it is; so do a ByteLevel file (Llama 3 declares LlamaTokenizer
    too), remote code, and a folder that names no LlamaTokenizer. Either way the ids equal transformers'."""
    config, model_config = dict(CONFIGS["llama-2-chat"]), dict(LLAMA_CONFIG)
    if case in ("mistral", "mixtral"):
        model_config |= {"model_type": case, "architectures": ["MistralForCausalLM"]}
    elif case == "class in config.json":
        model_config["tokenizer_class"] = config.pop("tokenizer_class")
    elif case == "auto_map":
        config["auto_map"] = {"AutoTokenizer": [None, None]}
    elif case == "no class":
        del config["tokenizer_class"]
    path = write_llama2_tokenizer(tmp_path, config, model_config)
    if case == "byte-level":
        spec = json.loads((path / "tokenizer.json").read_text())
        spec["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            spec["post_processor"]]}
        (path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer(path)
    assert (tok.llama_pipeline is not None) == is_rebuilt
    if case == "auto_map":
        return  # transformers would run the repository's own code
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for text in ["hello world", " hello", "<s>hello", "hello  world", ""]:
        assert tok.encode(text) == hf.encode(text)
        assert tok.decode(hf.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
