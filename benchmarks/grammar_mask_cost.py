"""Per-token CPU cost of a grammar mask over the SmolLM2 vocabulary: llguidance vs xgrammar.

    PYTHONPATH=$PWD python benchmarks/grammar_mask_cost.py      # needs: pip install xgrammar llguidance

Walks one JSON answer (53 tokens) through a schema with nested objects, arrays
and enums, timing the mask fill before each token; prints tokenizer set-up,
schema compile and per-token mask times (3 rounds, interleaved).
"""

from __future__ import annotations

import json
import statistics
import time

from pipeserve.model.loader import resolve_model
from pipeserve.tokenizer import load_tokenizer

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]},
    "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "age", "tags", "address", "kind"]}
ANSWER = {"name": "Alice Smith", "age": 42, "tags": ["x", "yz", "hello world"],
          "address": {"city": "Paris", "zip": "75001"}, "kind": "b"}


def run_xgrammar(hf, ids: list[int]) -> tuple[float, float, list[float]]:
    import xgrammar as xg
    t0 = time.perf_counter()
    compiler = xg.GrammarCompiler(xg.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB), max_threads=1)
    t1 = time.perf_counter()
    matcher = xg.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask, times = xg.allocate_token_bitmask(1, VOCAB), []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - start)
        if not matcher.accept_token(t):
            raise RuntimeError(f"xgrammar refused token {t}")
    return t1 - t0, t2 - t1, times


def run_llguidance(hf, ids: list[int]) -> tuple[float, float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    t0 = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB)
    t1 = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t2 = time.perf_counter()
    mask, times = llt.allocate_token_bitmask(1, VOCAB), []
    for t in ids:
        start = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - start)
        if not matcher.consume_token(t):
            raise RuntimeError(f"llguidance refused token {t}: {matcher.get_error()}")
    return t1 - t0, t2 - t1, times


def main() -> None:
    hf = load_tokenizer(resolve_model("smollm2-135m-instruct")).hf_tokenizer
    ids = hf.encode(json.dumps(ANSWER), add_special_tokens=False)
    rows: dict[str, list[tuple[float, float, list[float]]]] = {"xgrammar": [], "llguidance": []}
    for _ in range(3):
        rows["xgrammar"].append(run_xgrammar(hf, ids))
        rows["llguidance"].append(run_llguidance(hf, ids))
    print(f"{len(ids)} tokens per walk, 3 rounds; medians over rounds")
    for name, runs in rows.items():
        setup = statistics.median(r[0] for r in runs) * 1e3
        compile_ms = statistics.median(r[1] for r in runs) * 1e3
        mean_us = statistics.median(statistics.mean(r[2]) for r in runs) * 1e6
        p50_us = statistics.median(statistics.median(r[2]) for r in runs) * 1e6
        max_us = statistics.median(max(r[2]) for r in runs) * 1e6
        print(f"{name:10s} tokenizer {setup:6.0f} ms | schema compile {compile_ms:5.2f} ms | "
              f"mask per token: mean {mean_us:5.1f} us, median {p50_us:5.1f} us, max {max_us:6.1f} us")


if __name__ == "__main__":
    main()
