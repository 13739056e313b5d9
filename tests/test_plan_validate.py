"""The planner's validation tool reads bench JSON files and predicts the same runs."""

from __future__ import annotations

import json

import dataclasses

import pytest

from pipeserve.plan.hardware import load_hardware
from pipeserve.plan.presets import load_model
from pipeserve.plan.validate import load_runs, main, predict_runs, rows


def _bench_json(path, pp: int, schedule: str, measured: float, threads=None, quantization=None,
                requests: int = 16) -> None:
    engine = {"model": "smollm2-135m-instruct", "quantization": quantization,"pipeline_parallel_size": pp, "pp_schedule": schedule, "pp_partition": "uniform",
              "pp_virtual_stages": 2 if schedule == "interleaved" else 1, "pp_micro_batches": None,
              "max_num_seqs": 256, "max_num_batched_tokens": 2048, "dtype": "bfloat16",
              "threads_per_stage": threads}
    doc = {"kind": "throughput", "label": f"pp{pp} {schedule}",
           "dataset": {"name": "random", "num_requests": requests, "input_len": 64, "output_len": 16,
                       "range_ratio": 0.0, "seed": 0},
           "runs": [{"backend": "pipeserve", "engine": engine, "output_tokens_per_s": measured,
                     "ttft_ms": {"p50": 1000.0}}]}
    path.write_text(json.dumps(doc))


def test_predictions_for_each_run(tmp_path, capsys):
    _bench_json(tmp_path / "a.json", 1, "async", 100.0)
    _bench_json(tmp_path / "b.json", 2, "gpipe", 150.0)
    _bench_json(tmp_path / "c.json", 2, "async", 150.0, threads=2)  # 4 threads on 2 cores
    table = rows(tmp_path, "cpu-local")
    assert [r["file"] for r in table] == ["a.json", "b.json", "c.json"]
    for r in table:
        assert r["predicted"] > 0 and abs(r["ratio"] - r["predicted"] / r["measured"]) < 1e-9
    assert main([str(tmp_path), "--hardware", "cpu-local"]) == 0
    assert "| pp2 gpipe | 16 | 2 | 1 | default | gpipe |" in capsys.readouterr().out


def test_empty_folder_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path), "--hardware", "cpu-local"]) == 2
    assert "no random-workload" in capsys.readouterr().err


def test_the_measured_kv_capacity_limits_the_simulated_run(tmp_path):
    _bench_json(tmp_path / "a.json", 1, "async", 100.0)
    roomy = rows(tmp_path, "cpu-local")[0]["predicted"]
    doc = json.loads((tmp_path / "a.json").read_text())
    doc["runs"][0]["engine"]["block_size"] = 16
    doc["runs"][0]["scheduler"] = {"num_blocks": 5}      # 80 tokens: one request at a time
    (tmp_path / "a.json").write_text(json.dumps(doc))
    tight = rows(tmp_path, "cpu-local")[0]["predicted"]
    assert tight < 0.5 * roomy


def test_a_run_with_a_host_pool_is_simulated_swapping(tmp_path):
    # The engine allocates a host pool only where its preemptions swap (auto on one CPU host):
    # the recorded pool is the simulated one; a run without it (recompute) keeps none.
    _bench_json(tmp_path / "a.json", 1, "async", 100.0, requests=4)
    doc = json.loads((tmp_path / "a.json").read_text())
    doc["runs"][0]["engine"]["block_size"] = 16
    doc["runs"][0]["scheduler"] = {"num_blocks": 12}     # 192 tokens: 4 x 80 outgrow it
    (tmp_path / "a.json").write_text(json.dumps(doc))
    assert load_runs(tmp_path)[0]["engine"]["swap_capacity_tokens"] == 0.0
    recompute = rows(tmp_path, "cpu-local")[0]
    doc["runs"][0]["scheduler"]["num_host_blocks"] = 12
    (tmp_path / "a.json").write_text(json.dumps(doc))
    assert load_runs(tmp_path)[0]["engine"]["swap_capacity_tokens"] == 12 * 16
    swap = rows(tmp_path, "cpu-local")[0]
    assert recompute["preemptions"] > 0 and swap["preemptions"] > 0
    assert swap["predicted"] >= recompute["predicted"]   # nothing computed twice


