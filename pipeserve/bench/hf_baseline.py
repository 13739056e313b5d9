"""The transformers baseline: ``generate`` over static batches of the same requests.

Each batch is left-padded and runs until its longest output is done
(``min_new_tokens = max_new_tokens``, since pipeserve runs with ``ignore_eos``),
which is what static batching costs. Only the tokens each request asked for
are counted as output, as vLLM's ``--backend hf`` does.
"""

from __future__ import annotations

import time

import torch

from pipeserve.bench.datasets import BenchRequest
from pipeserve.bench.stats import RequestRecord


class _FirstTokenClock:
    """A logits processor that notes when the first token's logits exist (= time to first token)."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            if scores.is_cuda:   # the logits exist once the queued kernels ran
                torch.cuda.synchronize(scores.device)
            self.first = time.perf_counter()
        return scores


def batches_of(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Consecutive batches that never mix turns (turn t needs turn t-1 done)."""
    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    out: list[list[BenchRequest]] = []
    for r in requests:
        if out and len(out[-1]) < batch_size and out[-1][0].turn == r.turn:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def left_padded(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [batch, longest prompt], padding on the left."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        mask[row, width - r.prompt_len:] = 1
    return ids, mask


def run_batch(model, batch: list[BenchRequest], pad_id: int, temperature: float,
              wave_start: float) -> list[RequestRecord]:
    ids, mask = (t.to(model.device) for t in left_padded(batch, pad_id))
    new_tokens = max(r.output_len for r in batch)
    clock = _FirstTokenClock()
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} \
        if temperature > 0 else {"do_sample": False}
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=pad_id, logits_processor=[clock],
                       **sampling)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    end = time.perf_counter()
    ttft = (clock.first or end) - wave_start
    return [RequestRecord(prompt_len=r.prompt_len, output_len=r.output_len, ttft=ttft,
                          e2el=end - wave_start) for r in batch]


def run_hf(model, requests: list[BenchRequest], batch_size: int, pad_id: int,
           temperature: float = 0.0, progress: bool = True) -> tuple[list[RequestRecord], float]:
    """All requests, turn by turn; returns (records, wall seconds)."""
    batches = batches_of(requests, batch_size)
    bar = _progress(len(requests), batch_size) if progress else None
    records: list[RequestRecord] = []
    start = time.perf_counter()
    wave_start, wave_turn = start, None
    for batch in batches:
        if batch[0].turn != wave_turn:  # a new turn "arrives" when the previous one is done
            wave_start, wave_turn = time.perf_counter(), batch[0].turn
        records += run_batch(model, batch, pad_id, temperature, wave_start)
        if bar is not None:
            bar.update(len(batch))
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return records, duration


def _progress(total: int, batch_size: int):
    from tqdm import tqdm
    return tqdm(total=total, desc=f"transformers (batch {batch_size})", unit="req")
