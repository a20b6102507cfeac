"""What holding the output to JSON costs: the embedded default model with no constraint, JSON mode, schemas and a regex.

    python bench/structured_output.py --out bench/results   # CPU by default; --device cuda on a GPU

One greedy request (a person described as JSON) is generated unconstrained, in JSON mode
(`json_object`) and held to a schema (SchemaGrammar), the schema twice (the second run finds its token
masks cached); then a schema with lengths, bounds, a pattern and a format (its own prompt), one of dicts
(propertyNames, patternProperties, additionalProperties keys), and a
guided_regex (RegexGrammar) and a guided_grammar (GBNF, GbnfGrammar). For each: seconds per output token, the masks built (a mask is a scan of the
vocabulary for one grammar state; most drawn tokens are checked alone and need none), whether the output
is valid. Then the time of one mask build in a few states (a key, a string value, a number, an enum value,
a bounded number, a patterned string, a pattern beside a length, a dict's key, a set's item, a regex, a grammar), the cache cleared
before each. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

from bench_io import write_json  # same folder

from lorafleet.worker import Engine, EngineConfig, SamplingParams
from lorafleet.worker.default_model import default_model_dir
from lorafleet.worker.gbnf import GbnfGrammar
from lorafleet.worker.json_schema_grammar import schema_grammar
from lorafleet.worker.regex_grammar import RegexGrammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies", "mood"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                         "mood": {"enum": ["happy", "sad", "neutral"]}}}
PROMPT = ("<|im_start|>user\nDescribe a fictional person as JSON with name, age, city, hobbies and mood.<|im_end|>\n"
          "<|im_start|>assistant\n")
STATES = (b'{"', b'{"name": "Al', b'{"name": "Al", "age": 3', b'{"name": "Al", "age": 3, "mood": "h')
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "zip"],
           "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 20},
                          "age": {"type": "integer", "minimum": 18, "maximum": 99},
                          "email": {"type": "string", "format": "email"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}
BOUNDED_PROMPT = ("<|im_start|>user\nDescribe a fictional adult as JSON with name, age, email and zip code.<|im_end|>\n"
                  "<|im_start|>assistant\n")
BOUNDED_STATES = (b'{"name": "Al", "age": 2', b'{"name": "Al", "age": 20, "email": "al@ex', b'{"name": "Al", "age": 20, "zip": "12')
DATE = r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day, [1-9][0-9]? (January|February|March|April|May|June|July|August|" \
       r"September|October|November|December) 20[0-9]{2}"
DATE_PROMPT = "<|im_start|>user\nName a date in the future.<|im_end|>\n<|im_start|>assistant\n"
DATE_STATES = (b"", b"Fri", b"Friday, 1")
CODE = {"type": "object", "required": ["code"], "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 3, "maxLength": 8}}}  # pydantic's Field(pattern, ...)
CODE_STATES = (b'{"code": "', b'{"code": "ABCDEF')
DICTS = {"type": "object", "required": ["stock", "tags"], "properties": {  # pydantic's dicts: Enum, constr and str keys
    "stock": {"type": "object", "propertyNames": {"enum": ["red", "green", "blue"]}, "additionalProperties": {"type": "integer"}},
    "tags": {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "propertyNames": {"maxLength": 8}},
    "few": {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "maxProperties": 3},
    "notes": {"type": "object", "additionalProperties": {"type": "string"}}}}
DICTS_PROMPT = ("<|im_start|>user\nGive a JSON stock count by color (red, green, blue) and tags with counts.<|im_end|>\n"
                "<|im_start|>assistant\n")
DICTS_STATES = (b'{"stock": {"', b'{"tags": {"ab', b'{"few": {"ab": 1, "a', b'{"notes": {"ab')
SETS = {"type": "object", "required": ["tags", "shares"], "properties": {  # pydantic's set[str] and set[float]
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "shares": {"type": "array", "items": {"type": "number"}, "uniqueItems": True}}}
SETS_STATES = (b'{"tags": ["red", "gr', b'{"tags": ["red"], "shares": [0.5, 0.2')
SHOPPING = 'root ::= "Shopping list:\n" item{1,5}\nitem ::= "- " [1-9] [0-9]? " " word (" " word)? "\n"\nword ::= [a-z]+'
SHOPPING_PROMPT = "<|im_start|>user\nWrite a short shopping list.<|im_end|>\n<|im_start|>assistant\n"
SHOPPING_STATES = (b"", b"Shopping list:\n- 2 ", b"Shopping list:\n- 2 eggs\n")


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
    grammar, bounded, date = schema_grammar(SCHEMA), schema_grammar(BOUNDED), RegexGrammar(DATE)
    code, shopping, dicts, sets = schema_grammar(CODE), GbnfGrammar(SHOPPING), schema_grammar(DICTS), schema_grammar(SETS)
    cases = (("unconstrained", PROMPT, {}), ("json_object", PROMPT, {"json_object": True}),
             ("schema", PROMPT, {"grammar": grammar}), ("schema again", PROMPT, {"grammar": grammar}),
             ("bounded schema", BOUNDED_PROMPT, {"grammar": bounded}), ("dict keys", DICTS_PROMPT, {"grammar": dicts}),
             ("guided_regex", DATE_PROMPT, {"grammar": date}),
             ("guided_grammar", SHOPPING_PROMPT, {"grammar": shopping}))
    print(f"{'case':16} {'tokens':>6} {'ms/token':>9} {'masks':>6} {'valid':>5}  output")
    for name, prompt, kw in cases:
        built = vocab.num_built
        start = time.perf_counter()
        out = engine.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0, **kw))[0]
        seconds = time.perf_counter() - start
        run = {"tokens": len(out.token_ids), "ms_per_token": 1e3 * seconds / len(out.token_ids), "masks_built": vocab.num_built - built,
               "text": out.text, "valid": _valid(kw.get("grammar"), out.text)}  # fmt: skip
        res["runs"][name] = run
        print(f"{name:16} {run['tokens']:6d} {run['ms_per_token']:9.1f} {run['masks_built']:6d} {run['valid']!s:>5}  {out.text[:60]!r}")
    for case, g, states in (("schema", grammar, STATES), ("bounded schema", bounded, BOUNDED_STATES),
                            ("pattern and length", code, CODE_STATES), ("dict keys", dicts, DICTS_STATES),
                            ("set items", sets, SETS_STATES),
                            ("guided_regex", date, DATE_STATES),
                            ("guided_grammar", shopping, SHOPPING_STATES)):
        for text in states:
            state = g.advance(g.start, text)
            times = []
            for _ in range(3):
                vocab._masks.clear()
                start = time.perf_counter()
                vocab.mask(state, True, g)
                times.append(time.perf_counter() - start)
            res["mask_build_ms"][f"{case}: {text.decode()}"] = 1e3 * min(times)
            print(f"mask build, {case}, after {text.decode()!r}: {1e3 * min(times):.1f} ms")
    write_json(args.out, "structured_output", res["date"], args.device, res)
    return 0


def _valid(grammar, text: str) -> bool | None:
    """Whether the text is whole under its grammar (None without one)."""
    if grammar is None:
        return None
    state = grammar.advance(grammar.start, text.encode())
    return state is not None and (grammar.is_complete(state) or grammar.may_stop(state))


if __name__ == "__main__":
    sys.exit(main())
