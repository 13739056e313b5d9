"""Logit adjustments that depend on a sequence's token history, and banned ids.

Definitions (the ones vLLM and the OpenAI API use):
  - repetition penalty ``r`` (HF/CTRL style) over tokens seen in the prompt OR
    the output: a positive logit is divided by ``r``, a negative one multiplied
    by ``r`` (so ``r > 1`` always makes a seen token less likely);
  - frequency penalty ``f`` and presence penalty ``p`` (OpenAI style) over the
    OUTPUT tokens only: ``logit -= f * count + p * (count > 0)``.
Repetition is applied first, then frequency/presence.

The work is sparse: only the logits of tokens in a row's history are gathered,
changed and scattered back, so the cost grows with the history, not with
rows x vocabulary.
"""

from __future__ import annotations

from collections import Counter

import torch

from pipeserve.sampling.inputs import SeqSampling


def has_penalty(p: SeqSampling) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, params: list[SeqSampling]) -> None:
    """Penalise, in place, the rows of ``logits`` [S, V] whose params ask for it."""
    rows = [i for i, p in enumerate(params) if has_penalty(p)]
    if not rows:
        return
    vocab = logits.shape[1]
    ids, counts, seen = _history_table([params[i] for i in rows], vocab)   # [R, U] each
    device = logits.device
    ids, counts, seen = ids.to(device), counts.to(device), seen.to(device)
    row_idx = torch.tensor(rows, device=device)
    sub = [params[i] for i in rows]
    rep = _column([p.repetition_penalty for p in sub], device)             # [R, 1]
    freq = _column([p.frequency_penalty for p in sub], device)
    pres = _column([p.presence_penalty for p in sub], device)
    where = (row_idx[:, None], ids)                                         # index [R, U]
    v = logits[where]                                                       # [R, U]
    penalised = torch.where(v > 0, v / rep, v * rep)
    penalised = penalised - freq * counts - pres * (counts > 0).to(v.dtype)
    logits[where] = torch.where(seen, penalised, v)


def apply_logit_bias(logits: torch.Tensor, params: list[SeqSampling]) -> None:
    """Add each row's ``logit_bias`` in place (ids outside the vocabulary are skipped, as bans
    are: the engine refuses them at admission)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(params):
        for t, b in p.logit_bias or ():
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
                biases.append(b)
    if rows:
        logits[rows, cols] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def apply_bans(logits: torch.Tensor, params: list[SeqSampling]) -> None:
    """Set banned ids to -inf in place. Ids outside the vocabulary cannot be
    sampled anyway, so they are ignored rather than failing the whole step."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        for t in p.banned_token_ids:
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        logits[rows, cols] = float("-inf")


def _history_table(params: list[SeqSampling], vocab: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the distinct token ids seen (prompt or output), their output
    counts, and a 'seen' flag; as [R, U] tensors padded to the longest row.

    Padding repeats the row's first entry, so the duplicate scatter writes the
    very same value; a row with no history gets id 0 flagged as not seen."""
    table: list[tuple[list[int], list[float]]] = []
    for p in params:
        out = Counter(t for t in (p.output_token_ids or []) if 0 <= t < vocab)
        distinct = set(out) | {t for t in (p.prompt_token_ids or []) if 0 <= t < vocab}
        ordered = sorted(distinct)
        table.append((ordered, [float(out.get(t, 0)) for t in ordered]))
    width = max(1, max(len(ids) for ids, _ in table))
    ids = torch.zeros(len(table), width, dtype=torch.long)
    counts = torch.zeros(len(table), width, dtype=torch.float32)
    seen = torch.zeros(len(table), width, dtype=torch.bool)
    for r, (row_ids, row_counts) in enumerate(table):
        if row_ids:
            pad = width - len(row_ids)
            ids[r] = torch.tensor(row_ids + [row_ids[0]] * pad)
            counts[r] = torch.tensor(row_counts + [row_counts[0]] * pad)
            seen[r] = True
    return ids, counts, seen


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]
