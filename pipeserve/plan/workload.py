"""Request traces for the simulator: random, shared-prefix, or a ShareGPT JSON file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeserve.plan.presets import PlanInputError, read_json

CHARS_PER_TOKEN = 4.0  # ShareGPT text is not tokenized here (no runtime); ~4 chars per token
KINDS = ("random", "shared-prefix", "sharegpt")


@dataclass(frozen=True)
class TraceRequest:
    arrival: float         # s
    prompt_len: int        # tokens, prefix included
    output_len: int        # tokens to generate
    prefix_id: int = -1    # requests with the same id share their first prefix_len tokens
    prefix_len: int = 0


@dataclass(frozen=True)
class Workload:
    """How to build a trace (the CLI's --dataset, --num-prompts, --input-len, ... flags)."""
    kind: str = "random"
    num_requests: int = 200
    input_len: int = 1024
    output_len: int = 256
    range_ratio: float = 0.0          # lengths uniform in [len·(1−r), len·(1+r)], as vLLM's random
    prefix_len: int = 0               # shared-prefix: tokens every request of a group shares
    num_prefixes: int = 1             # shared-prefix: number of distinct prefixes
    path: str | None = None           # sharegpt: the JSON file
    request_rate: float = math.inf    # requests/s, Poisson; inf = all at time 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanInputError(f"dataset must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise PlanInputError("--num-prompts, --input-len and --output-len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise PlanInputError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.request_rate <= 0:
            raise PlanInputError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.kind == "sharegpt" and not self.path:
            raise PlanInputError("--dataset sharegpt needs --dataset-path FILE.json")

    def build(self) -> list[TraceRequest]:
        rng = np.random.default_rng(self.seed)
        lengths = self._lengths(rng)
        arrivals = self._arrivals(rng, len(lengths))
        return [TraceRequest(float(t), p, o, pid, plen)
                for t, (p, o, pid, plen) in zip(arrivals, lengths)]

    def _lengths(self, rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
        if self.kind == "sharegpt":
            return [(p, o, -1, 0) for p, o in load_sharegpt(self.path, self.num_requests)]
        inputs = _uniform_lengths(rng, self.input_len, self.range_ratio, self.num_requests)
        outputs = _uniform_lengths(rng, self.output_len, self.range_ratio, self.num_requests)
        if self.kind == "random":
            return [(int(i), int(o), -1, 0) for i, o in zip(inputs, outputs)]
        groups = rng.integers(0, self.num_prefixes, self.num_requests)
        return [(self.prefix_len + int(i), int(o), int(g), self.prefix_len)
                for i, o, g in zip(inputs, outputs, groups)]

    def _arrivals(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if math.isinf(self.request_rate):
            return np.zeros(count)
        return np.cumsum(rng.exponential(1.0 / self.request_rate, count))


def _uniform_lengths(rng: np.random.Generator, mean: int, ratio: float, count: int) -> np.ndarray:
    low = max(1, int(mean * (1 - ratio)))
    high = max(low, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, count)


def load_sharegpt(path: str, limit: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the first human→gpt turn of each conversation."""
    data = read_json(Path(path), "ShareGPT file")
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        if len(turns) >= 2:
            prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
            pairs.append((_tokens(prompt), _tokens(reply)))
        if len(pairs) == limit:
            break
    if not pairs:
        raise PlanInputError(f"ShareGPT file {path!r} holds no conversations with two turns "
                             "(expected a list of {\"conversations\": [{\"from\", \"value\"}, ...]})")
    return pairs


def _tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
