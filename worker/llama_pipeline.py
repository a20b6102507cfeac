"""LlamaPipeline: the pipeline transformers 5's LlamaTokenizer(Fast) runs in place of tokenizer.json's own.

When tokenizer_config.json names LlamaTokenizer(Fast), transformers 5 keeps tokenizer.json's vocabulary, merges,
added tokens and post-processor, and builds the rest itself (models/llama/tokenization_llama.py,
`LlamaTokenizer.__init__`):

* no normalizer, and a Metaspace pre-tokenizer ("▁" for each space, no split) whose prepend scheme is
  `_get_prepend_scheme` of tokenization_utils_base.py: "always" when `legacy` is true, "first" when it is false or
  absent (LlamaTokenizer's default), "never" when `add_prefix_space` is false (absent: true). Metaspace prepends
  "▁" only to text that does not start with one, and under "first" only to text at the start of the input;
* a BPE model with byte fallback and no unknown token;
* the decoder Replace("▁", " "), ByteFallback, Fuse, then Strip(" ", 1, 0) unless `add_prefix_space` is false.

A Llama-2 tokenizer.json prepends "▁" in its normalizer instead, to each text between added tokens, and to text
that starts with a space too. Running example, what the BPE model gets with Llama 2's files (`legacy` false):

    text          the file's pipeline       transformers'
    "hello"       ▁hello                    ▁hello
    " hello"      ▁▁hello                   ▁hello
    "<s>hello"    <s> ▁hello                <s> hello     ("always", legacy true: <s> ▁hello)

Which folders (models/auto/tokenization_auto.py, `AutoTokenizer.from_pretrained`): the class that
tokenizer_config.json (else config.json) declares is LlamaTokenizer(Fast), there is no `auto_map`, tokenizer.json
never says "ByteLevel" (Llama 3's files declare LlamaTokenizer too and are loaded as they are), and config.json's
model type has no tokenizer class of its own in transformers that takes over (Mistral's: its generic backend, the
file as it is). Only BPE files are rebuilt here; a Unigram file is left as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

LLAMA_TOKENIZER_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")
# Model types whose own tokenizer class transformers takes over a declared LlamaTokenizer (both Mistral 7B and
# Mixtral ship tokenizer_class LlamaTokenizer with Llama-2-style files; transformers reads those as they are).
OWN_TOKENIZER_MODEL_TYPES = frozenset({"mistral", "mixtral"})


@dataclass(slots=True, frozen=True)
class LlamaPipeline:
    prepend_scheme: str  # Metaspace's: "always", "first" or "never"
    strips_first_space: bool  # the decoder drops the first space of a decode (add_prefix_space)

    @classmethod
    def from_config(cls, config: dict) -> LlamaPipeline:
        """tokenizer_config.json's `legacy` and `add_prefix_space`, read as transformers does (by truth value)."""
        add_prefix_space = config.get("add_prefix_space")
        add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
        if not add_prefix_space:
            return cls("never", False)
        return cls("always" if config.get("legacy", False) else "first", True)

    def apply(self, tok: HFTokenizer) -> None:
        """Give `tok` (a BPE tokenizer) transformers' normalizer, pre-tokenizer, decoder and BPE options."""
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=self.prepend_scheme,
                                                     split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if self.strips_first_space else steps)
        model = tok.model  # transformers: BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None)
        model.unk_token = None
        model.fuse_unk = model.byte_fallback = True
        model.dropout = model.continuing_subword_prefix = model.end_of_word_suffix = None
        model.ignore_merges = False


def llama_pipeline(tok_dir: Path, config: dict, tok: HFTokenizer) -> LlamaPipeline | None:
    """The pipeline transformers runs for this folder in place of tokenizer.json's, or None where it runs the
    file's. `config`: tokenizer_config.json; `tok`: tokenizer.json, loaded."""
    model_config = _read_model_config(tok_dir / "config.json")
    declared = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    if declared not in LLAMA_TOKENIZER_CLASSES or "auto_map" in config or not isinstance(tok.model, models.BPE):
        return None
    if model_config.get("model_type") in OWN_TOKENIZER_MODEL_TYPES:
        return None
    if '"ByteLevel"' in (tok_dir / "tokenizer.json").read_text(encoding="utf-8"):  # transformers' own test
        return None
    return LlamaPipeline.from_config(config)


def _read_model_config(path: Path) -> dict:
    """config.json's object, or {} where there is none (a folder of tokenizer files) or it cannot be read:
    loading the model reports that one."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a JSONDecodeError and a UnicodeDecodeError are ValueErrors
        return {}
    return raw if isinstance(raw, dict) else {}
