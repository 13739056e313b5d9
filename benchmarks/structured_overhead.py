"""What a constrained request costs the unconstrained ones beside it, and JSON-schema throughput.

    PYTHONPATH=$PWD python benchmarks/structured_overhead.py [--rounds 3] [--pp 2]

Part 1, side by side in one run (rounds interleaved): 32 unconstrained requests
(64 tokens each, EOS ignored, greedy) alone, then the same 32 with one
JSON-schema request beside them; reports the 32's output tok/s (their tokens
over the time until the last of them finishes).
Part 2: 32 requests with 0 %, 50 % and 100 % of them under a JSON schema
(up to 96 tokens, ending when the JSON does): output tok/s, and the driver's
grammar time per constrained token (advance the matcher + fill the next mask).
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipeserve.engine.guides import Guides
from pipeserve.entrypoints.llm import LLM
from pipeserve.sampling_params import SamplingParams
from pipeserve.structured.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "doctor", "artist", "teacher"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "role", "address", "skills"]}
TOPICS = ["a nurse", "a painter", "a chef", "a pilot", "a farmer", "an engineer", "a teacher", "a poet"]


class GrammarClock:
    """Wraps ``Guides.advance`` to add up the driver's grammar time (the matcher and the next mask)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        original = Guides.advance

        def timed(guides, seq, token_id):
            start = time.perf_counter()
            try:
                return original(guides, seq, token_id)
            finally:
                if guides.mask(seq.seq_id) is not None:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1
        Guides.advance = timed


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} number {i} as a JSON record."}]


def run(llm: LLM, plain: int, constrained: int, plain_tokens: int, plain_ignore_eos: bool) -> tuple[float, float]:
    """(output tok/s of the plain requests, output tok/s of all): plain ones first in the batch."""
    convs = [conversation(i) for i in range(plain + constrained)]
    params = [SamplingParams(temperature=0, max_tokens=plain_tokens, ignore_eos=plain_ignore_eos)] * plain
    params += [SamplingParams(temperature=0, max_tokens=96,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))] * constrained
    start = time.time()  # the clock of RequestMetrics.finished_time
    outs = llm.chat(convs, params)
    end = time.time()
    plain_outs = outs[:plain]
    plain_end = max((o.metrics.finished_time for o in plain_outs), default=end)
    plain_tps = sum(len(o.outputs[0].token_ids) for o in plain_outs) / max(plain_end - start, 1e-9)
    all_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (end - start)
    return plain_tps, all_tps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    clock = GrammarClock()
    llm = LLM(pipeline_parallel_size=args.pp)
    run(llm, 8, 1, 16, True)  # warm-up: kernels, the grammar tokenizer table
    side: dict[str, list[float]] = {"32 plain": [], "32 plain + 1 JSON": []}
    for _ in range(args.rounds):
        side["32 plain"].append(run(llm, 32, 0, 64, True)[0])
        side["32 plain + 1 JSON"].append(run(llm, 32, 1, 64, True)[0])
    print(f"part 1: output tok/s of the 32 unconstrained requests (median of {args.rounds}, interleaved)")
    for name, values in side.items():
        print(f"  {name:20s} {statistics.median(values):7.1f}   rounds: {', '.join(f'{v:.1f}' for v in values)}")
    mixes = {"0 % JSON": (32, 0), "50 % JSON": (16, 16), "100 % JSON": (0, 32)}
    totals: dict[str, list[float]] = {name: [] for name in mixes}
    clock.seconds, clock.calls = 0.0, 0
    for _ in range(args.rounds):
        for name, (plain, constrained) in mixes.items():
            totals[name].append(run(llm, plain, constrained, 96, False)[1])
    print(f"part 2: output tok/s of 32 requests (median of {args.rounds}, interleaved)")
    for name, values in totals.items():
        print(f"  {name:12s} {statistics.median(values):7.1f}   rounds: {', '.join(f'{v:.1f}' for v in values)}")
    print(f"  driver grammar time per constrained token: {clock.seconds / max(clock.calls, 1) * 1e6:.1f} us "
          f"over {clock.calls} tokens")
    llm.shutdown()


if __name__ == "__main__":
    main()
