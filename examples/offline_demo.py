"""Offline demo: one engine, one batch, the base model and three LoRA adapters side by side.

    python examples/offline_demo.py            (or `make demo`)

Loads the embedded SmolLM2-135M-Instruct (converted on first use), registers every PEFT adapter
under examples/adapters/, and submits the same word lists to the base model and to each adapter
together: every decode step runs them in one batch over one shared copy of the base weights, each
token's LoRA delta picked by its adapter slot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.default_model import default_model_dir

ADAPTERS = Path(__file__).resolve().parent / "adapters"
WORD_LISTS = (["red", "fish", "open", "sky"], ["happy", "king", "stone"], ["green", "apple", "river", "boat"])


def prompt_for(words: list[str]) -> str:
    return f"Words: {' '.join(words)}\nReply:"  # the format the demo adapters were trained on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=Path, default=ADAPTERS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    engine = Engine(EngineConfig(model=str(default_model_dir()), device=args.device, dtype=args.dtype))
    names = [key.split("@")[0] for key in engine.register_adapter_dir(args.adapters)]
    print(f"base model {engine.model_name}; adapters: {', '.join(names)}")

    # The adapters answer on one line; the base model does not know the format, give it more room.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=["\n"])
    base_params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    requests = []  # (request id, words, adapter)
    for i, words in enumerate(WORD_LISTS):
        for adapter in [None, *names]:
            rid = f"{i}-{adapter or 'base'}"
            engine.add_request(rid, prompt_for(words), params if adapter else base_params, adapter=adapter)
            requests.append((rid, words, adapter))

    results, widest = {}, (0, 0)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        widest = max(widest, (engine.last_batch_size, engine.last_batch_adapters))
    print(f"{len(requests)} requests; largest step: {widest[0]} sequences using {widest[1]} adapters "
          f"(+ base-only sequences) in one batch\n")

    for words in WORD_LISTS:
        print(f"Words: {' '.join(words)}")
        for rid, _, adapter in (r for r in requests if r[1] is words):
            text = " / ".join(line.strip() for line in results[rid].text.strip().splitlines() if line.strip())
            print(f"  {adapter or '(base)':>10}: {text or '(nothing)'}")
        print()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