@pytest.mark.parametrize("barrier,layer_wait", [(1.0, 0.0), (0.25, 0.0), (1.0, 0.002)])
def test_heldout_fits_on_one_set_and_reports_the_other(tmp_path, capsys, barrier, layer_wait):
    # "Measured" = the planner's own prediction on hardware whose stages work 1.25x (1.3x
    # more with kept-quantized weights), whose serial work is 1.5x, whose oversubscribed
    # cores deliver 0.8 and whose oversubscribed 2-thread stages wait at their barriers
    # (1) or mostly not (0.25), each layer at most 2 ms (or unbounded): the fit must find them
    # from the calibration runs (one request alone: mostly serial work; 64: mostly kernels;
    # 2 stages x 2 threads on 2 cores, whose prefill layers are long and decode layers short;
    # their throughput and, to choose the barrier's model, their TTFT), then predict the
    # held-out runs (other PP, schedule, threads, sizes).
    cal, cal_q, val = tmp_path / "cal", tmp_path / "cal_q", tmp_path / "val"
    for folder, runs in ((cal, [(1, "async", None, None, 1), (1, "async", None, None, 64),
                                (2, "async", None, None, 16), (3, "async", None, None, 16),
                                (2, "async", 2, None, 8)]),
                         (cal_q, [(1, "async", None, "auto", 16)]),
                         (val, [(2, "gpipe", None, None, 16), (2, "async", 2, None, 32), (2, "async", None, "auto", 8)])):
        folder.mkdir()
        for pp, schedule, threads, quant, n in runs:
            _bench_json(folder / f"pp{pp}{schedule}{threads}{quant}{n}.json", pp, schedule, 1.0, threads, quant, n)
    _, cfg = load_model("SmolLM2-135M")
    truth = dataclasses.replace(load_hardware("cpu-local"), engine_work_scale=1.25, oversubscription_efficiency=0.8,
                                quantized_work_scale=1.3, engine_overhead_scale=1.5, oversubscribed_barrier=barrier,
                                oversubscribed_layer_wait=layer_wait)
    for folder in (cal, cal_q, val):
        for row in predict_runs(load_runs(folder), cfg, truth):
            path = folder / row["file"]
            doc = json.loads(path.read_text())
            doc["runs"][0]["output_tokens_per_s"] = row["predicted"]
            doc["runs"][0]["ttft_ms"]["p50"] = 1000.0 * row["ttft_ratio"]   # the predicted TTFT (1 s measured)
            path.write_text(json.dumps(doc))
    fitted_file = tmp_path / "fitted.yaml"
    assert main(["--heldout", "--hardware", "cpu-local", "--calibration-runs", str(cal), str(cal_q), "--heldout-runs",
                 str(val), "--fitted-output", str(fitted_file), "--table-output", str(tmp_path / "t.md"),
                 "--jobs", "1", "--no-reference"]) == 0
    fitted = load_hardware(str(fitted_file))
    assert fitted.oversubscription_efficiency == pytest.approx(0.8)
    assert fitted.oversubscribed_barrier == barrier
    assert fitted.oversubscribed_layer_wait == layer_wait
    assert fitted.engine_overhead_scale == pytest.approx(1.5, abs=0.1)
    assert fitted.engine_work_scale == pytest.approx(1.25, rel=0.03)
    assert fitted.quantized_work_scale == pytest.approx(1.3, rel=0.03)
    assert fitted.validated_runs == 3
    assert 0.98 <= fitted.validated_ratio_low <= fitted.validated_ratio_high <= 1.02
    assert "Held-out predicted / measured" in (tmp_path / "t.md").read_text()


def test_heldout_without_runs_says_how_to_measure_them(tmp_path, capsys):
    _bench_json(tmp_path / "a.json", 1, "async", 100.0)
    empty = tmp_path / "none"
    empty.mkdir()
    assert main(["--heldout", "--hardware", "cpu-local", "--calibration-runs", str(tmp_path),
                 "--heldout-runs", str(empty)]) == 2
    assert "run_planner_validation.sh" in capsys.readouterr().err


def test_plan_prints_the_validated_error_band_next_to_each_prediction(tmp_path, capsys):
    from pipeserve.plan.__main__ import main as plan
    from pipeserve.plan.validate import write_hardware
    small = ["--model", "SmolLM2-135M", "--pp", "2", "--num-prompts", "8", "--input-len", "32", "--output-len", "8"]
    assert plan([*small, "--hardware", "cpu-local"]) == 0
    assert "expected error: not validated for this hardware" in capsys.readouterr().out
    path = tmp_path / "validated.yaml"
    write_hardware(dataclasses.replace(load_hardware("cpu-local"), validated_ratio_low=0.95,
                                       validated_ratio_high=1.08, validated_runs=9), path)
    assert plan([*small, "--hardware", str(path)]) == 0
    out = capsys.readouterr().out
    assert "within -7% to +5% of the prediction on 9 held-out runs" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("async"))
    tokens = float(row.split()[1].replace(",", ""))
    low, high = row.split()[2].split("-")
    assert float(low.replace(",", "")) == pytest.approx(tokens / 1.08, abs=1) and \
        float(high.replace(",", "")) == pytest.approx(tokens / 0.95, abs=1)


def test_update_doc_replaces_only_the_section_between_its_lines(tmp_path):
    from pipeserve.plan.presets import PlanInputError
    from pipeserve.plan.validate import DOC_BEGIN, DOC_END, replace_section
    doc = tmp_path / "PLANNER.md"
    prose = f"The table goes between `{DOC_BEGIN}` and `{DOC_END}`.\n"
    doc.write_text(f"# Title\n{prose}\n{DOC_BEGIN}\nold table\n{DOC_END}\n\nAfter.\n")
    replace_section(doc, "| new | table |")
    replace_section(doc, "| newer | table |")          # idempotent: the lines stay
    assert doc.read_text() == f"# Title\n{prose}\n{DOC_BEGIN}\n\n| newer | table |\n\n{DOC_END}\n\nAfter.\n"
    (tmp_path / "none.md").write_text(prose)
    with pytest.raises(PlanInputError, match="lines to update between"):
        replace_section(tmp_path / "none.md", "x")


def test_repeats_of_a_configuration_are_one_row_at_their_median(tmp_path, capsys):
    # run_planner_validation.sh's repeats: on a shared machine one run can be far from the next
    for name, measured in (("a.json", 100.0), ("a.r2.json", 160.0), ("a.r3.json", 90.0)):
        _bench_json(tmp_path / name, 1, "async", measured)
    _bench_json(tmp_path / "b.json", 2, "gpipe", 150.0)
    table = rows(tmp_path, "cpu-local")
    assert [(r["file"], r["measured"], sorted(r["samples"])) for r in table] == [
        ("a.json", 100.0, [90.0, 100.0, 160.0]), ("b.json", 150.0, [150.0])]
    assert abs(table[0]["ratio"] - table[0]["predicted"] / 100.0) < 1e-9
    assert main([str(tmp_path), "--hardware", "cpu-local"]) == 0
    out = capsys.readouterr().out
    assert "| 100.0 (3 runs: 90.0-160.0) |" in out and "| 150.0 |" in out
