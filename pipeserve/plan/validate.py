"""Check the planner against measured runs: predicted vs measured output tokens/s.

    python -m pipeserve.plan.validate benchmarks/results --hardware benchmarks/results/cpu-local.yaml

Reads every ``bench throughput`` JSON of a random workload in the folder, predicts
the same configuration (pipeline size, schedule, partition, virtual stages,
micro-batches) on the same workload with ``predict_throughput``, and prints a
Markdown table with the ratio predicted / measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeserve.plan.hardware import load_hardware
from pipeserve.plan.predict import predict_throughput
from pipeserve.plan.presets import load_model
from pipeserve.plan.workload import Workload


def rows(results: Path, hardware: str, model: str = "SmolLM2-135M") -> list[dict]:
    _, cfg = load_model(model)
    hw = load_hardware(hardware)
    out = []
    for path in sorted(results.glob("*.json")):
        row = _compare(path, cfg, hw)
        if row is not None:
            out.append(row)
    return out


def _compare(path: Path, cfg, hw) -> dict | None:
    doc = json.loads(path.read_text())
    if doc.get("kind") != "throughput" or doc["dataset"]["name"] != "random":
        return None
    run = next((r for r in doc["runs"] if r["backend"] == "pipeserve"), None)
    if run is None:
        return None
    engine, data = run["engine"], doc["dataset"]
    if engine.get("threads_per_stage"):
        return None  # the planner assumes the runtime's default: the cores split over the stages
    workload = Workload(kind="random", num_requests=data["num_requests"], input_len=data["input_len"],
                        output_len=data["output_len"], range_ratio=data["range_ratio"], seed=data["seed"])
    pp, schedule = engine["pipeline_parallel_size"], engine["pp_schedule"]
    predicted = predict_throughput(
        cfg, hw, pp, schedule, workload, micro_batches=_engine_inflight(engine),
        virtual_stages=engine.get("pp_virtual_stages") if schedule == "interleaved" else None,
        partition=engine.get("pp_partition", "uniform"), max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"], dtype=engine["dtype"],
        kv_capacity_tokens=_kv_capacity(run, engine))
    measured = run["output_tokens_per_s"]
    pred = predicted["output_tokens_per_s"]
    return {"file": path.name, "label": doc.get("label") or path.stem, "pp": pp, "schedule": schedule,
            "partition": engine.get("pp_partition"), "measured": measured, "predicted": pred,
            "ratio": pred / measured}


def _engine_inflight(engine: dict) -> int:
    """Micro-batches the measured engine kept in flight (its executor's
    ``max_inflight``): 1 at PP = 1, else ``--pp-max-inflight`` or P (gpipe: M if larger)."""
    pp = engine["pipeline_parallel_size"]
    if pp == 1:
        return 1
    if engine.get("pp_max_inflight"):
        return engine["pp_max_inflight"]
    if engine["pp_schedule"] == "gpipe":
        return max(pp, engine.get("pp_micro_batches") or pp)
    return pp


def _kv_capacity(run: dict, engine: dict) -> float | None:
    """Tokens the measured engine's KV cache held (its block count), so the
    simulator admits requests under the same memory limit; None if not recorded."""
    blocks = run.get("scheduler", {}).get("num_blocks")
    return blocks * engine["block_size"] if blocks else None


def markdown(table: list[dict]) -> str:
    lines = ["| run | PP | schedule | partition | measured out tok/s | predicted | predicted / measured |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['label']} | {r['pp']} | {r['schedule']} | {r['partition']} | "
                     f"{r['measured']:.1f} | {r['predicted']:.1f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeserve.plan.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="folder of bench throughput JSON files")
    parser.add_argument("--hardware", required=True, help="calibrated hardware file (pipeserve plan --calibrate)")
    parser.add_argument("--model", default="SmolLM2-135M")
    args = parser.parse_args(argv)
    table = rows(args.results, args.hardware, args.model)
    if not table:
        print(f"no random-workload throughput results in {args.results}", file=sys.stderr)
        return 2
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
