"""Grammar pacing: a step's time on guided rows' masks held to a budget, so one request's costly grammar cannot
slow every other request's decoding.

A guided row (structured output, JSON mode, a regex or grammar) costs the sampler's step the time its grammar
takes: checking the drawn token and, when the grammar refuses it, building the row's mask of allowed tokens.
Masks are cached per grammar state, so most rows cost microseconds; a pattern that keeps many states open
(`[^Z]*[a-m][^Z]{30}`) misses the cache at every token, each mask up to regex_vocab.MAX_MASK_SECONDS, and a
request of n such rows made every step of the batch n masks long (n=32: 8 s a step, for every tenant).

The sampler keeps, per sequence, an estimate of its grammar seconds per draw (`Sequence.grammar_cost`: the
larger of its last draw's measure and half the estimate before, `observe`). At each step the scheduler admits the decodes of
guided rows that have an estimate, longest waiting first (then cheapest), while their estimates add up to at
most `max_grammar_seconds_per_step`; past it, the one that has waited longest goes too, so every row moves on
and a step's grammar time stays within the budget plus one row's. The others wait a step (their KV and grammar
state stay as they are; nothing is computed again) and go before the rest at the next. Rows of no grammar and
prompt chunks are never held; a request's first token (drawn at the end of its prompt) has no estimate yet.
"""

from __future__ import annotations

from lorafleet.worker.sequence import Sequence


def observe(seq: Sequence, seconds: float) -> None:
    """A draw of `seq` spent `seconds` on its grammar: the estimate is the larger of that and half the estimate
    before. A row's draws either find their mask cached (microseconds) or build one (up to the mask's bound), so
    a costly draw is remembered for a few draws, and a row that stops building masks is soon cheap again."""
    seq.grammar_cost = max(seconds, 0.5 * seq.grammar_cost)


def pace(decodes: list[Sequence], budget: float | None) -> tuple[list[Sequence], int]:
    """`decodes` (in their order) less the guided rows the step's grammar `budget` (seconds; None: no bound)
    leaves out, and how many it left out. Each row's `grammar_waits` counts the steps it was left out in a row."""
    guided = [s for s in decodes if s.grammar_cost > 0.0]
    cost = _estimates(guided)
    if budget is None or sum(cost.values()) <= budget:
        for seq in guided:
            seq.grammar_waits = 0
        return decodes, 0
    spent, past_budget, held = 0.0, False, set()
    for seq in sorted(guided, key=lambda s: (-s.grammar_waits, cost[s.seq_id])):  # stable: oldest first on ties
        if spent + cost[seq.seq_id] <= budget:
            spent += cost[seq.seq_id]
        elif not past_budget:
            past_budget = True  # the longest waiting of those past the budget: every row moves on
        else:
            held.add(seq.seq_id)
            seq.grammar_waits += 1
            continue
        seq.grammar_waits = 0
    return [s for s in decodes if s.seq_id not in held], len(held)


def _estimates(guided: list[Sequence]) -> dict[int, float]:
    """seq_id -> the row's estimate, or the mean of its request's rows if larger. The rows of one request share
    its compiled grammar and the states whose masks it must build: a row that has found its masks cached so far
    is likely, once it strays, to cost what its siblings cost. JSON mode's rows (no grammar of their own) keep
    their own."""
    groups: dict[int, list[float]] = {}
    for seq in guided:
        if seq.params.grammar is not None:  # the grammars of running rows, all alive: no id is reused among them
            groups.setdefault(id(seq.params.grammar), []).append(seq.grammar_cost)
    mean = {key: sum(costs) / len(costs) for key, costs in groups.items()}
    return {seq.seq_id: max(seq.grammar_cost, mean.get(id(seq.params.grammar), 0.0)) for seq in guided}
