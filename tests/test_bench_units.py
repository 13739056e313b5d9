"""Benchmark building blocks without any engine: workloads, arrivals, latency math,
the streaming client, plots and the results table."""

from __future__ import annotations

import asyncio
import json
import math
import struct
import threading
import time

import httpx
import numpy as np
import pytest

from pipeserve.bench.arrivals import arrival_gaps, arrival_times, parse_rate, parse_rates
from pipeserve.bench.client import CompletionRequest, send_completion
from pipeserve.bench.datasets import (BenchRequest, length_range, prefix_requests, random_requests,
                                      sharegpt_requests)
from pipeserve.bench.hf_baseline import batches_of, left_padded
from pipeserve.bench.plots import plot_latency_cdfs, plot_rate_curves
from pipeserve.bench.report import (BEGIN, END, best_engine_flags, main as report_main, prefix_cache_pairs,
                                    render)
from pipeserve.bench.stats import (RequestRecord, capacity_under_slo, latency_metrics, meets_slo, parse_slo,
                                   summarize)


class FakeTokenizer:
    """Whitespace 'tokenizer' over a 100-word vocabulary; ids 0 and 1 are special."""

    all_special_ids = [0, 1]

    def __len__(self) -> int:
        return 100

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [2 + (sum(map(ord, w)) % 98) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


TOK = FakeTokenizer()


def is_png(path) -> bool:
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    width, height = struct.unpack(">II", data[16:24])
    return width > 0 and height > 0


# -- workloads -------------------------------------------------------------
def test_length_range_matches_vllm_window():
    assert length_range(320, 0.6) == (128, 512)
    assert length_range(160, 0.6) == (64, 256)
    assert length_range(10, 0.0) == (10, 10)
    with pytest.raises(ValueError, match="range-ratio"):
        length_range(10, 1.0)


def test_random_requests_lengths_ids_and_determinism():
    reqs = random_requests(TOK, num_prompts=200, input_len=320, output_len=160, range_ratio=0.6, seed=0)
    assert len(reqs) == 200
    assert all(128 <= r.prompt_len <= 512 and 64 <= r.output_len <= 256 for r in reqs)
    ids = np.concatenate([r.prompt_token_ids for r in reqs])
    assert ids.min() >= 2 and ids.max() < 100  # special ids never drawn
    assert np.ptp([r.prompt_len for r in reqs]) > 200  # lengths really spread over the window
    again = random_requests(TOK, num_prompts=200, input_len=320, output_len=160, range_ratio=0.6, seed=0)
    assert again == reqs
    other = random_requests(TOK, num_prompts=200, input_len=320, output_len=160, range_ratio=0.6, seed=1)
    assert other != reqs


def test_prefix_requests_share_prefixes_and_extend_turn_by_turn():
    reqs = prefix_requests(TOK, num_prompts=10, prefix_len=64, num_prefixes=2, num_turns=3,
                           question_len=8, output_len=5, seed=0)
    assert len(reqs) == 10
    assert [r.turn for r in reqs] == sorted(r.turn for r in reqs)
    first_turn = [r for r in reqs if r.turn == 0]
    assert len(first_turn) == 4  # ceil(10 / 3) conversations
    # conversations 0 and 2 share prefix 0; 0 and 1 do not
    assert first_turn[0].prompt_token_ids[:64] == first_turn[2].prompt_token_ids[:64]
    assert first_turn[0].prompt_token_ids[:64] != first_turn[1].prompt_token_ids[:64]
    second = [r for r in reqs if r.turn == 1]
    for a, b in zip(first_turn, second):
        assert b.prompt_token_ids[:a.prompt_len] == a.prompt_token_ids  # turn 1 resends turn 0
        assert b.prompt_len == a.prompt_len + 5 + 8
    assert len([r for r in reqs if r.turn == 2]) == 2  # the surplus came off the last turn


def test_sharegpt_requests(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "x y z w v u"}]},
            {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a b c d"}]},
            {"conversations": [{"from": "human", "value": "one two three four"}, {"from": "gpt", "value": "q r s t"}]},
            {"id": "no conversation"}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, TOK, num_prompts=2, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(4, 4), (5, 6)]
    assert all(r.prompt is not None for r in reqs)
    fixed = sharegpt_requests(path, TOK, num_prompts=2, output_len=7)
    assert {r.output_len for r in fixed} == {7}
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_requests(path, TOK, num_prompts=3)
    with pytest.raises(FileNotFoundError, match="dataset-path"):
        sharegpt_requests(tmp_path / "missing.json", TOK, num_prompts=1)


