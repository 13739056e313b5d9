"""A stand-in for ``ModelRunner`` whose compute is a fixed sleep: for measuring
schedules (bubbles, overlap, link costs) without a model's noise.

Its arithmetic is deterministic and position-independent so a test can check
that every chunk ran once, in order: each layer adds 1 to every activation,
and the last chunk samples ``(first token id + num_layers) mod vocab``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeserve.model.config import ModelConfig
from pipeserve.worker.step import SampledToken, StepInput, StepOutput


@dataclass(frozen=True)
class SyntheticSource:
    step_seconds: float = 0.05          # sleep per chunk per micro-batch
    seconds_per_token: float = 0.0      # plus this per token in the step
    # Spend the time reading a buffer larger than the caches instead of sleeping: the core
    # stays busy and the caches end up cold, as after a real model's weights stream through.
    stream_mib: int = 0
    # Loading the layers takes this long: computing (the CPU time a load shows), or, with
    # ``load_idle``, asleep (a load that makes no progress).
    load_seconds: float = 0.0
    load_idle: bool = False


class SleepRunner:
    def __init__(self, source: SyntheticSource, cfg: ModelConfig, *, start_layer: int, end_layer: int,
                 is_first: bool, is_last: bool, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, num_host_blocks: int, block_size: int,
                 attention_backend: str = "auto", quantization: str = "auto",
                 quantization_group_size: int = 32, kv_cache_dtype: str = "auto",
                 prepack_weights: bool = False) -> None:
        # no model: the compute is a sleep
        del attention_backend, quantization, quantization_group_size, kv_cache_dtype, prepack_weights
        self.source, self.cfg = source, cfg
        self.layers = end_layer - start_layer
        self.is_first, self.is_last = is_first, is_last
        self.dtype, self.device = dtype, torch.device(device)
        self._stream = torch.ones(source.stream_mib << 18) if source.stream_mib else None
        if source.load_idle:
            time.sleep(source.load_seconds)
        elif source.load_seconds:
            _busy_for(torch.ones(1 << 18), source.load_seconds)

    def execute(self, step: StepInput, hidden_states: torch.Tensor | None = None) -> torch.Tensor | StepOutput:
        seconds = self.source.step_seconds + self.source.seconds_per_token * step.num_tokens
        if self._stream is not None:
            _busy_for(self._stream, seconds)
        elif seconds > 0:      # sleep(0) still yields the core: ~0.1 ms on a busy machine
            time.sleep(seconds)
        if self.is_first:
            ids = torch.tensor([t for s in step.seqs for t in s.token_ids], dtype=self.dtype)
            hidden = ids[:, None].expand(-1, self.cfg.hidden_size).contiguous()  # [num_tokens, hidden]
        else:
            hidden = hidden_states
        hidden = hidden + self.layers
        if not self.is_last:
            return hidden
        sampled, row = [], 0
        for seq in step.seqs:
            if seq.sampling is not None:
                token = int(hidden[row, 0].item()) % self.cfg.vocab_size
                sampled.append(SampledToken(seq.seq_id, token, 0.0))
            row += len(seq.token_ids)
        return StepOutput(step.step_id, sampled)


def _busy_for(stream: torch.Tensor, seconds: float) -> None:
    """Read ``stream`` in 1 MiB slices until ``seconds`` have passed."""
    end = time.perf_counter() + seconds
    while True:
        for piece in stream.split(1 << 18):
            piece.sum()
            if time.perf_counter() >= end:
                return


def failing_runner(*args, **kwargs):
    """A runner factory that cannot load (for the start-up failure tests)."""
    raise RuntimeError("no such weights")
