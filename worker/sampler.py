"""Sampler: next tokens (and logprobs) from the last-token logits of each sampling sequence.

Randomness is drawn per sequence: a seeded request owns a torch.Generator, so its tokens depend
only on its own logits and seed, never on which other requests share the batch. Sampling uses the
exponential-race form of the categorical draw, `argmax(p / Exp(1))`, which needs one draw per
vocabulary entry and no cumulative sums over the batch.

The chain follows vLLM V1's sampler: `min_tokens` and `logit_bias` first, then the penalties, all on
the raw logits and for greedy requests too (they can change the argmax); greedy rows then take the
argmax, and sampled rows go on through temperature, `min_p`, top-k and top-p. `min_tokens` sets the
logits of a sequence's stop tokens (its stop_token_ids, and EOS unless it ignores EOS) to -inf while
it has generated fewer than min_tokens tokens (vLLM's MinTokensLogitsProcessor), counted from its own
output tokens, so a recomputed (preempted) sequence is masked exactly as before. `logit_bias` adds
each bias to its token's logit (vLLM's LogitBiasLogitsProcessor). `min_p` drops the tokens whose
probability, after temperature, is below min_p times the most likely token's (vLLM's
MinPLogitsProcessor; it never changes the argmax, so greedy rows skip it). Rows that set none of
these are not touched, bit for bit.

Penalties, as vLLM applies them: for each token, repetition_penalty r when it occurs in the prompt or
the output (a positive logit divided by r, any other multiplied by r: transformers'
RepetitionPenaltyLogitsProcessor), then `- frequency_penalty * count - presence_penalty * (count > 0)`
with counts over the generated tokens only (OpenAI's). The counts are kept from step to step, growing by
each step's new token (token_counts.py): a step costs O(vocabulary) per penalized sequence, not
O(prompt + output), and a recomputed (preempted) sequence samples exactly as before. Only the rows of
requests that set a penalty are touched; the others are bit-identical to a batch without penalties.

JSON mode rows (json_guide.py) draw as above; a token that cannot continue the row's JSON object is drawn
again with the same draw among the tokens that can, which samples the distribution restricted to them
exactly. The other rows are not touched, and a row that fails ends only its own request (`row_errors`).

Logprobs are those of the model's raw distribution: before logit_bias, penalties, temperature and the filters
(vLLM's default `logprobs_mode`, raw_logprobs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from lorafleet.worker.grammar_pacing import GrammarCosts
from lorafleet.worker.json_guide import JsonGuide, JsonModeError
from lorafleet.worker.sequence import Sequence, TokenLogprob
from lorafleet.worker.token_counts import TokenCounts


class Sampler:
    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu",
                 eos_token_ids: Iterable[int] = (), json_guide: JsonGuide | None = None) -> None:
        # Unseeded requests share one engine-wide generator.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.eos_token_ids = frozenset(eos_token_ids)  # masked with a request's stop_token_ids by min_tokens
        self.token_counts = TokenCounts()  # the penalties' counts, kept from step to step
        self._min_tokens_index = LastBuilt()
        self._logit_bias_index = LastBuilt()
        self.json_guide = json_guide  # JSON mode's constraint (None: the engine has no tokenizer)
        self.row_errors: dict[int, Exception] = {}  # the last sample's rows that failed (their requests end)
        self._needs_mask = json_guide.needs_mask if json_guide is not None else lambda seq: False
        self.grammar_costs = GrammarCosts(self._needs_mask)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        """logits: float32 [N, V], row i belongs to seqs[i]. A sample that fails after its draws (an allocation
        for the logprobs, an error surfacing at a sync) leaves the seeded requests' generators where they were:
        the engine runs the step again (each adapter's rows alone), and they draw the same tokens then."""
        states = [(s.generator, s.generator.get_state()) for s in seqs if s.generator is not None]
        try:
            return self._sample(logits, seqs)
        except BaseException:
            for generator, state in states:
                generator.set_state(state)
            raise

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        raw = logits
        logits = apply_min_tokens(logits, seqs, self.eos_token_ids, self._min_tokens_index)
        logits = apply_logit_bias(logits, seqs, self._logit_bias_index)
        logits = apply_penalties(logits, seqs, self.token_counts)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        race = noise = None
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = _processed_probs(logits[rows], [seqs[i].params for i in sampled_rows])
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(sampled_rows) if seqs[i].generator is None]
            if shared:
                noise[shared] = noise[shared].exponential_(generator=self.generator)
            for j, i in enumerate(sampled_rows):
                gen = seqs[i].generator
                if gen is not None:
                    noise[j].exponential_(generator=gen)
            tokens = tokens.clone()
            race = probs / noise
            tokens[rows] = race.argmax(dim=-1)
        self.row_errors = {}
        token_list = tokens.tolist()
        if any(s.params.json_object for s in seqs):
            tokens = self._constrain_json(tokens, token_list, logits, seqs, sampled_rows, race, noise)
        want = [s.params.logprobs for s in seqs]
        if all(w is None for w in want):
            return [(t, None) for t in token_list]
        k = max(w or 0 for w in want)
        _, chosen, vals, ids = raw_logprobs(raw, tokens, k)  # the model's distribution, before any processing
        chosen = chosen.tolist()
        top_vals, top_ids = [[]] * len(seqs), [[]] * len(seqs)
        if k:
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out: list[tuple[int, TokenLogprob | None]] = []
        for i, w in enumerate(want):
            if w is None:
                out.append((token_list[i], None))
            else:
                top = list(zip(top_ids[i][:w], top_vals[i][:w], strict=True))
                out.append((token_list[i], TokenLogprob(token_list[i], chosen[i], top)))
        return out

    def _constrain_json(self, tokens: torch.Tensor, token_list: list[int], logits: torch.Tensor, seqs: list[Sequence],
                        sampled_rows: list[int], race: torch.Tensor | None, noise: torch.Tensor | None) -> torch.Tensor:
        """JSON-mode rows keep their token when it is valid, else draw again among the valid tokens with the same
        draw: the argmax of the logits, or of the race `p / Exp(1)`, over the valid tokens. Restricting an
        exponential race to a subset samples p restricted to it, so the result is exactly that distribution
        (and the same as masking first). A row that fails lands in row_errors; the other rows go on.
        `token_list` (tokens as a list) is updated with the redrawn tokens too."""
        guide = self.json_guide
        refused_rows: list[tuple[int, torch.Tensor]] = []  # (row, the tokens it may not draw)
        for i, seq in enumerate(seqs):
            if not seq.params.json_object:
                continue
            began, uncached, refused = time.thread_time(), self._needs_mask(seq), True  # built by this draw?
            try:
                if guide is None:
                    raise JsonModeError("JSON mode needs the model's tokenizer (tokenizer.json)")
                if guide.accepts(seq, token_list[i]):
                    refused = False
                    continue
                refused_rows.append((i, guide.invalid(seq, logits.device)))
            except Exception as exc:  # this request fails; the engine serves the others
                self.row_errors[i] = exc
            finally:  # the scheduler paces costly rows (grammar_pacing.py)
                self.grammar_costs.observe(seq, time.thread_time() - began, refused, uncached and not self._needs_mask(seq))
        if not refused_rows:
            return tokens
        race_row = {i: j for j, i in enumerate(sampled_rows)}
        try:
            self._redrawn(refused_rows, tokens, token_list, logits, seqs, race_row, race, noise)
        except Exception:  # one row at a time: a row that fails ends its own request only
            for row in refused_rows:
                try:
                    self._redrawn([row], tokens, token_list, logits, seqs, race_row, race, noise)
                except Exception as exc:  # this request fails; the engine serves the others
                    self.row_errors[row[0]] = exc
        return tokens

    @staticmethod
    def _redrawn(refused_rows: list[tuple[int, torch.Tensor]], tokens: torch.Tensor, token_list: list[int],
                 logits: torch.Tensor, seqs: list[Sequence], race_row: dict[int, int], race, noise) -> None:
        """`_redraw` of `refused_rows` (row, its invalid tokens), written into `tokens` and `token_list`."""
        rows = [i for i, _ in refused_rows]
        drawn = _redraw(torch.stack([m for _, m in refused_rows]), rows, logits, [seqs[i].params for i in rows],
                        race_row, race, noise)
        values = drawn.tolist()
        tokens[torch.tensor(rows, device=tokens.device)] = drawn
        for i, token in zip(rows, values, strict=True):
            token_list[i] = token