# -- arrivals --------------------------------------------------------------
def test_poisson_and_gamma_arrivals_have_the_asked_rate():
    gaps = np.array(arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    bursty = np.array(arrival_gaps(20000, rate=4.0, burstiness=0.25, seed=0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    times = arrival_times(5, 2.0, seed=3)
    assert times == sorted(times)


def test_rate_parsing():
    assert parse_rate("inf") == math.inf
    assert parse_rates("1, 2,inf") == [1.0, 2.0, math.inf]
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ValueError, match="request rate"):
            parse_rate(bad)


# -- latency math ----------------------------------------------------------
def test_summarize_percentiles_in_ms():
    s = summarize([i / 1000 for i in range(1, 101)])
    assert s["n"] == 100 and s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert summarize([])["n"] == 0


def test_latency_metrics_throughput_and_goodput():
    recs = [RequestRecord(prompt_len=10, output_len=11, ttft=0.1, e2el=1.1, itl=[0.1] * 10),
            RequestRecord(prompt_len=20, output_len=11, ttft=0.6, e2el=1.6),
            RequestRecord(prompt_len=30, output_len=3, ttft=0.1, e2el=0.9),   # tpot 0.4
            RequestRecord(prompt_len=40, success=False, error="boom")]
    assert recs[0].tpot == pytest.approx(0.1)
    slo = parse_slo("ttft=500,tpot=200")
    assert slo == {"ttft": 0.5, "tpot": 0.2}
    assert [meets_slo(r, slo) for r in recs] == [True, False, False, False]
    m = latency_metrics(recs, duration_s=2.0, slo=slo)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["requests_per_s"] == 1.5
    assert m["input_tokens_per_s"] == 30.0 and m["output_tokens_per_s"] == 12.5
    assert m["good_requests"] == 1 and m["goodput_requests_per_s"] == 0.5
    assert m["slo_attainment"] == 0.25
    assert m["itl_ms"]["n"] == 10 and m["itl_ms"]["mean"] == pytest.approx(100.0)
    assert m["tpot_ms"]["max"] == pytest.approx(400.0)


def test_slo_parsing_rejects_bad_input():
    for bad in ("ttft", "latency=3", "ttft=abc", "tpot=0"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_capacity_is_the_last_rate_before_the_first_miss():
    sweep = [{"request_rate": r, "slo_attainment": a} for r, a in ((1, 1.0), (4, 0.5), (2, 0.95), (8, 0.99))]
    assert capacity_under_slo(sweep, 0.9) == 2
    assert capacity_under_slo(sweep[1:2], 0.9) is None


# -- the streaming client against a local SSE server ------------------------
async def _sse_app(scope, receive, send):
    """Streams 5 chunks 20 ms apart, then usage (except under /nousage, as servers without
    usage reporting do); under /fail answers HTTP 400."""
    if scope["type"] != "http":
        return
    await receive()
    if scope["path"].endswith("/fail/v1/completions"):
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": "bad model"}'})
        return
    usage = not scope["path"].startswith("/nousage/")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(5):
        await asyncio.sleep(0.02)
        chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    "more_body": True})
    if usage:
        tail = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(tail)}\n\n".encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.fixture(scope="module")
