"""The driver's CPU time per micro-batch on the reference workload's shape, stages left out.

The real ``LLMEngine`` (scheduler, step builder, output processing, detokenizer)
runs over an executor that answers at once, after taking the step through the
wire format both ways as the pipeline transport does; the stage's half of that
(decoding the step, encoding its result) is timed apart and left out, so every
CPU second counted is the driver's (its engine thread: ``time.thread_time``;
under cProfile the stage's half shows too). Requests:
the reference workload's shape (random token ids, input 128-512, output
64-256, seed 0), fewer of them.

    python benchmarks/driver_cpu.py --num-prompts 64             # ms/step of this tree
    python benchmarks/driver_cpu.py --num-prompts 32 --cprofile  # plus the top functions
    python benchmarks/driver_cpu.py --compare /tmp/base --rounds 3  # this tree vs another, alternating

``--compare DIR`` runs this script under ``PYTHONPATH=DIR`` (e.g. an older commit
unpacked with ``git archive``) and under this tree, alternately, and prints the
ratio of their medians: on a loaded machine only same-run ratios mean anything.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def make_engine(max_inflight: int, max_num_seqs: int):
    from pipeserve.config import EngineConfig
    from pipeserve.engine.llm_engine import LLMEngine
    from pipeserve.worker.executor import Executor
    from pipeserve.worker.step import SampledToken, StepInput, StepOutput
    from pipeserve.worker.step_wire import dumps, from_wire

    class InstantExecutor(Executor):
        """Answers every step at once: a token per sampled sequence, through the wire format."""

        def __init__(self) -> None:
            self.max_inflight = max_inflight
            self.done: list = []
            self.steps = self.seq_steps = 0
            self.stage_cpu = 0.0

        def submit(self, step) -> None:
            sent = dumps(step)                                    # the driver encodes the step
            start = time.thread_time()                            # the stage's part, not counted:
            arrived = from_wire(StepInput, json.loads(sent))      # it decodes the step and
            out = StepOutput(arrived.step_id, [SampledToken(s.seq_id, 1000 + s.seq_id % 7, -0.5)
                                               for s in arrived.seqs if s.sampling is not None])
            back = dumps(out)                                     # encodes its result
            self.stage_cpu += time.thread_time() - start
            self.done.append(from_wire(StepOutput, json.loads(back)))   # the driver decodes it
            self.steps += 1
            self.seq_steps += len(step.seqs)

        def wait(self, timeout: float | None = None) -> list:
            done, self.done = self.done, []
            return done

        @property
        def num_inflight(self) -> int:
            return len(self.done)

    config = EngineConfig.from_kwargs(model="smollm2-135m-instruct", pipeline_parallel_size=max_inflight,
                                      pp_partition="uniform", max_num_seqs=max_num_seqs,
                                      kv_cache_memory="1GiB")
    return LLMEngine(config, executor=InstantExecutor())


def reference_requests(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens): input uniform in 128-512, output in 64-256 (the reference shape)."""
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(128, 512))], rng.randint(64, 256))
            for _ in range(n)]


def run_once(num_prompts: int, max_inflight: int, max_num_seqs: int, cprofile: bool) -> dict:
    from pipeserve.sampling_params import SamplingParams
    engine = make_engine(max_inflight, max_num_seqs)
    for i, (ids, out_len) in enumerate(reference_requests(num_prompts)):
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0))
    profiler = None
    if cprofile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    # As LLM.generate calls it in each tree (an older tree's step takes no argument).
    step = engine.step
    if "partial_outputs" in inspect.signature(engine.step).parameters:
        step = functools.partial(engine.step, partial_outputs=False)
    cpu, wall = time.thread_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        step()
    cpu, wall = time.thread_time() - cpu - engine.executor.stage_cpu, time.perf_counter() - wall
    if profiler is not None:
        profiler.disable()
        import pstats
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    steps, seq_steps = engine.executor.steps, engine.executor.seq_steps
    engine.shutdown()
    return {"steps": steps, "seq_steps": seq_steps, "cpu_s": cpu, "wall_s": wall,
            "cpu_ms_per_step": cpu / steps * 1e3, "cpu_us_per_seq_step": cpu / seq_steps * 1e6}


def compare(other: str, args: argparse.Namespace) -> None:
    """This tree and ``other`` alternately, ``args.rounds`` times each; medians and their ratio."""
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"other": str(Path(other).resolve()), "this": here}
    figures: dict[str, list[float]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            env = {**os.environ, "PYTHONPATH": tree}
            cmd = [sys.executable, str(Path(here) / "benchmarks" / "driver_cpu.py"), "--json",
                   "--num-prompts", str(args.num_prompts), "--max-inflight", str(args.max_inflight),
                   "--max-num-seqs", str(args.max_num_seqs)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            figures[name].append(result["cpu_ms_per_step"])
            print(f"round {r} {name:>5}: {result['cpu_ms_per_step']:.3f} ms/step "
                  f"({result['steps']} steps, {result['cpu_us_per_seq_step']:.1f} us per sequence-step)",
                  flush=True)
    a, b = statistics.median(figures["other"]), statistics.median(figures["this"])
    print(f"median driver CPU ms/step: other {a:.3f}, this {b:.3f}; this/other = {b / a:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-inflight", type=int, default=2, help="micro-batches in flight (PP)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cprofile", action="store_true", help="print the 25 functions with most own time")
    p.add_argument("--compare", metavar="DIR", help="another source tree to run alternately with this one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON line of figures")
    args = p.parse_args()
    if args.compare:
        compare(args.compare, args)
        return
    result = run_once(args.num_prompts, args.max_inflight, args.max_num_seqs, args.cprofile)
    print(json.dumps(result) if args.json else
          f"{result['steps']} steps: driver CPU {result['cpu_ms_per_step']:.3f} ms/step, "
          f"{result['cpu_us_per_seq_step']:.1f} us per sequence-step (wall {result['wall_s']:.2f} s)")


if __name__ == "__main__":
    main()