def _redraw(invalid: torch.Tensor, rows: list[int], logits: torch.Tensor, params: list, race_row: dict[int, int],
            race: torch.Tensor | None, noise: torch.Tensor | None) -> torch.Tensor:
    """The tokens rows `rows` draw again among the tokens they may draw (`invalid` [R, V]: True where they may
    not), all rows at once: a greedy row the argmax of its logits over them (its first valid token when every
    valid token's logit is -inf); a sampled row the argmax of its race over them, or where top-k / top-p left
    none of them, of a race with the same draw over them filtered alone. [R] int64 on the logits' device."""
    device = logits.device
    at = torch.tensor(rows, device=device)
    masked = logits[at].masked_fill(invalid, float("-inf"))
    drawn = torch.where(torch.isfinite(masked.amax(dim=-1)), masked.argmax(dim=-1), (~invalid).byte().argmax(dim=-1))
    sampled = [k for k, i in enumerate(rows) if i in race_row]
    if not sampled:
        return drawn
    js = [race_row[rows[k]] for k in sampled]
    ks = torch.tensor(sampled, device=device)
    raced = race[torch.tensor(js, device=device)].masked_fill(invalid[ks], -1.0)
    drawn[ks] = raced.argmax(dim=-1)
    empty = (raced.amax(dim=-1) <= 0).nonzero()[:, 0].tolist()  # one sync: rows the filters left no valid token
    if empty:
        bad = torch.tensor([sampled[e] for e in empty], device=device)
        probs = _processed_probs(masked[bad], [params[sampled[e]] for e in empty])
        drawn[bad] = (probs / noise[torch.tensor([js[e] for e in empty], device=device)]).nan_to_num(0.0).masked_fill(
            invalid[bad], -1.0).argmax(dim=-1)
    return drawn


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Of float32 logits [N, V] (row i's token tokens[i]): the log_softmax [N, V], each row's token's
    logprob [N], and the k most likely tokens' logprobs and ids [N, k] (most likely first; None when k is 0).
    Sampled tokens' and prompt tokens' logprobs (prompt_logprobs.py) are ranked by this one rule."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if not k:
        return logprobs, chosen, None, None
    vals, ids = logprobs.topk(k, dim=-1)
    return logprobs, chosen, vals, ids


class LastBuilt:
    """The value built for the last key: a step's index tensors, reused while the same sequences sample in the
    same rows (a run of decode steps) instead of built from the requests' options at every step."""

    def __init__(self) -> None:
        self.key: object = None
        self.value: object = None

    def get(self, key: object, build: Callable[[], object]) -> object:
        if key != self.key:
            self.key, self.value = key, build()
        return self.value


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int],
                     last: LastBuilt | None = None) -> torch.Tensor:
    """`logits` with -inf for the stop tokens of each sequence that has generated fewer than min_tokens
    tokens: its stop_token_ids, and the EOS ids (its adapter's own too) unless it ignores EOS; the same tensor when
    none needs it."""
    masked = [(i, s) for i, s in enumerate(seqs) if len(s.output_token_ids) < s.params.min_tokens]
    if not masked:
        return logits
    vocab, device = logits.shape[-1], logits.device

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = [], []
        for i, s in masked:
            params = s.params
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids | s.adapter_eos)
            for token_id in sorted(t for t in stops if 0 <= t < vocab):
                rows.append(i)
                cols.append(token_id)
        return torch.tensor(rows, device=device, dtype=torch.int64), torch.tensor(cols, device=device, dtype=torch.int64)

    key = (vocab, device, eos_token_ids, tuple((i, s.seq_id) for i, s in masked))
    index = (last or LastBuilt()).get(key, build)
    if not index[0].numel():
        return logits
    out = logits.clone()
    out[index] = float("-inf")
    return out


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence], last: LastBuilt | None = None) -> torch.Tensor:
    """`logits` plus each sequence's logit_bias; the same tensor when no sequence sets one."""
    biased = [(i, s) for i, s in enumerate(seqs) if s.params.logit_bias]
    if not biased:
        return logits
    device, dtype = logits.device, logits.dtype

    def build() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        rows, cols, biases = [], [], []
        for i, s in biased:
            bias = s.params.logit_bias
            rows.extend([i] * len(bias))
            cols.extend(bias.keys())
            biases.extend(bias.values())
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        return index, torch.tensor(biases, device=device, dtype=dtype)

    index, biases = (last or LastBuilt()).get((device, dtype, tuple((i, s.seq_id) for i, s in biased)), build)
    out = logits.clone()
    out[index] += biases  # a row names a token at most once
    return out


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], counts: TokenCounts | None = None) -> torch.Tensor:
    """`logits` with each sequence's presence, frequency and repetition penalties applied (vLLM's order);
    the same tensor when no sequence sets one. Only the rows that set a penalty are computed, and only the
    terms some row sets (a 1 or a 0 changes no bit). `counts`: the sampler's, kept from step to step (a
    one-off table when None)."""
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not rows:
        if counts is not None:  # a burst of penalized requests over: their rows go now, not at the next one
            counts.release_finished()
        return logits
    device, dtype = logits.device, logits.dtype
    params = [seqs[i].params for i in rows]
    counts = counts if counts is not None else TokenCounts()
    table_rows = counts.update([seqs[i] for i in rows], logits)
    index = torch.tensor(rows, device=device)
    sub = logits[index]  # [R, V]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts.seen.index_select(0, table_rows)
        rep = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=dtype)[:, None]
        finfo = torch.finfo(dtype)
        rep = rep.clamp(min=finfo.tiny, max=finfo.max)  # 1e-300 is 0 in float32, 1e300 inf: 0 * inf is NaN
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        out_counts = counts.output_counts.index_select(0, table_rows)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=dtype)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device, dtype=dtype)[:, None]
        sub = sub - freq * out_counts
        sub = sub - pres * (out_counts > 0).to(dtype)
    if len(rows) == len(seqs):
        return sub
    out = logits.clone()
    out[index] = sub
    return out


