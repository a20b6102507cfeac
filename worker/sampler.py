"""Sampler: next tokens (and logprobs) from the last-token logits of each sampling sequence.

Randomness is drawn per sequence: a seeded request owns a torch.Generator, so its tokens depend
only on its own logits and seed, never on which other requests share the batch. Sampling uses the
exponential-race form of the categorical draw, `argmax(p / Exp(1))`, which needs one draw per
vocabulary entry and no cumulative sums over the batch.
"""

from __future__ import annotations

import torch

from lorafleet.worker.sequence import Sequence, TokenLogprob


class Sampler:
    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # Unseeded requests share one engine-wide generator.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        """logits: float32 [N, V], row i belongs to seqs[i]."""
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
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
            tokens[rows] = (probs / noise).argmax(dim=-1)
        want = [s.params.logprobs for s in seqs]
        token_list = tokens.tolist()
        if all(w is None for w in want):
            return [(t, None) for t in token_list]
        logprobs = torch.log_softmax(logits, dim=-1)  # of the model's distribution, before processing
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        k = max(w or 0 for w in want)
        top_vals, top_ids = [[]] * len(seqs), [[]] * len(seqs)
        if k:
            vals, ids = logprobs.topk(k, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out: list[tuple[int, TokenLogprob | None]] = []
        for i, w in enumerate(want):
            if w is None:
                out.append((token_list[i], None))
            else:
                top = list(zip(top_ids[i][:w], top_vals[i][:w], strict=True))
                out.append((token_list[i], TokenLogprob(token_list[i], chosen[i], top)))
        return out


def _processed_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Temperature, top-k, then top-p; returns probabilities [N, V] (filtered entries exactly 0)."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)[:, None]
    logits = logits / temps
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_ks):
        k = torch.tensor([k or vocab for k in top_ks], device=device)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        top_p = torch.tensor(top_ps, device=device, dtype=probs.dtype)[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens before it already reach top_p (the first token always stays).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
