"""Train the three demo LoRA adapters for the embedded SmolLM2-135M-Instruct, on CPU, in minutes.

Every adapter learns one visible transformation of a short list of words, from synthetic data:

    prompt  "Words: red fish open sky\\nReply:"
    shout     -> " RED FISH OPEN SKY"
    reverse   -> " sky open fish red"
    piglatin  -> " edray ishfay openway yskay"

Each is a PEFT LoRA dir under examples/adapters/<name>/ (adapter_config.json +
adapter_model.safetensors, bf16, 0.7-2 MB). Ranks, alphas and target modules differ on purpose, so
the demo batch mixes ranks and module subsets:

    shout     r=4, alpha=8,  all seven projections
    reverse   r=8, alpha=16, q/k/v/o_proj
    piglatin  r=4, alpha=8, rsLoRA, all seven projections, rank_pattern {"down_proj": 8}

Cost control: LoRA only on the upper layers (`layers_to_transform`); the frozen lower layers run
once per example (their outputs are cached), each epoch only runs the upper ones, and logits are
computed for answer tokens only. Measured: all three in 107 s wall on an otherwise idle 2-core
machine (9.6 min when it was shared with other jobs); the output is bit-for-bit the committed adapters.
`python examples/train_demo_adapters.py` (all three) or `--only shout`. Seeded data and init.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lorafleet.worker.default_model import default_model_dir

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # recorded as base_model_name_or_path
OUT_DIR = Path(__file__).resolve().parent / "adapters"
_WORDS = (
    "red blue green black white dog cat fish bird cow horse sun moon star sky rain snow wind tree leaf "
    "rock sand sea lake river hill road door house room bed cup milk bread cake apple egg salt rice "
    "king queen man boy girl baby hand foot eye nose head hair ship boat car train plane book pen "
    "paper song game ball gold iron wood glass stone fire smoke light night day time year week open "
    "close big small hot cold fast slow old new good bad happy sad rich poor soft hard long short"
)
WORDS = _WORDS.split()
VOWELS = set("aeiou")


def pig_latin(word: str) -> str:
    if word[0] in VOWELS:
        return word + "way"
    i = next((k for k, ch in enumerate(word) if ch in VOWELS or (k > 0 and ch == "y")), len(word))
    return word[i:] + word[:i] + "ay"


TASKS = {
    "shout": lambda ws: " ".join(w.upper() for w in ws),
    "reverse": lambda ws: " ".join(reversed(ws)),
    "piglatin": lambda ws: " ".join(pig_latin(w) for w in ws),
}
LORA = {
    "shout": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]),
    "reverse": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "piglatin": dict(r=4, lora_alpha=8, use_rslora=True, rank_pattern={"down_proj": 8},
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}

# LoRA on layers >= this one: the lower layers are frozen, their outputs cached once.
FIRST_LAYER = {"shout": 18, "reverse": 18, "piglatin": 10}
EPOCHS = {"shout": 3, "reverse": 3, "piglatin": 5}  # spelling words backwards-ish takes longer


def prompt_for(words: list[str]) -> str:
    return f"Words: {' '.join(words)}\nReply:"


def examples(task: str, n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(3, 5))
        out.append((prompt_for(words), " " + TASKS[task](words) + "\n"))
    return out


def encode_batch(tok, pairs: list[tuple[str, str]]):
    """input ids [B, L] (right-padded) and, per row, the positions whose next token is an answer token."""
    rows, spans = [], []
    for prompt, answer in pairs:
        p, a = tok.encode(prompt), tok.encode(answer)
        rows.append(p + a)
        spans.append((len(p) - 1, len(p) + len(a) - 1))  # predict a[0] from the last prompt token
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, spans


class UpperStack:
    """Runs the model from layer `first` up, on cached inputs of that layer.

    Layers below `first` carry no LoRA, so their outputs never change during training: each example's
    hidden state at `first` is computed once (no grad) and every epoch only runs the upper layers.
    """

    def __init__(self, base, first: int) -> None:
        self.base, self.first = base, first

    def _run(self, h: torch.Tensor, layers) -> torch.Tensor:
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        rope = self.base.model.rotary_emb(h, position_ids=pos)
        for layer in layers:
            # attention_mask=None: causal attention (right padding follows the answer, never attended)
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out
        return h

    @torch.no_grad()
    def lower(self, ids: torch.Tensor) -> torch.Tensor:
        return self._run(self.base.model.embed_tokens(ids), self.base.model.layers[: self.first])

    def upper(self, h: torch.Tensor) -> torch.Tensor:
        return self.base.model.norm(self._run(h, self.base.model.layers[self.first :]))


def train_one(task: str, model_dir: Path, *, epochs: int, num_examples: int, batch_size: int, lr: float,
              first_layer: int, out_dir: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_layers = base.config.num_hidden_layers
    config = LoraConfig(lora_dropout=0.0, layers_to_transform=list(range(first_layer, num_layers)), **LORA[task])
    model = get_peft_model(base, config)
    stack = UpperStack(base, first_layer)
    data = examples(task, num_examples, seed=list(TASKS).index(task))
    batches = [encode_batch(tok, data[i : i + batch_size]) for i in range(0, num_examples, batch_size)]
    start = time.monotonic()
    with torch.no_grad():  # the manual stack must be the model (checked once, adapters still zero)
        ids = batches[0][0]
        torch.testing.assert_close(stack.upper(stack.lower(ids)), base.model(input_ids=ids).last_hidden_state)
    cached = [(stack.lower(ids), ids, spans) for ids, spans in batches]
    print(f"[{task}] cached layers 0..{first_layer - 1} for {num_examples} examples "
          f"({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = epochs * len(cached)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * max(0.05, 1 - s / steps))
    order = random.Random(0)
    model.train()
    step = 0
    for epoch in range(epochs):
        order.shuffle(cached)
        total = 0.0
        for h_in, ids, spans in cached:
            hidden = stack.upper(h_in)  # [B, L, H]
            rows = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(spans)])
            cols = torch.cat([torch.arange(s, e) for s, e in spans])
            logits = base.lm_head(hidden[rows, cols])  # only the answer positions: [N, V]
            loss = torch.nn.functional.cross_entropy(logits.float(), ids[rows, cols + 1])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            total += loss.item()
            step += 1
        print(f"[{task}] epoch {epoch + 1}/{epochs} ({step} steps) loss {total / len(cached):.3f} "
              f"({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    model.eval()
    target = out_dir / task
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    model.save_pretrained(str(target))
    _to_bf16(target / "adapter_model.safetensors")
    (target / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
    _show_samples(task, model, tok)
    return target


def _to_bf16(path: Path) -> None:
    """Store the (low-rank, small) matrices in bf16: half the bytes, and the server's dtype anyway."""
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


@torch.no_grad()
def _show_samples(task: str, model, tok) -> None:
    for words in (["red", "fish", "open", "sky"], ["happy", "king", "stone"]):
        ids = tok(prompt_for(words), return_tensors="pt").input_ids
        out = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
        print(f"[{task}] {' '.join(words)!r} -> {text.strip()!r} (want {TASKS[task](words)!r})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(TASKS), action="append", help="train just this adapter")
    parser.add_argument("--epochs", type=int, help="passes over the examples (default: per adapter)")
    parser.add_argument("--examples", type=int, default=192, help="synthetic examples per adapter")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--first-layer", type=int, help="LoRA on layers >= this one (default: per adapter)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    start = time.monotonic()
    for task in args.only or list(TASKS):
        first = args.first_layer if args.first_layer is not None else FIRST_LAYER[task]
        path = train_one(task, model_dir, epochs=args.epochs or EPOCHS[task], num_examples=args.examples,
                         batch_size=args.batch_size, lr=args.lr, first_layer=first, out_dir=args.out)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"saved {path} ({size / 1e6:.2f} MB)", file=sys.stderr)
    print(f"trained in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
