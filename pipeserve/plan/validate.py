"""Check the planner against measured runs: predicted vs measured output tokens/s.

    python -m pipeserve.plan.validate benchmarks/results --hardware benchmarks/results/cpu-local.yaml
    python -m pipeserve.plan.validate --tp-latency --hardware benchmarks/results/cpu-local.yaml
    python -m pipeserve.plan.validate --heldout      # after benchmarks/run_planner_validation.sh

Reads every ``bench throughput`` JSON of a random workload in the folder, predicts
the same configuration (pipeline size, tensor parallelism, threads per rank, schedule,
partition, virtual stages, micro-batches, KV blocks, kept-quantized weights) on the same
workload with ``predict_throughput``, and prints a Markdown table with the ratio
predicted / measured. ``--heldout`` fits two hardware fields on one set of runs (the
stored reference runs) and checks the fit on another (benchmarks/results/heldout/), then
writes the fitted hardware file with the held-out error band. ``--tp-latency`` adds the
tensor-parallel rows: one request's per-token latency at the recorded (PP, TP)
configurations against the figures in benchmarks/README.md (``tp_latency_rows``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path

from pipeserve.plan.hardware import Hardware, load_hardware
from pipeserve.plan.predict import predict_throughput
from pipeserve.plan.presets import PlanInputError, load_model
from pipeserve.plan.workload import Workload


def rows(results: Path, hardware: str, model: str = "SmolLM2-135M", jobs: int = 1) -> list[dict]:
    """Predicted vs measured output tokens/s for every random-workload ``bench throughput``
    JSON in ``results`` (a folder, or one file)."""
    _, cfg = load_model(model)
    hw = load_hardware(hardware)
    return predict_runs(load_runs(results), cfg, hw, jobs)


def load_runs(results: Path | list[Path]) -> list[dict]:
    """The pipeserve runs of random workloads in folders (or files), each as the facts a
    prediction needs. Runs of one configuration (same engine and workload: the repeats of
    benchmarks/run_planner_validation.sh) are one row measured at their median, with every
    sample kept: one run of a shared machine can be far from the next (on the AVX2 VM the
    same TP = 2 command gave 84-128 out tok/s on one afternoon)."""
    paths = []
    for item in results if isinstance(results, list) else [results]:
        paths += [item] if item.is_file() else sorted(item.glob("*.json"))
    out, by_key = [], {}
    for path in paths:
        run = _load(path)
        if run is None:
            continue
        key = json.dumps([run["workload"], run["engine"]], sort_keys=True)
        if key in by_key:
            by_key[key]["samples"].append(run["measured"])
            by_key[key]["ttft_samples"] += run["ttft_samples"]
        else:
            by_key[key] = run
            out.append(run)
    for run in out:
        run["measured"] = statistics.median(run["samples"])
        run["ttft"] = statistics.median(run["ttft_samples"]) if run["ttft_samples"] else None
    return out


def _load(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("kind") != "throughput" or doc["dataset"]["name"] != "random":
        return None
    run = next((r for r in doc["runs"] if r["backend"] == "pipeserve"), None)
    if run is None:
        return None
    engine, data = run["engine"], doc["dataset"]
    if engine.get("dtype") not in (None, "bfloat16", "float32", "float16"):
        return None   # dtype auto: the planner needs the activations' dtype
    schedule = engine["pp_schedule"]
    quant = engine.get("quantization")
    facts = {
        "pp": engine["pipeline_parallel_size"], "tp": engine.get("tensor_parallel_size") or 1,
        "schedule": schedule, "micro_batches": _engine_inflight(engine),
        "virtual_stages": engine.get("pp_virtual_stages") if schedule == "interleaved" else None,
        "partition": engine.get("pp_partition", "uniform"), "max_num_seqs": engine["max_num_seqs"],
        "max_num_batched_tokens": engine["max_num_batched_tokens"], "dtype": engine["dtype"],
        "kv_capacity_tokens": _recorded_tokens(run, engine, "num_blocks"),
        "threads_per_rank": engine.get("threads_per_stage"),
        "swap_capacity_tokens": _recorded_tokens(run, engine, "num_host_blocks") or 0.0,
        # auto keeps a GGUF's blocks (the built-in SmolLM2 file: Q4_1); none / absent: the dtype
        "quantization": _weights(quant, engine.get("model")),
    }
    workload = {"num_requests": data["num_requests"], "input_len": data["input_len"],
                "output_len": data["output_len"], "range_ratio": data["range_ratio"], "seed": data["seed"]}
    return {"file": path.name, "label": doc.get("label") or path.stem, "engine": facts, "workload": workload,
            "measured": run["output_tokens_per_s"], "samples": [run["output_tokens_per_s"]],
            "ttft_samples": [run["ttft_ms"]["p50"] / 1e3] if (run.get("ttft_ms") or {}).get("p50") else []}


DEFAULT_HARDWARE = "benchmarks/results/cpu-local.yaml"
DEFAULT_CALIBRATION = ("benchmarks/results/calibration",)
DEFAULT_REFERENCE = "benchmarks/results"
DEFAULT_HELDOUT = "benchmarks/results/heldout"
DEFAULT_FITTED = "benchmarks/results/cpu-local-fitted.yaml"
DEFAULT_TABLE = "benchmarks/results/heldout/VALIDATION.md"

# The engine's --quantization values the planner can cost: auto keeps a GGUF's blocks (the
# built-in SmolLM2 file's are Q4_1), int8 / int4 quantize at load.
_QUANTIZED = {"int8": "int8", "int4": "int4"}
BUILTIN_GGUF = {"smollm2-135m-instruct": "q4_1"}


def _weights(quantization: str | None, model: str | None) -> str | None:
    if quantization == "auto":
        return BUILTIN_GGUF.get(str(model).lower())   # a safetensors checkpoint stays dense
    return _QUANTIZED.get(quantization)


def predict_run(run: dict, cfg, hw) -> dict:
    """The run predicted; a configuration the planner refuses is a row with the reason
    (``predicted`` and ``ratio`` None), left out of the error band but not hidden."""
    e = run["engine"]
    row = {"file": run["file"], "label": run["label"], "pp": e["pp"], "tp": e["tp"], "schedule": e["schedule"],
           "partition": e["partition"], "threads": e["threads_per_rank"], "quantization": e["quantization"],
           "requests": run["workload"]["num_requests"], "measured": run["measured"],
           "samples": run["samples"], "predicted": None,
           "ratio": None, "ttft_ratio": None, "preemptions": None, "error": None}
    try:
        return {**row, **_predicted(run, cfg, hw)}
    except PlanInputError as exc:
        return {**row, "error": str(exc)}


def _predicted(run: dict, cfg, hw) -> dict:
    e = run["engine"]
    workload = Workload(kind="random", **run["workload"])
    predicted = predict_throughput(
        cfg, hw, e["pp"], e["schedule"], workload, tp=e["tp"], micro_batches=e["micro_batches"],
        virtual_stages=e["virtual_stages"], partition=e["partition"], max_num_seqs=e["max_num_seqs"],
        max_num_batched_tokens=e["max_num_batched_tokens"], dtype=e["dtype"],
        kv_capacity_tokens=e["kv_capacity_tokens"], threads_per_rank=e["threads_per_rank"],
        quantization=e["quantization"], swap_capacity_tokens=e.get("swap_capacity_tokens") or 0.0)
    pred = predicted["output_tokens_per_s"]
    ttft = run.get("ttft")
    return {"predicted": pred, "ratio": pred / run["measured"], "preemptions": predicted["preemptions"],
            "ttft_ratio": predicted["ttft_s"]["p50"] / ttft if ttft else None}


def predict_runs(runs: list[dict], cfg, hw, jobs: int = 1) -> list[dict]:
    """``predict_run`` for each, on ``jobs`` processes (each simulation is independent)."""
    if jobs <= 1 or len(runs) <= 1:
        return [predict_run(run, cfg, hw) for run in runs]
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(min(jobs, len(runs))) as pool:
        return list(pool.map(predict_run, runs, [cfg] * len(runs), [hw] * len(runs)))


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


def _recorded_tokens(run: dict, engine: dict, blocks: str) -> int | None:
    """Tokens in the measured engine's ``blocks`` (its scheduler's recorded count): ``num_blocks``,
    its KV cache, so the simulator admits requests under the same memory limit; ``num_host_blocks``,
    its host pool, which it has only where its preemptions swap (``--preemption-mode swap``, or
    ``auto`` resolved to swap: one CPU host). None where not recorded, or none (they recompute)."""
    count = run.get("scheduler", {}).get(blocks)
    return count * engine["block_size"] if count else None


# -- held-out validation: fit on one set of runs, check on another ---------------------
# The hardware fields fitted on the calibration runs, and the oversubscription grid.
FITTED = ("oversubscription_efficiency", "engine_overhead_scale", "engine_work_scale", "quantized_work_scale",
          "quantized_parallel_efficiency", "oversubscribed_barrier", "oversubscribed_layer_wait", "memory_contention")
OVERSUBSCRIPTION_GRID = (1.0, 0.9, 0.8, 0.7, 0.6)
BARRIER_GRID = (1.0, 0.75, 0.5, 0.25, 0.0)     # the default first: a tie keeps it
# The barrier's models: (oversubscribed_barrier, oversubscribed_layer_wait), the wait in
# proportion to the work (the default first: a tie keeps it), then a fixed wait per layer.
LAYER_WAIT_GRID = tuple(round(0.0005 * i, 4) for i in range(1, 11))   # 0.5 ... 5 ms
BARRIER_MODELS = tuple((b, 0.0) for b in BARRIER_GRID) + tuple((1.0, s) for s in LAYER_WAIT_GRID)
CONTENTION_GRID = tuple(round(0.025 * i, 3) for i in range(21))   # 0 ... 0.5


def fit(runs: list[dict], cfg, hw, jobs: int = 1) -> tuple[Hardware, list[dict]]:
    """Fit the hardware file's run-level fields on ``runs`` (``FITTED``), each to minimise
    the spread of log(predicted / measured) over the dense-weight runs:
    1. ``oversubscription_efficiency``: a grid (it matters only where threads > cores), with
       the barrier's model on its grid too where a run has multi-thread processes with more
       threads than cores (``BARRIER_MODELS``: ``oversubscribed_barrier``, a wait in
       proportion to the work, or ``oversubscribed_layer_wait``, a fixed wait per layer,
       told apart by the runs' TTFT as well); then ``memory_contention`` on its grid where
       the runs hold one-process and several-process runs;
    2. ``engine_overhead_scale``: the runs are simulated at 1 and 2, each run's duration
       taken as linear in it between and beyond, the best of a fine grid kept (a small
       batch's step is mostly serial work, a large one's mostly kernels, so runs with
       small batches in them pull it and the others hardly move); 1 and 2 twice over;
    3. ``engine_work_scale``: closed form, the geometric mean of the ratios (a stage's work
       scales a prediction by about 1 / scale), at the end of each round of 1-2 and once more
       after them (the driver does not scale);
    4. ``quantized_parallel_efficiency``: where the kept-quantized runs include processes of
       one thread and of several, a grid (``_fit_quantized_efficiency``);
    5. ``quantized_work_scale``: the closed form of 3 on the kept-quantized runs alone.
    Returns the fitted hardware and every run's row predicted with it."""
    dense = [r for r in runs if r["engine"]["quantization"] is None]
    quantized = [r for r in runs if r["engine"]["quantization"] is not None]
    if not dense:
        raise PlanInputError("the calibration runs hold no run with dense weights (--quantization none)")
    # Coordinate descent, two rounds: the oversubscription grid, then the overhead scale,
    # then the work scale.
    fitted = hw
    barrier = any(_threads(r, hw) > 1 and _threads(r, hw) * r["engine"]["pp"] * r["engine"]["tp"] > hw.cores
                  for r in dense)
    contention = len({r["engine"]["pp"] * r["engine"]["tp"] > 1 for r in dense}) == 2
    for _ in range(2):
        fitted = _fit_oversubscription(dense, cfg, fitted, jobs, BARRIER_MODELS if barrier else (
            (fitted.oversubscribed_barrier, fitted.oversubscribed_layer_wait),))
        if contention:
            fitted = _fit_grid(dense, cfg, fitted, jobs, "memory_contention", CONTENTION_GRID)
        fitted = _fit_overhead(dense, cfg, fitted, hw.engine_overhead_scale, jobs)
        # The work scale each round: the layer wait is the scheduler's seconds, not the
        # engine's work, so the next round fits it against the scaled work.
        fitted = _rescale(fitted, "engine_work_scale", predict_runs(dense, cfg, fitted, jobs))
    fitted = _rescale(fitted, "engine_work_scale", predict_runs(dense, cfg, fitted, jobs))
    if quantized:
        if len({_threads(r, fitted) == 1 for r in quantized}) == 2:
            fitted = _fit_quantized_efficiency(quantized, cfg, fitted, jobs)
        fitted = _rescale(fitted, "quantized_work_scale", predict_runs(quantized, cfg, fitted, jobs))
    return fitted, predict_runs(runs, cfg, fitted, jobs)


def _threads(run: dict, hw: Hardware) -> int:
    """Threads of each rank process in the run (the engine's default: cores // processes)."""
    e = run["engine"]
    return e["threads_per_rank"] or max(1, hw.cores // (e["pp"] * e["tp"]))


# quantized_parallel_efficiency candidates
QUANTIZED_EFFICIENCY_GRID = tuple(round(0.3 + 0.05 * i, 2) for i in range(15))   # 0.3 ... 1.0


def _fit_quantized_efficiency(runs: list[dict], cfg, hw: Hardware, jobs: int) -> Hardware:
    """The kept-quantized kernels' parallel efficiency, where the calibration runs keep
    quantized weights both in 1-thread processes and in multi-thread ones: the value on a
    grid that leaves the smallest spread of their ratios (the per-thread cost is then
    ``quantized_work_scale``'s, the closed form)."""
    return _fit_grid(runs, cfg, hw, jobs, "quantized_parallel_efficiency", QUANTIZED_EFFICIENCY_GRID)


def _fit_oversubscription(runs: list[dict], cfg, hw: Hardware, jobs: int,
                          models: tuple[tuple[float, float], ...]) -> Hardware:
    """``oversubscription_efficiency`` and the barrier's model, (``oversubscribed_barrier``,
    ``oversubscribed_layer_wait``), together (both set how fast processes run when threads
    outnumber the cores): the grid pair with the smallest spread, the first pair of the
    grids' order on a tie. Where there is a model to choose, the spread of the runs' TTFT
    (median, predicted / measured) is added: the two models disagree most on prefill, which
    sets when the first tokens come, and one oversubscribed calibration run's throughput
    cannot tell a proportional wait from a fixed one."""
    pairs = [(eta, model) for eta in OVERSUBSCRIPTION_GRID for model in models]
    spreads = {}
    for pair in pairs:
        table = predict_runs(runs, cfg, dataclasses.replace(
            hw, oversubscription_efficiency=pair[0], oversubscribed_barrier=pair[1][0],
            oversubscribed_layer_wait=pair[1][1]), jobs)
        spreads[pair] = _spread([r["ratio"] for r in table])
        if len(models) > 1:
            spreads[pair] += _spread([r["ttft_ratio"] for r in table], empty=0.0)
    eta, (b, wait) = min(pairs, key=spreads.get)
    return dataclasses.replace(hw, oversubscription_efficiency=eta, oversubscribed_barrier=b,
                               oversubscribed_layer_wait=wait)


def _fit_grid(runs: list[dict], cfg, hw: Hardware, jobs: int, field: str, grid: tuple[float, ...]) -> Hardware:
    """``field`` at the grid value with the smallest spread (the first on a tie)."""
    spreads = {v: _spread([r["ratio"] for r in predict_runs(runs, cfg, dataclasses.replace(hw, **{field: v}), jobs)])
               for v in grid}
    return dataclasses.replace(hw, **{field: min(grid, key=spreads.get)})


def _fit_overhead(runs: list[dict], cfg, hw: Hardware, base: float, jobs: int) -> Hardware:
    """``engine_overhead_scale`` = base · the grid value with the smallest spread, each run's
    duration linear in it through its simulations at base and 2·base; base where the runs
    hardly tell (no small batches among them)."""
    one = [r["ratio"] for r in predict_runs(runs, cfg, dataclasses.replace(hw, engine_overhead_scale=base), jobs)]
    two = [r["ratio"] for r in predict_runs(runs, cfg, dataclasses.replace(hw, engine_overhead_scale=2 * base), jobs)]
    spread = {g: _spread([_linear(r1, r2, g) for r1, r2 in zip(one, two)]) for g in OVERHEAD_GRID}
    sigma = min(OVERHEAD_GRID, key=spread.get)
    if spread[sigma] > 0.9 * spread[1.0]:
        sigma = 1.0
    return dataclasses.replace(hw, engine_overhead_scale=base * sigma)


# engine_overhead_scale candidates (times the file's own), and how the fit reads a run's
# ratio at one of them from its ratios at 1 and 2 (duration linear in the scale).
OVERHEAD_GRID = tuple(round(0.05 * i, 2) for i in range(1, 61))      # 0.05 ... 3.0


def _linear(ratio_1: float | None, ratio_2: float | None, g: float) -> float | None:
    if not ratio_1 or not ratio_2:
        return None
    d1, d2 = 1 / ratio_1, 1 / ratio_2              # durations, in units of the measured one
    duration = d1 + (g - 1) * (d2 - d1)
    return 1 / duration if duration > 0 else None


def _spread(ratios: list[float | None], empty: float = math.inf) -> float:
    """Σ (log r − mean log r)² over the predicted runs: what is left once one scale is fitted
    (``empty`` where none is)."""
    logs = [math.log(r) for r in ratios if r]
    if not logs:
        return empty
    mean = sum(logs) / len(logs)
    return sum((x - mean) ** 2 for x in logs)


def _rescale(hw: Hardware, field: str, table: list[dict]) -> Hardware:
    logs = [math.log(r["ratio"]) for r in table if r["ratio"]]
    if not logs:
        return hw
    return dataclasses.replace(hw, **{field: getattr(hw, field) * math.exp(sum(logs) / len(logs))})


def error_band(table: list[dict]) -> dict:
    ratios = [r["ratio"] for r in table if r["ratio"]]
    if not ratios:
        return {"validated_ratio_low": 0.0, "validated_ratio_high": 0.0, "validated_runs": 0}
    return {"validated_ratio_low": round(min(ratios), 4), "validated_ratio_high": round(max(ratios), 4),
            "validated_runs": len(ratios)}


def _oversubscribed(row: dict, hw: Hardware) -> bool:
    return row["pp"] * row["tp"] > hw.cores


def write_hardware(hw: Hardware, path: Path) -> None:
    """The hardware as a YAML file ``--hardware`` reads (plain key: value lines)."""
    lines = [f"# Written by python -m pipeserve.plan.validate --heldout: the calibration fitted on "
             f"measured runs ({', '.join(FITTED)}) and the held-out error band (validated_*)."]
    for key, value in dataclasses.asdict(hw).items():
        lines.append(f"{key}: {str(value).lower() if isinstance(value, bool) else value}")
    path.write_text("\n".join(lines) + "\n")


def heldout(calibration: list[Path], validation: Path, hardware: str, model: str, fitted_out: Path,
            table_out: Path | None, jobs: int, reference: Path | None = None, doc: Path | None = None) -> int:
    _, cfg = load_model(model)
    hw = load_hardware(hardware)
    cal_runs, val_runs = load_runs(calibration), load_runs(validation)
    for name, runs, folder in (("calibration", cal_runs, " + ".join(map(str, calibration))),
                               ("held-out", val_runs, validation)):
        if not runs:
            print(f"error: no random-workload throughput results in {folder} ({name} runs): measure them "
                  "with benchmarks/run_planner_validation.sh (on an idle machine)", file=sys.stderr)
            return 2
    try:
        fitted, cal_table = fit(cal_runs, cfg, hw, jobs)
    except PlanInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    val_table = predict_runs(val_runs, cfg, fitted, jobs)
    fitted = dataclasses.replace(fitted, **error_band(val_table))
    ref_runs = load_runs(reference) if reference is not None and reference.exists() else []
    ref_table = predict_runs(ref_runs, cfg, fitted, jobs) if ref_runs else []
    write_hardware(fitted, fitted_out)
    text = "\n".join([
        f"Calibration: {hardware} + {len(cal_runs)} runs in {' + '.join(map(str, calibration))} -> fitted "
        f"engine_work_scale {fitted.engine_work_scale:.3f}, oversubscription_efficiency "
        f"{fitted.oversubscription_efficiency:.2f}, engine_overhead_scale {fitted.engine_overhead_scale:.2f}, "
        f"quantized_work_scale {fitted.quantized_work_scale:.3f}, quantized_parallel_efficiency "
        f"{fitted.quantized_parallel_efficiency:.2f} (0: the dense layer's), oversubscribed_barrier "
        f"{fitted.oversubscribed_barrier:.2f}, oversubscribed_layer_wait {fitted.oversubscribed_layer_wait * 1e3:g} ms "
        f"(0: the barrier's model), memory_contention {fitted.memory_contention:.3f} "
        f"(written to {fitted_out} with the error band).",
        "", "Calibration runs (fitted):", "", markdown(cal_table),
        "", f"Held-out runs ({validation}):", "", markdown(val_table), "",
        f"Held-out predicted / measured: {fitted.validated_ratio_low:.3f}-{fitted.validated_ratio_high:.3f} "
        f"over {fitted.validated_runs} predicted runs; within +-10 %: "
        f"{sum(r['ratio'] is not None and 0.9 <= r['ratio'] <= 1.1 for r in val_table)}/{len(val_table)}"
        f"; PP above the core count within +-15 %: "
        f"{sum(r['ratio'] is not None and 0.85 <= r['ratio'] <= 1.15 for r in val_table if _oversubscribed(r, hw))}"
        f"/{sum(_oversubscribed(r, hw) for r in val_table)}."]
        + (["", f"For information, the older stored runs in {reference} (an earlier engine; not in the fit "
                "nor in the band) with the fitted file:", "", markdown(ref_table)] if ref_table else []))
    print(text)
    if table_out is not None:
        table_out.write_text(text + "\n")
        print(f"wrote {table_out}")
    if doc is not None:
        try:
            replace_section(doc, text)
        except (OSError, PlanInputError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"updated {doc}")
    return 0


# docs/PLANNER.md's held-out table sits between these lines (`--update-doc`).
DOC_BEGIN = "<!-- validate --heldout: begin -->"
DOC_END = "<!-- validate --heldout: end -->"


def replace_section(doc: Path, text: str) -> None:
    """Put ``text`` between the lines ``DOC_BEGIN`` and ``DOC_END`` in ``doc`` (each alone on
    its line, so prose that names them is left alone), in place of what was there."""
    content = doc.read_text()
    begin, end = content.find(f"\n{DOC_BEGIN}\n"), content.find(f"\n{DOC_END}\n")
    if begin < 0 or end < begin:
        raise PlanInputError(f"{doc} has no {DOC_BEGIN} ... {DOC_END} lines to update between")
    head = content[:begin + len(DOC_BEGIN) + 2]
    doc.write_text(f"{head}\n{text}\n\n{content[end + 1:]}")


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
    lines = ["| run | requests | PP | TP | threads | schedule | partition | weights | measured out tok/s (median) "
             "| predicted | predicted / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        predicted = (f"{r['predicted']:.1f} | {r['ratio']:.3f}" if r["ratio"] is not None
                     else f"not predicted: {r['error']} | -")
        lines.append(f"| {r['label']} | {r['requests']} | {r['pp']} | {r['tp']} | {r['threads'] or 'default'} | "
                     f"{r['schedule']} | {r['partition']} | {r['quantization'] or 'dtype'} | "
                     f"{_measured(r)} | {predicted} |")
    return "\n".join(lines)


def _measured(row: dict) -> str:
    """The median, and with repeats their number and range."""
    samples = row.get("samples") or [row["measured"]]
    if len(samples) == 1:
        return f"{row['measured']:.1f}"
    return f"{row['measured']:.1f} ({len(samples)} runs: {min(samples):.1f}-{max(samples):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeserve.plan.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="?", help="folder of bench throughput JSON files")
    parser.add_argument("--hardware", help="calibrated hardware file (pipeserve plan --calibrate); "
                                           f"--heldout: default {DEFAULT_HARDWARE}")
    parser.add_argument("--model", default="SmolLM2-135M")
    parser.add_argument("--heldout", action="store_true",
                        help="fit the hardware file's run-level fields (engine_work_scale, ...) on the calibration runs, "
                             "predict the held-out runs with them, write the fitted hardware file with the "
                             "held-out error band (which `pipeserve plan --hardware FILE` prints)")
    parser.add_argument("--calibration-runs", type=Path, nargs="+", default=[Path(p) for p in DEFAULT_CALIBRATION],
                        help=f"--heldout: folders or files of runs to fit on (default {' '.join(DEFAULT_CALIBRATION)}, "
                             "measured by benchmarks/run_planner_validation.sh; add benchmarks/results to fit on the "
                             "stored reference runs too)")
    parser.add_argument("--heldout-runs", type=Path, default=Path(DEFAULT_HELDOUT),
                        help=f"--heldout: runs to check (default {DEFAULT_HELDOUT}, measured by "
                             "benchmarks/run_planner_validation.sh)")
    parser.add_argument("--reference-runs", type=Path, default=Path(DEFAULT_REFERENCE),
                        help=f"--heldout: older runs also predicted with the fit, for information (default "
                             f"{DEFAULT_REFERENCE}: the stored reference runs)")
    parser.add_argument("--no-reference", action="store_true", help="--heldout: leave the older runs out")
    parser.add_argument("--fitted-output", type=Path, default=Path(DEFAULT_FITTED),
                        help=f"--heldout: the fitted hardware file (default {DEFAULT_FITTED})")
    parser.add_argument("--table-output", type=Path, default=Path(DEFAULT_TABLE),
                        help=f"--heldout: the tables as Markdown (default {DEFAULT_TABLE})")
    parser.add_argument("--update-doc", type=Path, default=None, metavar="FILE",
                        help=f"--heldout: also put the tables in FILE between the lines {DOC_BEGIN} and "
                             f"{DOC_END} (docs/PLANNER.md)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="simulations run in parallel (default: the CPU count)")
    parser.add_argument("--tp-latency", action="store_true",
                        help="also (or, without a results folder, only) the tensor-parallel rows: one "
                             "request's per-token latency vs the figures recorded in benchmarks/README.md")
    args = parser.parse_args(argv)
    if args.heldout:
        return heldout(args.calibration_runs, args.heldout_runs, args.hardware or DEFAULT_HARDWARE, args.model,
                       args.fitted_output, args.table_output, args.jobs,
                       None if args.no_reference else args.reference_runs, args.update_doc)
    if args.hardware is None:
        parser.error("--hardware FILE is required (or --heldout)")
    if args.tp_latency:
        print(tp_markdown(tp_latency_rows(args.hardware, args.model)))
        if args.results is None:
            return 0
        print()
    if args.results is None:
        parser.error("give a results folder, or --tp-latency")
    table = rows(args.results, args.hardware, args.model, args.jobs)
    if not table:
        print(f"no random-workload throughput results in {args.results}", file=sys.stderr)
        return 2
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
