"""Prompt logprobs (vLLM's `prompt_logprobs`, and what `echo` with `logprobs` answers): for each prompt
token but the first, its logprob given the tokens before it, its rank, and the k most likely tokens.

The hidden state at prompt position p predicts token p + 1, so a sequence that asks for them needs the
logits of every position p of its prompt chunk with p + 1 < prompt length. They are computed here, apart
from the sampler's rows: the sampler gets exactly the logits it gets without this feature (the same rows,
in the same call), so no other request's tokens change by a bit. The extra rows go through the LM head
`SLICE_ROWS` at a time (a 4k-token prompt over a 128k vocabulary would be 2 GB of float32 logits at
once); of each row only the prompt token's logprob, its rank and the top k are kept. Ranking follows the
sampled tokens' logprobs (sampler.raw_logprobs): the model's raw distribution, before logit_bias,
penalties and temperature.

Chunked prefill: a chunk's positions fill the entries up to the first token of the next chunk (its last
position predicts it). Preemption: a recomputed prompt runs its positions again, but the sequence keeps
the entries it has and only positions not yet filled are computed. Pure decode steps (CUDA graphs) never
need a row: a decode's position is at least the prompt's last, which predicts no prompt token.

Sharing: the n choices of a request are n sequences of one prompt, adapter and k, whose entries are the
same. Before its first entry, a sequence takes the list that one in flight with the same three (and the same
tenant and cache_salt, as the prefix cache: no timing tells a tenant what another asked) holds, so
each position is computed once, by whichever of them runs it first (in the same step too): a sharer never
runs a position before the list has its entry, since any position it ran is filled. A choice admitted only
after all the others finished computes its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from lorafleet.worker.sampler import raw_logprobs
from lorafleet.worker.sequence import Sequence, TokenLogprob

SLICE_ROWS = 256  # rows of logits computed at once


def prompt_rows(scheduled: list[tuple[Sequence, int]]) -> tuple[list[int], list[int], list[tuple[Sequence, int]]]:
    """For a step's (sequence, new tokens) in forward order: the rows of the step's hidden states whose logits
    are needed, the prompt token each predicts, and per sequence that needs rows, how many (in row order)."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[Sequence, int]] = []
    filled: dict[int, int] = {}  # id(list) -> its entries once this step's rows so far are in (shared lists)
    offset = 0  # the sequence's first row in the step
    for seq, num_new in scheduled:
        if seq.params.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            entries = filled.get(id(seq.prompt_logprobs), len(seq.prompt_logprobs))
            lo = max(start, entries - 1)  # positions before lo are filled already
            hi = min(start + num_new, seq.num_prompt_tokens - 1)
            if lo < hi:
                rows.extend(range(offset + lo - start, offset + hi - start))
                targets.extend(seq.prompt_token_ids[lo + 1 : hi + 1])
                owners.append((seq, hi - lo))
                filled[id(seq.prompt_logprobs)] = hi + 1
        offset += num_new
    return rows, targets, owners


def share_prompt_logprobs(scheduled: list[tuple[Sequence, int]], lists: weakref.WeakValueDictionary,
                          eras: dict[str, int] | None = None) -> None:
    """Give a sequence about to compute its first prompt logprobs the list that an unfinished sequence with the
    same prompt, adapter and k (tenant and cache_salt) holds. `lists`: (tenant, its era, cache_salt, adapter, k,
    prompt) -> the last list made for them (kept by the caller from step to step; an entry goes with its list);
    `eras`: tenant -> how many times its name was taken away (ModelRunner.tenant_gone)."""
    for seq, _ in scheduled:
        k = seq.params.prompt_logprobs
        if k is None or len(seq.prompt_logprobs) > 1 or seq.num_prompt_tokens < 2:
            continue  # none asked, some entries in already (its own or shared), or none to compute
        era = (eras or {}).get(seq.tenant, 0)
        key = (seq.tenant, era, seq.params.cache_salt, seq.adapter, k, tuple(seq.prompt_token_ids))
        shared = lists.get(key)
        if shared is seq.prompt_logprobs:
            continue
        if shared is not None and any(not s.is_finished for s in shared.holders):
            seq.prompt_logprobs = shared
            shared.holders.add(seq)
        else:  # none, or only finished requests' (a later request computes its own)
            lists[key] = seq.prompt_logprobs


@torch.inference_mode()
def fill_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                         scheduled: list[tuple[Sequence, int]], lists: weakref.WeakValueDictionary | None = None,
                         eras: dict[str, int] | None = None) -> None:
    """Append this step's prompt logprobs to the sequences that ask for them. `compute_logits`: hidden rows
    -> float32 logits (the model's LM head); `hidden`: the step's hidden states [T, H]; `lists`, `eras`: as
    share_prompt_logprobs takes them (None: no list shared)."""
    if lists is not None:
        share_prompt_logprobs(scheduled, lists, eras)
    rows, targets, owners = prompt_rows(scheduled)
    if not rows:
        return
    k = max(seq.params.prompt_logprobs for seq, _ in owners)
    device = hidden.device
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    tokens = torch.tensor(targets, dtype=torch.int64, device=device)
    chosen_parts, rank_parts, val_parts, id_parts = [], [], [], []
    for s in range(0, len(rows), SLICE_ROWS):
        logits = compute_logits(hidden[index[s : s + SLICE_ROWS]])
        logprobs, chosen, vals, ids = raw_logprobs(logits, tokens[s : s + SLICE_ROWS], k)
        chosen_parts.append(chosen)
        rank_parts.append((logprobs >= chosen[:, None]).sum(dim=-1))
        if k:
            val_parts.append(vals)
            id_parts.append(ids)
        del logits, logprobs
    chosen = torch.cat(chosen_parts).tolist()
    ranks = torch.cat(rank_parts).tolist()
    top_vals = torch.cat(val_parts).tolist() if k else [[]] * len(rows)
    top_ids = torch.cat(id_parts).tolist() if k else [[]] * len(rows)
    i = 0
    for seq, n in owners:
        w = seq.params.prompt_logprobs
        for j in range(i, i + n):
            top = list(zip(top_ids[j][:w], top_vals[j][:w], strict=True))
            seq.prompt_logprobs.append(TokenLogprob(targets[j], chosen[j], top, rank=ranks[j]))
        i += n
