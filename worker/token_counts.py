"""TokenCounts: per penalized sequence, how often each token occurs in its output and which tokens its prompt
holds, kept on the device from step to step for the penalties (sampler.apply_penalties).

Counting a sequence's tokens anew at each step costs O(prompt + output) per sequence and step, and a model
whose generation_config sets repetition_penalty penalizes every request. Here a sequence owns a row: its
prompt is scattered into `seen` once, when it first samples with a penalty, and each later step adds
only the output tokens it gained since (one, at a decode). A row counts the first `num_counted` output
tokens, so a preempted sequence (recomputed: its tokens kept, its KV cache not) finds its row as it left it,
and the n choices of a request, each its own sequence, count their own outputs.

Each step first releases the rows of sequences that finished (or were dropped: their objects gone) since
the last one, so a new sequence reuses them; the table grows, doubling, only when none is free. When a burst
of penalized requests is over and at most a quarter of the rows are in use, the table halves (down to
`MIN_ROWS`), the rows in use moved below the new end: a burst's rows ([rows, V] twice, 5 bytes a token with
float32 logits, 640 KiB a row at a 128K vocabulary) do not stay allocated for as long as the worker runs.

Running example: 100 penalized sequences in rows 0..99 of a 128-row table; all but those in rows 0, 40 and
80 finish. The next step releases 97 rows, halves 128 -> 64 -> 32 -> 16 -> 8 (MIN_ROWS: 3 rows in use are
at most a quarter of each), copies rows 40 and 80 into free rows 1 and 2, and leaves row 0 where it is.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from lorafleet.worker.sequence import Sequence

MIN_ROWS = 8  # the table's smallest size once it exists: it neither grows nor shrinks below this


@dataclass(slots=True)
class _Row:
    index: int
    seq: weakref.ref[Sequence]
    num_counted: int = 0  # output tokens in the row


class TokenCounts:
    def __init__(self) -> None:
        # [rows, V]: per row, each token's occurrences in the output (whole numbers, in the logits' dtype),
        # and whether it occurs in the output or, for a repetition penalty (the one that reads it), the prompt.
        self.output_counts = torch.zeros(0, 0)
        self.seen = torch.zeros(0, 0, dtype=torch.bool)
        self._rows: dict[int, _Row] = {}  # seq_id -> its row
        self._free: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def _device(self) -> torch.device:
        return self.output_counts.device

    def update(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Bring the rows of `seqs` (whose logits are rows of `logits` [*, V]) up to their output tokens;
        returns their row indices [N] into `output_counts` and `seen`."""
        table = self.output_counts
        if (table.shape[1], table.device, table.dtype) != (logits.shape[-1], logits.device, logits.dtype):
            self._reset(logits)  # the first step, or another model's logits
        self.release_finished()
        rows: list[int] = []
        new_rows: list[Sequence] = []
        add_rows: list[int] = []  # (row, token) pairs of the output tokens gained since the last step
        add_ids: list[int] = []
        for seq in seqs:
            row = self._rows.get(seq.seq_id)
            if row is None:
                row = self._rows[seq.seq_id] = _Row(self._take_row(), weakref.ref(seq))
                new_rows.append(seq)
            out = seq.output_token_ids
            if row.num_counted < len(out):
                gained = out[row.num_counted:]
                add_rows.extend([row.index] * len(gained))
                add_ids.extend(gained)
                row.num_counted = len(out)
            rows.append(row.index)
        if new_rows:
            self._start(new_rows)
        if add_rows:
            index = self._index(add_rows, add_ids)
            ones = torch.ones(index[0].shape, device=self._device, dtype=self.output_counts.dtype)
            self.output_counts.index_put_(index, ones, accumulate=True)  # whole numbers: exact in any order
            self.seen[index] = True
        return torch.tensor(rows, device=self._device)

    def _reset(self, logits: torch.Tensor) -> None:
        self.output_counts = logits.new_zeros(0, logits.shape[-1])
        self.seen = self.output_counts.bool()
        self._rows.clear()
        self._free.clear()

    def _start(self, seqs: list[Sequence]) -> None:
        """Clear the new sequences' rows (a taken-back row holds its last owner's) and mark their prompts."""
        index = torch.tensor([self._rows[s.seq_id].index for s in seqs], device=self._device)
        self.output_counts.index_fill_(0, index, 0)
        self.seen.index_fill_(0, index, False)
        prompts = [s for s in seqs if s.params.repetition_penalty != 1.0]
        if prompts:
            rows = [self._rows[s.seq_id].index for s in prompts for _ in s.prompt_token_ids]
            ids = [t for s in prompts for t in s.prompt_token_ids]
            self.seen[self._index(rows, ids)] = True

    def _index(self, rows: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, ids) as device tensors, pairs whose id is outside the vocabulary dropped."""
        r = torch.tensor(rows, dtype=torch.int64)
        t = torch.tensor(ids, dtype=torch.int64)
        keep = (t >= 0) & (t < self.output_counts.shape[1])
        if not bool(keep.all()):
            r, t = r[keep], t[keep]
        return r.to(self._device), t.to(self._device)

    def _take_row(self) -> int:
        if not self._free:
            old = self.output_counts.shape[0]
            new = max(MIN_ROWS, 2 * old)
            self.output_counts = _resize(self.output_counts, new)
            self.seen = _resize(self.seen, new)
            self._free.extend(range(new - 1, old - 1, -1))
        return self._free.pop()

    def release_finished(self) -> None:
        """Free the rows of sequences that finished or are gone (they never sample again), and shrink the
        table when at most a quarter of it is in use."""
        for seq_id, row in list(self._rows.items()):
            seq = row.seq()
            if seq is None or seq.is_finished:
                del self._rows[seq_id]
                self._free.append(row.index)
        size = new = self.output_counts.shape[0]
        while new > MIN_ROWS and len(self._rows) <= new // 4:
            new //= 2
        if new < size:
            self._shrink(new)

    def _shrink(self, num_rows: int) -> None:
        """Keep the first `num_rows` rows: those in use past them move into free rows below."""
        movers = [row for row in self._rows.values() if row.index >= num_rows]
        used = {row.index for row in self._rows.values()}
        free = [i for i in range(num_rows) if i not in used]  # ascending; movers take the lowest
        src = torch.tensor([row.index for row in movers], dtype=torch.int64, device=self._device)
        dst = torch.tensor(free[: len(movers)], dtype=torch.int64, device=self._device)
        counts, seen = _resize(self.output_counts, num_rows), _resize(self.seen, num_rows)
        if movers:
            counts[dst] = self.output_counts[src]
            seen[dst] = self.seen[src]
        for row, index in zip(movers, free, strict=False):
            row.index = index
        self.output_counts, self.seen = counts, seen  # the larger tables are freed here
        self._free = free[len(movers):][::-1]  # popped from the end: the lowest first


def _resize(table: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A new [num_rows, V] table holding `table`'s first rows (zeros past its end)."""
    out = table.new_zeros(num_rows, table.shape[1])
    keep = min(num_rows, table.shape[0])
    out[:keep] = table[:keep]
    return out
