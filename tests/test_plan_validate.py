"""The planner's validation tool reads bench JSON files and predicts the same runs."""

from __future__ import annotations

import json

from pipeserve.plan.validate import main, rows


def _bench_json(path, pp: int, schedule: str, measured: float, threads=None) -> None:
    engine = {"pipeline_parallel_size": pp, "pp_schedule": schedule, "pp_partition": "uniform",
              "pp_virtual_stages": 2 if schedule == "interleaved" else 1, "pp_micro_batches": None,
              "max_num_seqs": 256, "max_num_batched_tokens": 2048, "dtype": "bfloat16",
              "threads_per_stage": threads}
    doc = {"kind": "throughput", "label": f"pp{pp} {schedule}",
           "dataset": {"name": "random", "num_requests": 16, "input_len": 64, "output_len": 16,
                       "range_ratio": 0.0, "seed": 0},
           "runs": [{"backend": "pipeserve", "engine": engine, "output_tokens_per_s": measured}]}
    path.write_text(json.dumps(doc))


def test_predictions_for_each_default_threaded_run(tmp_path, capsys):
    _bench_json(tmp_path / "a.json", 1, "async", 100.0)
    _bench_json(tmp_path / "b.json", 2, "gpipe", 150.0)
    _bench_json(tmp_path / "c.json", 2, "async", 150.0, threads=1)  # not the planner's assumption
    table = rows(tmp_path, "cpu-local")
    assert [r["file"] for r in table] == ["a.json", "b.json"]
    for r in table:
        assert r["predicted"] > 0 and abs(r["ratio"] - r["predicted"] / r["measured"]) < 1e-9
    assert main([str(tmp_path), "--hardware", "cpu-local"]) == 0
    assert "| pp2 gpipe | 2 | gpipe |" in capsys.readouterr().out


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
