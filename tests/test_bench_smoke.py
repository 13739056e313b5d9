"""Each bench mode end to end for a few seconds on a tiny random model: the real
engine for ``bench throughput`` (and transformers for its baseline), a real
``pipeserve serve`` subprocess for ``bench serve``."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pipeserve.entrypoints.cli import main
from tests.checkpoints import build_checkpoint

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_checkpoint("llama_tied_gqa", tmp_path_factory.mktemp("tiny")))


def assert_png(path: str | Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


def test_throughput_both_backends(tiny_model, tmp_path):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny_model, *ENGINE, "--dataset", "random",
               "--num-prompts", "6", "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5",
               "--backend", "both", "--hf-batch-size", "2,4", "--num-warmup", "1", "--no-progress",
               "--output", str(out), "--plot", str(tmp_path / "plots"), "--label", "smoke"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "throughput" and result["label"] == "smoke"
    assert result["dataset"]["num_requests"] == 6 and 12 <= result["dataset"]["min_input_len"]
    ours, *hf = result["runs"]
    assert ours["backend"] == "pipeserve" and [r["batch_size"] for r in hf] == [2, 4]
    assert {r["dtype"] for r in hf} == {"float32"}  # the engine's dtype unless --hf-dtype says otherwise
    expected_out = result["dataset"]["total_output_tokens"]
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == expected_out  # ignore_eos: exactly the asked lengths
        assert run["requests_per_s"] > 0 and run["input_tokens_per_s"] > run["requests_per_s"]
        assert 0 < run["ttft_ms"]["mean"] <= run["e2el_ms"]["mean"]
    assert ours["engine"]["pipeline_parallel_size"] == 1
    assert ours["prefix_cache"]["query_tokens"] >= result["dataset"]["total_input_tokens"]
    assert result["baseline"]["speedup_output_tokens_per_s"] > 0
    assert result["baseline"]["hf_best_batch_size"] in (2, 4)
    assert [Path(p).name for p in result["plots"]][0] == "latency_cdf.png"
    for path in result["plots"]:
        assert_png(path)


def test_throughput_pipeline_prefix_workload(tiny_model, tmp_path):
    out = tmp_path / "pp.json"
    rc = main(["bench", "throughput", "--model", tiny_model, *ENGINE, "-pp", "2", "--threads-per-stage", "1",
               "--dataset", "prefix", "--num-prompts", "6", "--prefix-len", "48", "--num-prefixes", "1",
               "--num-turns", "2", "--question-len", "8", "--output-len", "4", "--no-progress",
               "--output", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert result["dataset"]["num_turns"] == 2 and run["completed"] == 6
    assert run["prefix_cache"]["hit_rate"] > 0.3  # turn 2 resends turn 1; all share one prefix
    assert [s["stage"] for s in run["stages"]] == [0, 1]
    for stage in run["stages"]:
        assert 0.0 <= stage["busy_ratio"] <= 1.0 and 0.0 <= stage["bubble_ratio"] <= 1.0
    names = sorted(Path(p).name for p in result["plots"])
    assert names == ["latency_cdf.png", "pipeline_gantt.png"]
    for path in result["plots"]:
        assert_png(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pipeserve.entrypoints.cli", "serve", "--model", tiny_model,
                             "--port", str(port), "--served-model-name", "tiny", *ENGINE],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, timeout_s=60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pipeserve serve exited early: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"pipeserve serve did not answer on {url} within {timeout_s} s")


def test_serve_sweep_against_pipeserve_server(tiny_model, server_url, tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--dataset", "random",
               "--num-prompts", "6", "--input-len", "16", "--output-len", "6", "--prompt-format", "ids",
               "--sweep-rates", "20,inf", "--max-concurrency", "4", "--slo", "ttft=20000,tpot=5000",
               "--no-progress", "--output", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "serve" and result["served_model"] == "tiny"
    assert [p["request_rate"] for p in result["sweep"]] == [20.0, "inf"]
    for point in result["sweep"]:
        assert point["completed"] == 6, point["errors"]
        assert point["total_output_tokens"] == result["dataset"]["total_output_tokens"]
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert {"mean", "p50", "p90", "p99"} <= point[metric].keys() and point[metric]["n"] > 0
        assert point["slo_attainment"] == 1.0 and point["goodput_requests_per_s"] > 0
    assert result["capacity_requests_per_s"] == "inf"
    assert sorted(Path(p).name for p in result["plots"]) == ["latency_cdf.png", "rate_curves.png"]
    for path in result["plots"]:
        assert_png(path)


def test_serve_single_rate_text_prompts(tiny_model, server_url, tmp_path):
    out = tmp_path / "one.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--dataset", "prefix",
               "--num-prompts", "4", "--prefix-len", "24", "--num-turns", "2", "--question-len", "4",
               "--output-len", "4", "--request-rate", "50", "--burstiness", "0.5", "--no-progress",
               "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["request_rate"] == 50.0 and result["completed"] == 4
    assert len(result["requests"]) == 4 and all(r["success"] for r in result["requests"])
