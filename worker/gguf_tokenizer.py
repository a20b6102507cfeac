"""A GGUF's byte-level BPE vocabulary turned back into a `tokenizers` tokenizer.json.

GGUF stores a GPT-2 style tokenizer as parallel arrays (`tokenizer.ggml.tokens`, `.token_type`,
`.merges` as "a b" strings) plus a pre-tokenizer *name* (`tokenizer.ggml.pre`); the regexes live
in llama.cpp's source. We map the names we know onto the equivalent `tokenizers` pipeline.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" (each digit alone), then the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt-2", "gpt2"):
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt-2, default)")


def build_tokenizer(reader) -> Tokenizer:
    """Byte-level BPE tokenizer equivalent to the GGUF's `gpt2` tokenizer."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|> ...) must match as whole strings and never be split by BPE.
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
               if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer


def tokenizer_config(reader) -> dict:
    """tokenizer_config.json: special tokens and the chat template from the GGUF metadata."""
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        idx = _field(reader, key)
        return None if idx is None else tokens[idx]

    config = {
        # Load tokenizer.json as is (a model-specific class would rebuild the pre-tokenizer).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
    }
    template = _field(reader, "tokenizer.chat_template")
    # A model whose tool rendering is a template of its own (Hermes 2 Pro) names it as llama.cpp writes it.
    tool_use = _field(reader, "tokenizer.chat_template.tool_use")
    if tool_use:  # llama.cpp's writer leaves the default out when there is none
        named = {"default": template, "tool_use": tool_use}
        config["chat_template"] = [{"name": n, "template": t} for n, t in named.items() if t]
    elif template:
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}
