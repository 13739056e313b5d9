"""Check the planner against measured runs: predicted vs measured output tokens/s.

    python -m pipeserve.plan.validate benchmarks/results --hardware benchmarks/results/cpu-local.yaml
    python -m pipeserve.plan.validate --tp-latency --hardware benchmarks/results/cpu-local.yaml

Reads every ``bench throughput`` JSON of a random workload in the folder, predicts
the same configuration (pipeline size, schedule, partition, virtual stages,
micro-batches) on the same workload with ``predict_throughput``, and prints a
Markdown table with the ratio predicted / measured. ``--tp-latency`` adds the
tensor-parallel rows: one request's per-token latency at the recorded (PP, TP)
configurations against the figures in benchmarks/README.md (``tp_latency_rows``).
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


# Tensor parallelism: one request's per-token latency (ms), SmolLM2-135M bfloat16 dense, prompt
# 128, 256 tokens (benchmarks/README.md "Tensor parallelism: one request at TP = 2 vs PP = 2 vs
# PP = 1", measured on the shared 2-core machine under load, load average 3-11: noisy).
# (label, PP, TP, per-all-reduce latency in s or None, measured ms per token)
RECORDED_TP_LATENCY = [
    ("PP=1, 1 thread", 1, 1, None, 45.9),
    ("PP=2, 1 thread each", 2, 1, None, 45.6),
    ("TP=2, shared-memory all-reduce, 1 thread each", 1, 2, 0.58e-3, 74.6),
    ("TP=2, gloo all-reduce, 1 thread each", 1, 2, 1.35e-3, 120.7),
]


def tp_latency_rows(hardware: str, model: str = "SmolLM2-135M", prompt: int = 128, tokens: int = 256) -> list[dict]:
    """Predicted vs recorded per-token decode latency of one request at each recorded
    (PP, TP): the cost model's chunk times (its 2 all-reduces per layer, the embedding's and
    the logits gather at the ends) + hops + the driver, every rank process on its own core
    (the runs' one thread each). The per-all-reduce latency is the one measured in the same
    run, so a TP row checks the rest of the model (compute split T ways, collective counts)."""
    import dataclasses

    from pipeserve.plan.roofline import BatchShape
    from pipeserve.plan.stages import PipelineCosts
    _, cfg = load_model(model)
    hw = load_hardware(hardware)
    shape = BatchShape.decode(1, prompt + tokens / 2)
    out = []
    for label, pp, tp, latency, measured in RECORDED_TP_LATENCY:
        run_hw = dataclasses.replace(hw, cores=pp * tp, tp_allreduce_latency=latency or hw.tp_allreduce_latency)
        layers = [cfg.num_layers // pp + (1 if i < cfg.num_layers % pp else 0) for i in range(pp)]
        costs = PipelineCosts(cfg, run_hw, layers, pp, tp)
        seconds = (sum(costs.chunk_time(c, shape) + costs.hop_time(c, shape) for c in range(pp))
                   + costs.driver_time(shape))
        out.append({"label": label, "pp": pp, "tp": tp, "measured": measured, "predicted": seconds * 1e3,
                    "ratio": seconds * 1e3 / measured})
    return out


def tp_markdown(table: list[dict]) -> str:
    lines = ["| run (one request) | PP | TP | measured ms/token | predicted | predicted / measured |",
             "|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['label']} | {r['pp']} | {r['tp']} | {r['measured']:.1f} | {r['predicted']:.1f} | "
                     f"{r['ratio']:.2f} |")
    return "\n".join(lines)


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
    parser.add_argument("results", type=Path, nargs="?", help="folder of bench throughput JSON files")
    parser.add_argument("--hardware", required=True, help="calibrated hardware file (pipeserve plan --calibrate)")
    parser.add_argument("--model", default="SmolLM2-135M")
    parser.add_argument("--tp-latency", action="store_true",
                        help="also (or, without a results folder, only) the tensor-parallel rows: one "
                             "request's per-token latency vs the figures recorded in benchmarks/README.md")
    args = parser.parse_args(argv)
    if args.tp_latency:
        print(tp_markdown(tp_latency_rows(args.hardware, args.model)))
        if args.results is None:
            return 0
        print()
    if args.results is None:
        parser.error("give a results folder, or --tp-latency")
    table = rows(args.results, args.hardware, args.model)
    if not table:
        print(f"no random-workload throughput results in {args.results}", file=sys.stderr)
        return 2
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
