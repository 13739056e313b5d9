"""``python -m pipeserve.plan`` end to end: presets, files, bad input, calibration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeserve.plan.__main__ import main
from pipeserve.plan.hardware import load_hardware
from pipeserve.plan.presets import MODEL_PRESETS, load_model
from pipeserve.plan.predict import predict_throughput
from pipeserve.plan.workload import Workload

SMALL = ["--num-prompts", "20", "--input-len", "128", "--output-len", "16"]


@pytest.mark.parametrize("model", list(MODEL_PRESETS))
@pytest.mark.parametrize("hardware", ["h100-sxm", "L4"])
def test_every_preset_runs(model: str, hardware: str, capsys) -> None:
    pp = "4" if "405" not in model else "8"
    assert main(["--model", model.lower(), "--hardware", hardware, "--pp", pp, *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Recommendation" in out and "[5] T =" in out and "gpipe" in out


def test_a_configuration_that_does_not_fit_is_not_simulated(capsys) -> None:
    """70B on one L4: the stage count it needs, and no simulation of a run that cannot start
    (the simulator took minutes over it)."""
    assert main(["--model", "llama-3.1-70b", "--hardware", "L4", "--quantization", "q4_k_m", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Stages needed" in out and "Not simulated: PP=1 x TP=1 does not fit" in out and "Workload:" not in out


def test_config_json_and_hardware_yaml(tmp_path, capsys) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MODEL_PRESETS["Llama-3.1-8B"]))
    hw = tmp_path / "box.yaml"
    hw.write_text("flops: 100e12\nmemory_bandwidth: 1TB/s\nmemory_size: 48GiB\ngpus_per_node: 4\n"
                  "intra_node: {bandwidth: 64GB/s, latency: 10us}\n"
                  "inter_node: {bandwidth: 100Gb/s, latency: 20us}\n")
    assert main(["--model", str(cfg), "--hardware", str(hw), "--pp", "2", "--tp", "2",
                 "--schedule", "interleaved", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Hardware box" in out and "interleaved" in out
    assert load_hardware(str(hw)).inter_node_bandwidth == pytest.approx(12.5e9)


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt-9"], "unknown model preset"),
    (["--hardware", "tpu-v9"], "unknown hardware preset"),
    (["--model", "/nope/config.json"], "does not exist"),
    (["--hardware", "/nope/hw.yaml"], "does not exist"),
    (["--pp", "31"], "cannot split 30 layers"),
    (["--pp", "0"], "--pp must be >= 1"),
    (["--tp", "10"], "--tp 10: --tensor-parallel-size 10 is too large for this model"),
])
def test_bad_input_is_exit_2_without_traceback(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeserve.plan", *argv, "--no-simulate"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_plot_writes_png(tmp_path) -> None:
    png = tmp_path / "gantt.png"
    assert main(["--pp", "2", "--schedule", "gpipe", "--plot", str(png), *SMALL]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_predict_throughput_one_call() -> None:
    _, model = load_model("SmolLM2-135M")
    hw = load_hardware("cpu-local")
    work = Workload(num_requests=16, input_len=64, output_len=8)
    one = predict_throughput(model, hw, 1, "async", work)
    two = predict_throughput(model, hw, 2, "gpipe", work)
    assert one["output_tokens_per_s"] > 0 and two["partition"] == [15, 15]
    assert len(two["bubble_ratio"]) == 2 and two["fits"]


def test_calibrate_writes_usable_hardware_file(tmp_path) -> None:
    out = tmp_path / "local.yaml"
    assert main(["--calibrate", "--output", str(out)]) == 0
    hw = load_hardware(str(out))
    assert hw.flops_prefill > 1e9 and hw.mem_bandwidth > 1e9
    assert 0 < hw.intra_node_latency < 0.1 and hw.shared_compute
    # The engine's own work outside the layers, timed on its code (the tokenizer is installed here).
    assert 0 < hw.driver_step_overhead + hw.driver_seq_overhead * 64 < 0.1
    assert 0 < hw.stage_step_overhead + hw.stage_seq_overhead * 64 < 0.1
    # The TP collective's fixed cost, measured on the runtime's shared-memory all-reduce.
    from pipeserve.plan.calibrate import CPU_TP_ALLREDUCE_LATENCY
    assert 0 < hw.tp_allreduce_latency < 0.05 and hw.tp_allreduce_latency != CPU_TP_ALLREDUCE_LATENCY


def test_overhead_fit_separates_fixed_and_per_sequence_parts() -> None:
    from pipeserve.plan.calibrate import _fit_two
    a, b = 2e-4, 3e-5
    points = [(100, 800, 100 * a + 800 * b), (40, 900, 40 * a + 900 * b)]
    assert _fit_two(points) == (pytest.approx(a), pytest.approx(b))
    # Noise that makes the fixed part negative: all of it per sequence, none below zero.
    fixed, per_seq = _fit_two([(100, 800, 0.01), (40, 900, 0.0118)])
    assert fixed == 0.0 and per_seq > 0
