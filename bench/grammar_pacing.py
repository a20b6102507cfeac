"""What a request of costly guided rows does to another tenant's request, with and without grammar pacing.

The embedded default model (SmolLM2-135M, 49,152 tokens). `--rows` requests held to a regex that keeps many
positions open (`[^Z]*[a-m][^Z]{30}`: after each a-m letter a new position opens, so each state is one no
mask was built for) sample at temperature 1 with a bias of +100 on "Z" (so every draw is refused and needs the
state's mask, the worst case a sender can choose), beside one plain greedy request of
`--plain-tokens` tokens, all added at once. For each `--max-grammar-seconds-per-step` setting (0: no bound):
the plain request's wall time to its last token (first, alone: its floor), the steps it took, the longest step, and the guided rows'
tokens and their time to finish. Prints a table, writes JSON.
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
from lorafleet.worker.regex_grammar import RegexGrammar

PATTERN = "[^Z]*[a-m][^Z]{30}"
PROMPT = "Write a long line of random letters:"


def run(budget: float, rows: int, args: argparse.Namespace) -> dict:
    engine = Engine(EngineConfig(model=str(default_model_dir()), device=args.device, dtype="float32",
                                 max_grammar_seconds_per_step=budget))
    vocab = engine.sampler.json_guide.prepare().result()  # the vocabulary table, built before the clock starts
    bias = dict.fromkeys(engine.tokenizer.encode("Z", add_special_tokens=False), 100.0)
    guided = []
    for i in range(rows):  # as the API: a grammar of each request's own, prepared before the request joins
        grammar = RegexGrammar(PATTERN)
        vocab.prepare(grammar)
        guided.append(engine.add_request(None, PROMPT, SamplingParams(max_tokens=args.guided_tokens, temperature=1.0,
                                                                      seed=i, grammar=grammar, logit_bias=bias)))
    plain = engine.add_request(None, PROMPT, SamplingParams(max_tokens=args.plain_tokens, temperature=0.0))
    start = time.perf_counter()
    done: dict[str, float] = {}
    tokens: dict[str, int] = {}
    steps = plain_steps = 0
    longest = 0.0
    while engine.has_unfinished():
        began = time.perf_counter()
        outs = engine.step()
        longest = max(longest, time.perf_counter() - began)
        steps += 1
        plain_steps += plain not in done
        for out in outs:
            if out.finished:
                done[out.request_id] = time.perf_counter() - start
                tokens[out.request_id] = len(out.token_ids)
    res = {"budget_s": budget, "rows": rows, "plain_s": done[plain], "plain_steps": plain_steps, "steps": steps,
           "longest_step_s": longest, "guided_s": max((done[g] for g in guided), default=0.0),
           "guided_tokens": sum(tokens[g] for g in guided),
           "deferrals": engine.scheduler.num_grammar_deferrals}  # fmt: skip
    engine.close()
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=8, help="requests held to the costly pattern")
    parser.add_argument("--guided-tokens", type=int, default=12)
    parser.add_argument("--plain-tokens", type=int, default=8)
    parser.add_argument("--budgets", default="0,0.05", help="--max-grammar-seconds-per-step values, comma-separated "
                        "(0: no bound)")
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    res = {"date": datetime.date.today().isoformat(), "device": args.device, "machine": platform.processor() or platform.machine(),
           "command": " ".join(["python", *sys.argv]), "pattern": PATTERN, "rows": args.rows, "runs": []}  # fmt: skip
    print(f"{'budget s':>8} {'plain s':>8} {'plain steps':>11} {'longest step s':>14} {'guided s':>9} {'guided tokens':>13} {'deferrals':>9}")
    for budget, rows in ((0.0, 0), *((b, args.rows) for b in budgets)):  # first the plain request alone: its floor
        r = run(budget, rows, args)
        res["runs"].append(r)
        print(f"{'alone' if not rows else str(budget):>8} {r['plain_s']:8.2f} {r['plain_steps']:11d} {r['longest_step_s']:14.2f} {r['guided_s']:9.2f} "
              f"{r['guided_tokens']:13d} {r['deferrals']:9d}", flush=True)
    write_json(args.out, "grammar_pacing", res["date"], args.device, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
