"""bfloat16 linear layers at prefill (and decode) shapes against the core's bf16 peak.

Per matrix shape and row count, in one process and alternating: ``F.linear`` on
the plain weight (the path before), oneDNN with the weight packed once, and
``pipeserve/kernels/bf16_gemm.c`` over weight panels packed once (what
``pipeserve.model.layers.Linear`` now runs for bias-free bfloat16 CPU layers;
see ``pipeserve/model/packed_linear.py``). The peak is
measured in the same process by ``pipeserve/kernels/flops_probe.c`` (12
independent ``vdpbf16ps`` zmm accumulators in registers: the instruction's
throughput, nothing else). Shapes: SmolLM2-135M's (hidden 576) and a
Llama-2-7B-sized layer (hidden 4096, MLP 11008).

One thread by default. Times are the calling thread's CPU time (``time.thread_time``),
best of several rounds: on a shared machine another process's time slices
then do not count (its cache pollution still does), so GFLOP/s stay close to
what an idle core gives. ``--wall`` times wall-clock instead. ``--cold`` cycles
each call through copies of the weight totalling 128 MB (more than the L3), so
the weights come from memory as in a model's forward; by default the one weight
stays in cache.

    PYTHONPATH=$PWD python benchmarks/prefill_gemm.py [--rows 1,8,32,128,256,512,2048] [--shapes smol,7b]
        [--cold] [--wall] [--threads 2]
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
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads; above 1 the clock is the process's CPU time (all threads, "
                         "OpenMP spin-waits included), so GFLOP/s are per core-second")
    ap.add_argument("--cold", action="store_true", help="weights from memory: cycle through 128 MB of copies")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.thread_time if args.threads == 1 else time.process_time
    if not packed_linear.available():
        raise SystemExit("this torch has no oneDNN packed-linear ops: nothing to compare")
    peak = measure_peak(clock)
    print(f"threads={args.threads} clock={'wall' if args.wall else 'CPU'} weights={'cold' if args.cold else 'in cache'} "
          + (f"bf16 peak={peak:.1f} GFLOP/s" if peak else "bf16 peak=n/a"))
    gemm = packed_linear.gemm_kernel()
    print(f"{'model':5} {'matrix':8} {'[out, in]':>13} {'rows':>5} {'F.linear':>9} {'oneDNN-pk':>9} "
          f"{'bf16_gemm':>9} {'gemm/F':>7} {'gemm/pk':>7}   % of peak: F  pk  gemm")
    with torch.inference_mode():
        for model in args.shapes.split(","):
            for name, (n, k) in SHAPES[model].items():
                copies = max(1, int(128e6 // (2 * n * k))) if args.cold else 1
                gen = torch.Generator().manual_seed(0)
                ws = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(copies)]
                onednn = [packed_linear.pack(w) for w in ws]
                panels = [gemm.pack(w) for w in ws] if gemm else []
                for rows in (int(r) for r in args.rows.split(",")):
                    if model == "7b" and rows > 512:
                        continue   # seconds per call on one core; the rate is flat from 128 rows
                    x = torch.randn(rows, k).bfloat16()
                    if not packed_linear.linear(x, onednn[0], None).equal(F.linear(x, ws[0])):
                        raise SystemExit(f"{model} {name} rows={rows}: oneDNN packed differs from F.linear")
                    paths = [lambda i: F.linear(x, ws[i]), lambda i: packed_linear.linear(x, onednn[i], None)]
                    if gemm:
                        paths.append(lambda i: gemm(x, panels[i], n))
                    best = [float("inf")] * len(paths)
                    for _ in range(2):   # alternate, so all see the same load
                        for j, path in enumerate(paths):
                            best[j] = min(best[j], best_seconds(_cycling(path, copies), clock, rounds=3))
                    g = [2 * rows * n * k * copies / t / 1e9 for t in best]
                    g_gemm = g[2] if gemm else float("nan")
                    pct = "  ".join(f"{100 * v / peak:3.0f}" for v in g) if peak else ""
                    print(f"{model:5} {name:8} {str([n, k]):>13} {rows:>5} {g[0]:9.1f} {g[1]:9.1f} {g_gemm:9.1f} "
                          f"{g_gemm / g[0]:7.2f} {g_gemm / g[1]:7.2f}   {pct}", flush=True)


def _cycling(path, copies: int):
    """One call of ``path`` on each weight copy in turn (one copy: the weight stays in cache)."""
    def run() -> None:
        for i in range(copies):
            path(i)
    return run

if __name__ == "__main__":
    main()