def sse_url():
    """A real socket: httpx's in-process ASGI transport buffers whole responses, hiding the timing."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(_sse_app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not (server.started and server.servers) and time.time() < deadline:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


def _send(url: str) -> RequestRecord:
    async def go():
        async with httpx.AsyncClient() as client:
            return await send_completion(client, url, CompletionRequest("m", "hello", 1, 5))
    return asyncio.run(go())


@pytest.mark.parametrize("usage", [True, False])
def test_client_times_every_streamed_token(sse_url, usage):
    # Without usage in the stream, tokens are counted chunk by chunk.
    rec = _send(sse_url if usage else sse_url + "/nousage")
    assert rec.success and rec.output_len == 5
    assert len(rec.itl) == 4 and all(g >= 0.015 for g in rec.itl)
    assert rec.ttft >= 0.015 and rec.e2el == pytest.approx(rec.ttft + sum(rec.itl), abs=1e-6)


def test_client_records_http_errors(sse_url):
    rec = _send(sse_url + "/fail")
    assert not rec.success and "HTTP 400" in rec.error and "bad model" in rec.error


# -- HF baseline batching (no model) --------------------------------------
def test_hf_batches_never_mix_turns_and_pad_left():
    reqs = [BenchRequest([5, 6, 7], 2, turn=0), BenchRequest([8], 2, turn=0), BenchRequest([9, 9], 2, turn=0),
            BenchRequest([4, 4], 2, turn=1)]
    assert [len(b) for b in batches_of(reqs, 2)] == [2, 1, 1]
    ids, mask = left_padded(reqs[:2], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


# -- plots and report --------------------------------------------------------
def test_plots_are_valid_pngs(tmp_path):
    lat = {"a": {"ttft": [1.0, 2.0, 3.0], "e2el": [5.0, 6.0]}, "b": {"ttft": [2.0], "tpot": [0.5, 0.7]}}
    points = [{"request_rate": r, "output_tokens_per_s": 10.0 * i, "tpot_ms": {"p99": 5.0 + i},
               "slo_ms": {"tpot": 7.0}} for i, r in enumerate((1.0, 2.0, "inf"))]
    made = [plot_latency_cdfs(lat, tmp_path / "cdf.png"), plot_rate_curves(points, tmp_path / "rate.png")]
    assert all(p is not None and is_png(p) for p in made)
    assert plot_latency_cdfs({"a": {}}, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def _throughput_result(dataset: str, caching: bool, ttft_ms: float, baseline: float | None = None) -> dict:
    engine = {"pipeline_parallel_size": 2, "pp_schedule": "async", "pp_partition": "uniform",
              "enable_prefix_caching": caching}
    run = {"backend": "pipeserve", "engine": engine, "requests_per_s": 2.0, "input_tokens_per_s": 600.0,
           "output_tokens_per_s": 300.0, "ttft_ms": {"mean": ttft_ms},
           "stages": [{"stage": 0, "busy_ratio": 0.9, "bubble_ratio": 0.1}],
           "prefix_cache": {"hit_rate": 0.25 if caching else 0.0}}
    runs = [run]
    result = {"kind": "throughput", "label": None, "command": f"pipeserve bench throughput --dataset {dataset}",
              "dataset": {"name": dataset, "num_requests": 8, "min_input_len": 1, "max_input_len": 9,
                          "min_output_len": 2, "max_output_len": 3}, "runs": runs, "baseline": None}
    if baseline:
        runs.append({"backend": "hf", "batch_size": 8, "dtype": "bfloat16", "requests_per_s": 1.0,
                     "input_tokens_per_s": 1.0,
                     "output_tokens_per_s": 300.0 / baseline, "ttft_ms": {"mean": 1.0}})
        result["baseline"] = {"hf_best_batch_size": 8, "hf_output_tokens_per_s": 300.0 / baseline,
                              "pipeserve_output_tokens_per_s": 300.0, "speedup_output_tokens_per_s": baseline}
    return result


def test_report_renders_rows_targets_and_commands(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, data in {"prefix_on": _throughput_result("prefix", True, 100.0),
                       "prefix_off": _throughput_result("prefix", False, 250.0),
                       "random_vs_hf": _throughput_result("random", True, 50.0, baseline=3.5)}.items():
        (results / f"{name}.json").write_text(json.dumps(data))
    (results / "notes.json").write_text(json.dumps({"not": "a result"}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Benchmarks\n\nintro\n\n{BEGIN}\nold\n{END}\n\ntrailer\n")
    assert report_main([str(results)]) == 0
    text = readme.read_text()
    assert text.startswith("# Benchmarks\n\nintro") and text.rstrip().endswith("trailer")
    assert "old" not in text
    assert text.count("| prefix_o") == 2 and "transformers b=8 bfloat16" in text
    assert "**3.50×** (meets the ≥ 3× target)" in text
    assert "**2.50×** (meets the ≥ 2× target)" in text
    assert "pipeserve bench throughput --dataset random" in text
    assert "0.90/0.10" in text and "| 25% |" in text


def test_report_pairs_only_runs_that_differ_in_caching():
    on = _throughput_result("prefix", True, 100.0)
    other = _throughput_result("prefix", False, 300.0)
    other["runs"][0]["engine"]["pipeline_parallel_size"] = 3
    assert prefix_cache_pairs([("on", on), ("other", other)]) == []
    assert render([]) == "No result files in benchmarks/results yet.\n"


def test_best_engine_flags_pick_the_fastest_random_run():
    slow = _throughput_result("random", True, 50.0)
    fast = _throughput_result("random", True, 50.0)
    fast["runs"][0]["output_tokens_per_s"] = 900.0
    fast["runs"][0]["engine"].update(pp_schedule="interleaved", pp_virtual_stages=2, pp_partition="auto")
    prefix = _throughput_result("prefix", True, 10.0)
    prefix["runs"][0]["output_tokens_per_s"] = 5000.0  # another workload: never the choice
    flags = best_engine_flags([("slow", slow), ("fast", fast), ("prefix", prefix)])
    assert flags == "-pp 2 --pp-schedule interleaved --pp-partition auto --pp-virtual-stages 2"
    with pytest.raises(ValueError, match="no pipeserve throughput result"):
        best_engine_flags([("prefix", prefix)])


def _max_overlap(records: list[RequestRecord]) -> int:
    """Most requests in flight at once, from their send times and latencies."""
    edges = sorted([(r.start_time, 1) for r in records] + [(r.start_time + r.e2el, -1) for r in records],
                   key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def test_load_generator_honours_max_concurrency_and_slo(sse_url):
    from pipeserve.bench.serve import LoadOptions, benchmark_rate
    requests = [CompletionRequest("m", "hello", 1, 5)] * 6
    # each request streams for >= 100 ms: all six overlap unless the gate holds them back
    narrow, narrow_records = benchmark_rate(requests, math.inf,
                                            LoadOptions(sse_url, max_concurrency=2, progress=False),
                                            parse_slo("ttft=10000"))
    wide, wide_records = benchmark_rate(requests, math.inf, LoadOptions(sse_url, progress=False), {})
    assert narrow["completed"] == wide["completed"] == 6
    assert _max_overlap(narrow_records) <= 2 < _max_overlap(wide_records)
    assert narrow["duration_s"] >= 0.28  # three rounds of two
    assert narrow["request_rate"] == "inf" and narrow["slo_attainment"] == 1.0
    assert "goodput_requests_per_s" not in wide


def test_load_generator_spaces_requests_at_the_rate(sse_url):
    from pipeserve.bench.serve import LoadOptions, benchmark_rate
    requests = [CompletionRequest("m", "hello", 1, 5)] * 8
    _, records = benchmark_rate(requests, 20.0, LoadOptions(sse_url, seed=1, progress=False), {})
    expected = arrival_times(8, 20.0, seed=1)
    for record, at in zip(records, expected):
        assert record.start_time == pytest.approx(at, abs=0.1)  # slack for a busy machine


def test_gantt_window_and_stage_ratios_cover_only_the_timed_run(tmp_path):
    from pipeserve.bench.offline import gantt_window, stage_ratios, write_gantt
    from pipeserve.metrics.timeline import Interval, Timeline
    assert gantt_window((10.0, 20.0), 2.0) == (14.0, 16.0)
    assert gantt_window((10.0, 11.0), 5.0) == (10.0, 11.0)
    timeline = Timeline(num_stages=2)
    # warm-up at t = 0..1 (stage 0 busy all of it), timed run at t = 10..14
    timeline.step_submitted(0, 0.0)
    timeline.add_intervals([Interval(0, "compute", 0.0, 1.0, 0), Interval(1, "compute", 0.5, 1.0, 0)])
    timeline.step_finished(0, 1.0)
    for step, t in enumerate((10.0, 11.0, 12.0, 13.0), start=1):
        timeline.step_submitted(step, t)
        timeline.add_intervals([Interval(0, "compute", t, t + 0.5, step), Interval(1, "compute", t + 0.5, t + 1, step)])
        timeline.step_finished(step, t + 1.0)
    rows = stage_ratios(timeline, (10.0, 14.0))
    assert [r["stage"] for r in rows] == [0, 1]
    assert rows[0]["busy_ratio"] == pytest.approx(0.5) and rows[0]["bubble_ratio"] == pytest.approx(0.5)
    assert rows[1]["steps"] == 4  # the warm-up step is outside the window
    # Steady state = t 10.4 .. 13.6: stage 0 computes 0.1 + 0.5 + 0.5 + 0.5 of its 3.2 s.
    assert rows[0]["steady_busy_ratio"] == pytest.approx(1.6 / 3.2)
    assert rows[0]["steady_bubble_ratio"] == pytest.approx(1.6 / 3.2)
    assert rows[1]["steady_busy_ratio"] == pytest.approx((0.5 + 0.5 + 0.5 + 0.1) / 3.2)
    assert stage_ratios(None, (0.0, 1.0)) == []
    png = write_gantt(tmp_path / "g.png", timeline, (10.0, 14.0), 2.0, "test")
    assert png is not None and is_png(png)
    assert write_gantt(tmp_path / "none.png", timeline, (100.0, 101.0), 1.0, "empty") is None


def test_summary_says_when_the_timed_run_ran_out_of_kv_blocks():
    from pipeserve.bench.offline import preemption_delta
    from pipeserve.bench.run_throughput import format_summary
    before = {"num_preemptions_recompute": 2, "num_preemptions_swap": 0, "num_preempted_tokens": 300,
              "num_blocks": 64}
    after = {**before, "num_preemptions_recompute": 5, "num_preemptions_swap": 1, "num_preempted_tokens": 720}
    delta = preemption_delta(before, after)   # the warm-up's two are not the timed run's
    assert delta == {"recompute": 3, "swap": 1, "dropped_tokens": 420, "kv_blocks": 64}
    assert preemption_delta({}, after) == {}
    run = {"backend": "pipeserve", "requests_per_s": 1.0, "input_tokens_per_s": 2.0, "output_tokens_per_s": 3.0,
           "ttft_ms": {"mean": 4.0}, "tpot_ms": {"mean": 5.0}, "engine": {"block_size": 16}, "preemptions": delta}
    text = format_summary({"runs": [run]})
    assert ("KV cache of 64 blocks (1024 tokens) ran out: 3 preemptions by recompute (KV of 420 tokens "
            "dropped), 1 by swap; a larger --kv-cache-memory avoids them") in text
    swaps = format_summary({"runs": [{**run, "preemptions": {**delta, "recompute": 0, "dropped_tokens": 0}}]})
    assert "ran out: 1 by swap; a larger --kv-cache-memory avoids them" in swaps
    quiet = format_summary({"runs": [{**run, "preemptions": {**delta, "recompute": 0, "swap": 0}}]})
    assert "ran out" not in quiet


@pytest.mark.parametrize("native", [False, True])
def test_transformers_baseline_takes_the_engines_auto_dtype(native, tmp_path, monkeypatch):
    """``--dtype auto`` gives transformers the engine's dtype: float32 on a CPU without native
    bfloat16 (the engine's auto there), bfloat16 with it; an explicit dtype stays as given."""
    import torch

    import pipeserve.config as config
    from pipeserve.bench.hf_source import load_hf_model
    from tests.checkpoints import build_checkpoint
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native)
    directory = build_checkpoint("llama_tied_gqa", tmp_path / "ckpt")
    expected = torch.bfloat16 if native else torch.float32
    assert next(load_hf_model(str(directory), "auto").parameters()).dtype == expected
    assert next(load_hf_model(str(directory), "bfloat16").parameters()).dtype == torch.bfloat16
