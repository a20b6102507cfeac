"""Grammar pacing: a step's time on guided rows' masks held to a budget, so one tenant's costly grammars cannot
slow every other request's decoding.

A guided row (structured output, JSON mode, a regex or grammar) costs the sampler's step the time its grammar
takes: checking the drawn token and, when the grammar refuses it, building the mask of the tokens its state
allows. Masks are cached per grammar state, so most draws cost microseconds; a pattern that keeps many states
open (`[^Z]*[a-m][^Z]{30}`) meets a new state at nearly every token, each mask up to
regex_vocab.MAX_MASK_SECONDS, and a request of n such rows made every step of the batch n masks long (n=32: 8 s
a step, for every tenant).

Before each step the scheduler estimates each guided decode's grammar time (`GrammarCosts.estimate`): what its
draws cost when they built no mask, plus, where its current state's mask is not cached, what a mask costs it to
build (its own last builds, or its grammar's, else its tenant's, else DEFAULT_BUILD_S: the larger; a grammar's
and a tenant's halve with time, HALF_LIFE_S, not with cheaper builds) weighted by how often its drawn tokens are
refused (only a refused draw builds a mask: an honest row's draws mostly fit; a new row starts from its
grammar's rate). Times are the engine thread's CPU
time, which other threads' work does not inflate. It admits guided decodes longest waiting first (then cheapest) while their estimates add up
to at most `max_grammar_seconds_per_step`; past it, the one that has waited longest goes too, so every row moves
on. The others wait a step (their KV and grammar state stay as they are; nothing is computed again) and go
before the rest at the next. Rows of no grammar and prompt chunks are never held: a request's first draw is at
its grammar's first state, whose mask its request builds before it joins the batch (AsyncEngine._prepare, one
request at a time), unless the mask cache let it go meanwhile or a preempted row is computed again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from lorafleet.worker.sequence import Sequence
from lorafleet.worker.waiting_queue import fairness_key

DEFAULT_BUILD_S = 0.01  # a mask build of a grammar and tenant never seen building (measured: 0.1-9.5 ms)
MAX_KNOWN = 4096  # grammars and tenants whose build cost is remembered (the least recent go first)
HALF_LIFE_S = 5.0  # a grammar's or tenant's build cost halves with each such span of time without a costlier one


class GrammarCosts:
    """What guided rows' draws have cost (the sampler's measures, in the engine thread's CPU time), and what the
    next one may cost."""

    def __init__(self, needs_mask: Callable[[Sequence], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.needs_mask = needs_mask  # whether a row's next draw, if refused, builds a mask (JsonGuide.needs_mask)
        self.clock = clock
        # grammar key or tenant -> (a build's seconds, when): the costliest recent one, halving with time (not with
        # each cheaper build, which a tenant could make many of beside its costly ones)
        self._builds: OrderedDict[object, tuple[float, float]] = OrderedDict()
        self._refusals: OrderedDict[object, float] = OrderedDict()  # grammar key -> how often its draws are refused

    def observe(self, seq: Sequence, seconds: float, refused: bool, built: bool) -> None:
        """A draw of `seq` spent `seconds` on its grammar; its token was `refused` or not, and it `built` a mask or
        not. A draw that built none sets the row's own cost (the larger of it and half the one before); one that
        built one, the row's, its grammar's and its tenant's build costs. Every draw moves the row's refusal rate."""
        grammar = _grammar_key(seq)
        rate = self._refusals.get(grammar, 1.0)  # a row's first draw starts from its grammar's rate (else: refused)
        _remember(self._refusals, grammar, 0.95 * rate + 0.05 * refused)
        seq.grammar_refusals = 0.75 * (rate if seq.grammar_refusals is None else seq.grammar_refusals) + 0.25 * refused
        if not built:
            seq.grammar_cost = max(seconds, 0.5 * seq.grammar_cost)
            return
        seq.grammar_build = max(seconds, 0.5 * seq.grammar_build)
        now = self.clock()
        for key in (("grammar", grammar), ("tenant", fairness_key(seq))):
            _remember(self._builds, key, max((seconds, now), (self._recent(key, now), now)))

    def _recent(self, key: object, now: float) -> float:
        seconds, when = self._builds.get(key, (0.0, now))
        return seconds * 0.5 ** ((now - when) / HALF_LIFE_S)

    def estimate(self, seq: Sequence) -> float:
        """Seconds the next draw of `seq` may spend on its grammar: its own cost, plus, where its state's mask is
        not cached, a build (its own last, or its grammar's, else its tenant's, else DEFAULT_BUILD_S, whichever
        is larger) weighted by how often its draws are refused (only a refused draw builds one)."""
        if not self.needs_mask(seq):
            return seq.grammar_cost
        now = self.clock()
        build = self._recent(("grammar", _grammar_key(seq)), now) or self._recent(("tenant", fairness_key(seq)), now)
        refusals = self._refusals.get(_grammar_key(seq), 1.0) if seq.grammar_refusals is None else seq.grammar_refusals
        return seq.grammar_cost + refusals * max(seq.grammar_build, build or DEFAULT_BUILD_S)


def _remember(known: OrderedDict, key: object, value: object) -> None:
    """known[key] = value, the most recent; the least recent go past MAX_KNOWN."""
    known[key] = value
    known.move_to_end(key)
    while len(known) > MAX_KNOWN:
        known.popitem(last=False)


def _grammar_key(seq: Sequence) -> object:
    grammar = seq.params.grammar
    return "json_object" if grammar is None else grammar.key


def pace(decodes: list[Sequence], budget: float, estimate: Callable[[Sequence], float]) -> tuple[list[Sequence], int]:
    """`decodes` (in their order) less the guided rows the step's grammar `budget` (seconds; 0: no bound) leaves
    out, and how many it left out. Each row's `grammar_waits` counts the steps it was left out in a row."""
    guided = [s for s in decodes if s.params.json_object]
    cost = {s.seq_id: estimate(s) for s in guided} if budget > 0 else {}
    if not budget > 0 or sum(cost.values()) <= budget:
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
