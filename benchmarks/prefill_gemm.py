"""bfloat16 linear layers at prefill (and decode) shapes against the core's bf16 peak.

Per matrix shape and row count, in one process and alternating: ``F.linear`` on
the plain weight (the path before) and the oneDNN-packed weight that
``pipeserve.model.layers.Linear`` now uses for bfloat16 CPU weights. The peak is
measured in the same process by ``pipeserve/kernels/flops_probe.c`` (12
independent ``vdpbf16ps`` zmm accumulators in registers: the instruction's
throughput, nothing else). Shapes: SmolLM2-135M's (hidden 576) and a
Llama-2-7B-sized layer (hidden 4096, MLP 11008).

One thread. Times are the calling thread's CPU time (``time.thread_time``),
best of several rounds: on a shared machine another process's time slices
then do not count (its cache pollution still does), so GFLOP/s stay close to
what an idle core gives. ``--wall`` times wall-clock instead.

    PYTHONPATH=$PWD python benchmarks/prefill_gemm.py [--rows 1,8,32,128,256,512,2048] [--shapes smol,7b] [--wall]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pipeserve.model import packed_linear

SHAPES = {
    "smol": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
}


def best_seconds(fn, clock, rounds: int = 5, min_s: float = 0.03) -> float:
    """Best over ``rounds`` of the mean time of ``fn`` over at least ``min_s`` seconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        calls, start = 0, clock()
        while True:
            fn()
            calls += 1
            spent = clock() - start
            if spent >= min_s:
                break
        best = min(best, spent / calls)
    return best


def measure_peak(clock) -> float | None:
    """GFLOP/s of the vdpbf16ps probe on this thread; None without an AVX512_BF16 build."""
    import ctypes

    from pipeserve.kernels.build import KernelBuildError, load_kernel
    try:
        lib = load_kernel("flops_probe")
    except KernelBuildError as exc:
        print(f"peak: not measured ({exc})")
        return None
    lib.pipeserve_bf16_peak_loop.restype = ctypes.c_double
    lib.pipeserve_bf16_peak_loop.argtypes = [ctypes.c_int64]
    if lib.pipeserve_bf16_peak_loop(1) < 0:
        print("peak: not measured (no AVX512_BF16 on this CPU)")
        return None
    iters = 2_000_000
    flops = lib.pipeserve_bf16_peak_loop(iters)
    return flops / best_seconds(lambda: lib.pipeserve_bf16_peak_loop(iters), clock, rounds=5, min_s=0.0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,128,256,512,2048")
    ap.add_argument("--shapes", default="smol,7b")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of thread CPU time")
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.perf_counter if args.wall else time.thread_time
    if not packed_linear.available():
        raise SystemExit("this torch has no oneDNN packed-linear ops: nothing to compare")
    peak = measure_peak(clock)
    print(f"threads=1 clock={'wall' if args.wall else 'thread CPU'} "
          f"bf16 peak={peak:.1f} GFLOP/s" if peak else "bf16 peak=n/a")
    print(f"{'model':5} {'matrix':8} {'[out, in]':>13} {'rows':>5} {'F.linear':>9} {'packed':>8} "
          f"{'packed/F':>8} {'F %pk':>6} {'pk %pk':>6}")
    with torch.inference_mode():
        for model in args.shapes.split(","):
            for name, (n, k) in SHAPES[model].items():
                w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16() * 0.05
                packed = packed_linear.pack(w)
                for rows in (int(r) for r in args.rows.split(",")):
                    if model == "7b" and rows > 512:
                        continue   # seconds per call on one core; the rate is flat from 128 rows
                    x = torch.randn(rows, k).bfloat16()
                    if not packed_linear.linear(x, packed, None).equal(F.linear(x, w)):
                        raise SystemExit(f"{model} {name} rows={rows}: packed result differs from F.linear")
                    flop = 2 * rows * n * k
                    plain, pre = [], []
                    for _ in range(2):   # alternate, so both see the same load
                        plain.append(best_seconds(lambda: F.linear(x, w), clock, rounds=3))
                        pre.append(best_seconds(lambda: packed_linear.linear(x, packed, None), clock, rounds=3))
                    g_plain, g_pre = flop / min(plain) / 1e9, flop / min(pre) / 1e9
                    pct = (f"{100 * g_plain / peak:5.0f}% {100 * g_pre / peak:5.0f}%" if peak else "")
                    print(f"{model:5} {name:8} {str([n, k]):>13} {rows:>5} {g_plain:9.1f} {g_pre:8.1f} "
                          f"{g_pre / g_plain:8.2f} {pct}", flush=True)


if __name__ == "__main__":
    main()
