"""What handing a step's outputs to the server's request streams costs: ``AsyncEngine`` over an
engine that computes nothing, S streams each getting one output a step, for T steps.

    PYTHONPATH=<tree> python benchmarks/async_dispatch.py [--streams 256] [--steps 400] [--rounds 5]

Prints the process CPU time per output (the engine thread's hand-off, the event loop's wake-ups
and the streams' consumers) and the wall time, median over the rounds. In ``pipeserve serve`` the
same work shares the cores with the stages (benchmarks/README.md, forty-ninth session).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from pipeserve.engine.async_engine import AsyncEngine
from pipeserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pipeserve.sampling_params import SamplingParams


class IdleEngine:
    """Every live request gets one token a step; a request ends after ``steps`` steps."""

    healthy = True

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.live: dict[str, int] = {}
        self.metrics = RequestMetrics(time.time())

    def add_request(self, request_id, prompt, params, **_) -> None:
        self.live[request_id] = 0

    def abort_request(self, request_id):
        self.live.pop(request_id, None)
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid in list(self.live):
            n = self.live[rid] = self.live[rid] + 1
            done = n >= self.steps
            if done:
                del self.live[rid]
            completion = CompletionOutput(0, "x" * n, [7] * n, finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, "", [1], [completion], done, self.metrics))
        time.sleep(0.0005)      # a forward's wait, during which the event loop runs
        return outs

    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


async def one_round(streams: int, steps: int) -> tuple[float, float]:
    engine = AsyncEngine(IdleEngine(steps))
    params = SamplingParams(max_tokens=steps)

    async def consume(i: int) -> int:
        got = 0
        async for _ in engine.generate(f"r{i}", [1], params):
            got += 1
        return got

    cpu, wall = time.process_time(), time.perf_counter()
    counts = await asyncio.gather(*(consume(i) for i in range(streams)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    engine.shutdown()
    assert sum(counts) == streams * steps, counts[:4]
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cpus, walls = [], []
    for _ in range(args.rounds):
        cpu, wall = asyncio.run(one_round(args.streams, args.steps))
        cpus.append(cpu)
        walls.append(wall)
    outputs = args.streams * args.steps
    print(f"{args.streams} streams x {args.steps} steps: CPU {statistics.median(cpus) / outputs * 1e6:.1f} us "
          f"an output (rounds {', '.join(f'{c / outputs * 1e6:.1f}' for c in cpus)}), wall "
          f"{statistics.median(walls):.2f} s")


if __name__ == "__main__":
    main()