def _processed_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Temperature, min_p, top-k, then top-p; returns probabilities [N, V] (filtered entries exactly 0)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)[:, None]
    # Overflow (a tiny repetition penalty, a low temperature) to +inf would make softmax's inf - inf a NaN: the
    # largest finite value stands in, and the tokens holding it share the draw.
    logits = (logits / temps).clamp(max=torch.finfo(logits.dtype).max)
    if any(p.min_p > 0.0 for p in params):  # a row with min_p 0 masks nothing: its logits stay as they are
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)[:, None]
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_ks):  # the k-th largest logit from the largest k asked for, not from a sort of the vocabulary
        ks = torch.tensor(top_ks, device=device)[:, None]  # 0: no top-k, nothing masked
        kth = logits.topk(max(top_ks), dim=-1).values.gather(1, (ks - 1).clamp(min=0))
        logits = logits.masked_fill((logits < kth) & (ks > 0), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        top_p = torch.tensor(top_ps, device=device, dtype=probs.dtype)[:, None]
        uses = top_p < 1.0
        probs = probs.masked_fill(_top_p_drop(probs, top_p, uses), 0.0)
        probs = torch.where(uses, probs / probs.sum(dim=-1, keepdim=True), probs)
    return probs


def _top_p_drop(probs: torch.Tensor, top_p: torch.Tensor, uses: torch.Tensor, first: int = 1024) -> torch.Tensor:
    """The tokens top-p drops [N, V]: in each row using it (`uses`), a token once the more probable tokens before
    it already reach `top_p` (the first always stays). A row with top_p 1 drops nothing: its cumulative sum can
    reach 1 by rounding before its tail ends, and its probabilities stay exactly as they are alone.

    The `first` most probable tokens of each row are sorted (a top-k), not the vocabulary: in a row where they
    reach `top_p` every token after them is dropped, and theirs are the decisions a sort of the whole row makes
    (the same values in the same order; tied tokens may come in another order, as between two sorts). Only the
    rows where they do not (flat distributions) are sorted whole. Which way a row goes depends on it alone, never
    on the rows beside it (a seed gives the same tokens whatever the batch)."""
    if first >= probs.shape[-1]:
        return _sorted_drop(probs, top_p, uses)
    sorted_probs, order = probs.topk(first, dim=-1)
    cum = sorted_probs.cumsum(dim=-1)
    drop = _dropped(sorted_probs, cum, order, top_p, uses, uses.expand_as(probs).clone())
    short = ((cum[:, -1:] < top_p) & uses)[:, 0].nonzero()[:, 0]  # one sync: the rows their first do not settle
    if len(short):
        drop[short] = _sorted_drop(probs[short], top_p[short], uses[short])
    return drop


def _sorted_drop(probs: torch.Tensor, top_p: torch.Tensor, uses: torch.Tensor) -> torch.Tensor:
    """_top_p_drop by sorting whole rows."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    return _dropped(sorted_probs, sorted_probs.cumsum(dim=-1), order, top_p, uses,
                    torch.zeros_like(probs, dtype=torch.bool))


def _dropped(sorted_probs, cum, order, top_p, uses, drop: torch.Tensor) -> torch.Tensor:
    """`drop` (what happens to the tokens not in `order`) with the decisions for those in it."""
    drop_sorted = (cum - sorted_probs >= top_p) & uses
    drop_sorted[:, 0] = False  # also where top_p is 0 in this dtype (1e-50 is, in float32): one token stays
    return drop.scatter(1, order, drop_sorted)
