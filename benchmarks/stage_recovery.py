"""How long a killed stage pauses the requests: the built-in GGUF over a pipeline, one stage
SIGKILLed mid-run, the engine's recovery time (failure noticed -> every stage replaced and
ready: ``LLM.stats()["recovery"]["recovery_seconds"]``), how much longer the run took than
undisturbed (the pause the requests saw, replay included) and the engine's start-up time; the
greedy output is checked against an undisturbed run.

    PYTHONPATH=$PWD python benchmarks/stage_recovery.py [--pp 2] [--victim 1] [--rounds 2]

Run it with another tree's PYTHONPATH to compare (each round is a fresh engine).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from pipeserve import LLM, SamplingParams


def one_round(pp: int, victim: int, prompts: int, tokens: int) -> tuple[float, float, float, bool]:
    started = time.monotonic()
    llm = LLM("smollm2-135m-instruct", pipeline_parallel_size=pp, quantization="auto", max_stage_restarts=2)
    start_s = time.monotonic() - started
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    batch = [f"Request {i}: write a short story about a lighthouse." for i in range(prompts)]
    try:
        reference = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        t = time.monotonic()
        llm.generate(batch, params, use_tqdm=False)
        undisturbed = time.monotonic() - t
        pid = llm.engine.stage_pids[victim]

        def kill_a_quarter_in() -> None:   # every request is decoding by then
            time.sleep(undisturbed / 4)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_a_quarter_in, daemon=True)
        t = time.monotonic()
        killer.start()
        outputs = llm.generate(batch, params, use_tqdm=False)
        pause = time.monotonic() - t - undisturbed
        killer.join()
        recovery = llm.stats()["recovery"]
    finally:
        llm.shutdown()
    same = [o.outputs[0].token_ids for o in outputs] == reference
    if len(recovery["recovery_seconds"]) != 1:
        raise RuntimeError(f"expected one recovery, got {recovery}")
    return start_s, recovery["recovery_seconds"][0], pause, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--victim", type=int, default=1, help="the stage to kill")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for r in range(args.rounds):
        start_s, recovery_s, pause_s, same = one_round(args.pp, args.victim, args.prompts, args.tokens)
        print(f"round {r + 1}: engine start {start_s:.2f} s, stage {args.victim} killed -> recovered in "
              f"{recovery_s:.2f} s, the run took {pause_s:.2f} s longer than undisturbed, greedy output "
              f"{'identical' if same else 'DIFFERS'}", flush=True)


if __name__ == "__main__":
    main()
