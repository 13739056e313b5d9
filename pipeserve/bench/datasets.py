"""Benchmark workloads: what to send, not how to send it.

Every dataset yields ``BenchRequest``s with exact prompt token ids and an
output length, so the pipeserve engine, the transformers baseline and a remote
server all see the same requests. Lengths are counted in tokens of the
model's tokenizer (a Hugging Face tokenizer: ``encode``/``decode``/``len``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None   # the text, when the dataset has one (ShareGPT)
    turn: int = 0               # multi-turn waves: turn t is sent after turn t-1 finished

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [len·(1−r), len·(1+r)], at least 1 token, as vLLM's random dataset."""
    if length < 1:
        raise ValueError(f"a length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, int(np.floor(length * (1 - range_ratio)))), int(np.ceil(length * (1 + range_ratio)))


def sampleable_token_ids(tokenizer) -> np.ndarray:
    """Every id of the vocabulary except the special ones (no random EOS or BOS)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.arange(len(tokenizer))
    return ids[~np.isin(ids, list(special))] if special else ids


def random_requests(tokenizer, *, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    """Uniformly random token ids, lengths uniform in the ``range_ratio`` window."""
    _check_count(num_prompts)
    rng = np.random.default_rng(seed)
    vocab = sampleable_token_ids(tokenizer)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    return [BenchRequest(rng.choice(vocab, size=int(n)).tolist(), int(m))
            for n, m in zip(in_lens, out_lens)]


def prefix_requests(tokenizer, *, num_prompts: int, prefix_len: int, num_prefixes: int,
                    num_turns: int, question_len: int, output_len: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Multi-turn conversations over a few long shared prefixes (system prompts or documents).

    Conversation c uses prefix ``c % num_prefixes``. Its turn t prompt is the
    prefix, then every earlier (question, answer) pair, then a new question:
    each turn's prompt extends the previous one, as a chat client resends its
    history. Answers are synthetic tokens of ``output_len`` so that the
    requests are fixed before anything runs and every backend sees the same.
    """
    _check_count(num_prompts)
    for name, value in (("prefix_len", prefix_len), ("num_prefixes", num_prefixes),
                        ("num_turns", num_turns), ("question_len", question_len),
                        ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    rng = np.random.default_rng(seed)
    vocab = sampleable_token_ids(tokenizer)
    prefixes = [rng.choice(vocab, size=prefix_len).tolist() for _ in range(num_prefixes)]
    num_convs = -(-num_prompts // num_turns)
    requests: list[BenchRequest] = []
    for conv in range(num_convs):
        history = list(prefixes[conv % num_prefixes])
        for turn in range(num_turns):
            history += rng.choice(vocab, size=question_len).tolist()
            requests.append(BenchRequest(list(history), output_len, turn=turn))
            history += rng.choice(vocab, size=output_len).tolist()
    requests.sort(key=lambda r: r.turn)  # stable: conversation order within a turn
    return _trim_to_count(requests, num_prompts, num_turns)


def _trim_to_count(requests: list[BenchRequest], count: int, num_turns: int) -> list[BenchRequest]:
    """Drop the surplus from the last turn so exactly ``count`` requests remain."""
    surplus = len(requests) - count
    if surplus <= 0:
        return requests
    last = [i for i, r in enumerate(requests) if r.turn == num_turns - 1][-surplus:]
    drop = set(last)
    return [r for i, r in enumerate(requests) if i not in drop]


def sharegpt_requests(path: str | Path, tokenizer, *, num_prompts: int, output_len: int | None = None,
                      seed: int = 0, max_len: int = 2048) -> list[BenchRequest]:
    """First human turn as the prompt, the first answer's length as the output length.

    ``output_len`` overrides the answers' lengths. Conversations too short
    (< 4 prompt tokens, < 4 answer tokens) or too long (prompt + answer > ``max_len``)
    are skipped, as vLLM's ShareGPT loader does; the rest are shuffled with ``seed``.
    """
    _check_count(num_prompts)
    pairs = _sharegpt_pairs(Path(path))
    order = np.random.default_rng(seed).permutation(len(pairs))
    requests: list[BenchRequest] = []
    for i in order:
        prompt, answer = pairs[i]
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        if len(ids) < 4 or out < 4 or len(ids) + out > max_len:
            continue
        requests.append(BenchRequest(ids, out, prompt=prompt))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(f"{path} holds only {len(requests)} usable conversations, "
                     f"fewer than --num-prompts {num_prompts}")


def _sharegpt_pairs(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file {path} not found: pass --dataset-path to a local JSON file")
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path} is not ShareGPT JSON: expected a list of {{'conversations': [...]}}")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2:
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    return pairs


def _check_count(num_prompts: int) -> None:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")


def summarize_requests(requests: list[BenchRequest]) -> dict:
    """Token counts of a workload, for the result JSON."""
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    return {"num_requests": len(requests), "total_input_tokens": int(sum(ins)),
            "total_output_tokens": int(sum(outs)), "min_input_len": min(ins), "max_input_len": max(ins),
            "min_output_len": min(outs), "max_output_len": max(outs),
            "num_turns": max(r.turn for r in requests) + 1}
