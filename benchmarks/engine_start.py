"""Engine start with and without the stage zygote (pipeline/zygote.py), side by side.

Two measurements, alternating the two ways each round:
  - first start: a fresh Python process per start (the zygote itself is started and imports
    torch inside it), ``LLM(...)`` until it returns;
  - later starts: one process starting and stopping the engine repeatedly (the zygote made by
    its first start is reused), the way a server that restarts its engine or a test suite runs.

    PYTHONPATH=$PWD python benchmarks/engine_start.py [--model M] [--pp 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def start_once(model: str, pp: int) -> float:
    from pipeserve import LLM, SamplingParams
    started = time.perf_counter()
    llm = LLM(model=model, pipeline_parallel_size=pp)
    seconds = time.perf_counter() - started
    llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    llm.shutdown()
    return seconds


def first_start(model: str, pp: int, zygote: str) -> float:
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import engine_start; "
            f"print(engine_start.start_once({model!r}, {pp}))")
    env = {**os.environ, "PIPESERVE_STAGE_ZYGOTE": zygote}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    first: dict[str, list[float]] = {"0": [], "1": []}
    later: dict[str, list[float]] = {"0": [], "1": []}
    for r in range(args.rounds):
        for mode in ("1", "0") if r % 2 == 0 else ("0", "1"):
            first[mode].append(round(first_start(args.model, args.pp, mode), 2))
    start_once(args.model, args.pp)   # this process's own first start (imports, zygote), not counted
    for r in range(args.rounds):
        for mode in ("1", "0") if r % 2 == 0 else ("0", "1"):
            os.environ["PIPESERVE_STAGE_ZYGOTE"] = mode
            later[mode].append(round(start_once(args.model, args.pp), 2))
    result = {"model": args.model, "pp": args.pp,
              "first_start_s": {"new_interpreters": first["0"], "zygote": first["1"]},
              "later_starts_s": {"new_interpreters": later["0"], "zygote": later["1"]}}
    print(json.dumps(result))
    for name, table in (("first start", first), ("later starts", later)):
        old, new = statistics.median(table["0"]), statistics.median(table["1"])
        print(f"{name}: median {old:.2f} s with new interpreters, {new:.2f} s with the zygote ({new / old:.2f}x)")


if __name__ == "__main__":
    main()
