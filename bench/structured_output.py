"""What holding the output to JSON costs: the embedded default model with no constraint, JSON mode and a schema.

    python bench/structured_output.py --out bench/results   # CPU by default; --device cuda on a GPU

One greedy request (a person described as JSON) is generated unconstrained, in JSON mode
(`json_object`) and held to a schema (SchemaGrammar), the schema twice (the second run finds its token
masks cached). For each: seconds per output token, the masks built (a mask is a scan of the vocabulary
for one grammar state; most drawn tokens are checked alone and need none), whether the schema's output
validates. Then the time of one mask build in a few states of the schema (a key, a string value, a
number, an enum value), the cache cleared before each. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

from bench_io import write_json  # same folder

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.default_model import default_model_dir
from lorafleet.worker.json_schema_grammar import schema_grammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies", "mood"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                         "mood": {"enum": ["happy", "sad", "neutral"]}}}
PROMPT = ("<|im_start|>user\nDescribe a fictional person as JSON with name, age, city, hobbies and mood.<|im_end|>\n"
          "<|im_start|>assistant\n")
STATES = (b'{"', b'{"name": "Al', b'{"name": "Al", "age": 3', b'{"name": "Al", "age": 3, "mood": "h')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig(model=str(default_model_dir()), device=args.device, dtype="float32"))
    guide = engine.sampler.json_guide
    start = time.perf_counter()
    guide.prepare().result()
    vocab = guide.vocab
    res = {"date": datetime.date.today().isoformat(), "device": args.device, "machine": platform.processor() or platform.machine(),
           "command": " ".join(["python", *sys.argv]), "vocab_size": vocab.vocab_size,
           "vocab_table_s": time.perf_counter() - start, "runs": {}, "mask_build_ms": {}}  # fmt: skip
    grammar = schema_grammar(SCHEMA)
    cases = (("unconstrained", {}), ("json_object", {"json_object": True}), ("schema", {"grammar": grammar}),
             ("schema again", {"grammar": grammar}))
    print(f"{'case':16} {'tokens':>6} {'ms/token':>9} {'masks':>6}  output")
    for name, kw in cases:
        built = vocab.num_built
        start = time.perf_counter()
        out = engine.generate([PROMPT], SamplingParams(max_tokens=args.max_tokens, temperature=0.0, **kw))[0]
        seconds = time.perf_counter() - start
        run = {"tokens": len(out.token_ids), "ms_per_token": 1e3 * seconds / len(out.token_ids), "masks_built": vocab.num_built - built,
               "text": out.text}  # fmt: skip
        if "grammar" in kw:
            run["valid"] = grammar.validates(json.loads(out.text))
        res["runs"][name] = run
        print(f"{name:16} {run['tokens']:6d} {run['ms_per_token']:9.1f} {run['masks_built']:6d}  {out.text[:60]!r}")
    for text in STATES:
        state = grammar.advance(grammar.start, text)
        times = []
        for _ in range(3):
            vocab._masks.clear()
            start = time.perf_counter()
            vocab.mask(state, True, grammar)
            times.append(time.perf_counter() - start)
        res["mask_build_ms"][text.decode()] = 1e3 * min(times)
        print(f"mask build after {text.decode()!r}: {1e3 * min(times):.1f} ms")
    write_json(args.out, "structured_output", res["date"], args.device, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
