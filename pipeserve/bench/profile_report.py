"""``bench throughput --profile``: the breakdown of the timed run, against its roofline.

The engine's figures are cumulative, so the bench snapshots them after the
warm-up and after the run and reports the difference (``metrics.profile``
computes the classes; the stage timelines add the communication: receiving
a step's frame, the sender thread's time, idle waiting). The roofline's
peaks come from a hardware file (``--roofline-hardware``, as ``pipeserve plan
--calibrate`` writes it) or, without one, from a short measurement here: the
best of a few GEMMs in the run's dtype on all cores and a large copy.
"""

from __future__ import annotations

import os
import time

from pipeserve.engine.driver_profile import driver_breakdown
from pipeserve.metrics.profile import Roofline, breakdown, format_breakdown, subtract

# The measured GEMM: [rows, k] x [k, n], large enough to reach the peak, short enough to be quick.
GEMM_SHAPE = (512, 2048, 2048)


def measure_roofline(dtype_name: str = "bfloat16", repeats: int = 8) -> Roofline:
    """GEMM peak in the activations' dtype and copy bandwidth of this machine, on all its
    cores (best of ``repeats``). The dtype matters: a CPU without native bfloat16 runs a
    bfloat16 GEMM at a small fraction of its float32 rate."""
    import torch

    from pipeserve.plan.calibrate import measure_bandwidth
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        m, k, n = GEMM_SHAPE
        dtype = getattr(torch, dtype_name)
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        torch.nn.functional.linear(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best = min(best, time.perf_counter() - start)
        bandwidth = measure_bandwidth(torch)
    finally:
        torch.set_num_threads(threads)
    return Roofline(2 * m * n * k / best, bandwidth, cores,
                    f"measured at start: torch {dtype_name} GEMM {m}x{k}x{n}, 256 MiB copy")


def roofline_from_file(path: str) -> Roofline:
    """A hardware file's peaks: ``gemm_flops`` when it has one, else the larger of its
    calibrated layer rates (``flops_prefill``, ``flops_decode``), which understate a pure GEMM's."""
    from pipeserve.plan.hardware import load_hardware
    hw = load_hardware(path)
    peak = getattr(hw, "gemm_flops", None) or max(hw.flops_prefill, hw.flops_decode)
    return Roofline(peak, hw.mem_bandwidth, hw.cores, f"hardware file {path}")


def profile_snapshot(llm) -> dict | None:
    return llm.engine.profile()


def profile_result(before: dict, after: dict, stage_rows: list[dict], roofline: Roofline | None,
                   pipeline: bool) -> dict:
    """The JSON ``profile`` section of a run: per stage classes (+ communication), the driver."""
    old = {p.stage: p for p in before["stages"]}
    stages = []
    for prof in after["stages"]:
        st = breakdown(subtract(prof, old.get(prof.stage)), roofline)
        timeline = next((r for r in stage_rows if r.get("stage") == prof.stage), None)
        if timeline is not None:   # PP > 1: the stage timeline's communication and idle time
            st.update(recv_ms=timeline["recv_s"] * 1e3, send_ms=timeline["send_s"] * 1e3,
                      wait_ms=timeline["wait_s"] * 1e3, timeline_compute_ms=timeline["compute_s"] * 1e3)
        stages.append(st)
    driver = driver_breakdown(after["driver"], before["driver"], pipeline)
    result = {"stages": stages, "driver": driver,
              "roofline": None if roofline is None else {
                  "gemm_flops": roofline.gemm_flops, "mem_bandwidth": roofline.mem_bandwidth,
                  "cores": roofline.cores, "source": roofline.source}}
    result["table"] = format_breakdown(stages, driver, roofline)
    return result
