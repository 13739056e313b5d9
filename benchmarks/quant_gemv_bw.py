"""Achieved read bandwidth of the quantized decode kernel vs a plain memory read.

For each of SmolLM2-135M's per-token weight shapes (Q4_1 layers, the Q8_0 tied
head) the decode kernel (one activation row, bfloat16, the path decode takes) is
timed over enough distinct copies of the matrix that they do not fit in the
last-level cache, as in a real decode step where every matrix is read once per
token. GB/s = bytes of codes + scales (+ minimums) / time per call. The roofline
is ``torch.sum`` over a 256 MB tensor in the same run (what this machine can
stream). Also: the time of a tiny call (fork/join and call overhead), and a
whole token's gemv chain in layer order (30 x qkv, o, gate_up, down + head).

    PYTHONPATH=$PWD python benchmarks/quant_gemv_bw.py [--threads 1,2] [--compare REV] [--cpu-time]

``--compare REV`` builds quant_matmul.c as of git revision REV as well and times
both kernels alternately on the same weights (the ratio is what to read on a
shared machine); ``--cpu-time`` (one thread only) times with the thread's CPU
clock, which other processes on the machine do not inflate.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pipeserve.kernels.build import _FLAGS, _compiler
from pipeserve.model.quant.cpu_kernels import QuantKernels, cpu_kernels
from pipeserve.model.quant.packed import PackedWeight, quantize_weight

LAYERS = 30
SHAPES = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4), "down": (576, 1536, 4),
          "head": (49152, 576, 8)}
COLD_BYTES = 160 << 20   # more than the last-level cache (32 MB here), so every call reads DRAM


def _weight(n: int, k: int, bits: int) -> PackedWeight:
    return quantize_weight(torch.randn(n, k) * 0.05, bits, 32)


def _copies(w: PackedWeight, count: int) -> list[PackedWeight]:
    return [w.map(lambda t: t.clone()) for _ in range(count)]


CLOCK = time.perf_counter


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = CLOCK()
        fn()
        best = min(best, CLOCK() - t)
    return best


def kernels_at(rev: str) -> QuantKernels:
    """quant_matmul.c (and the kernel headers) as of git revision ``rev``, built with the project's flags."""
    root = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix="quant-gemv-"))
    headers = subprocess.run(["git", "ls-tree", "--name-only", rev, "pipeserve/kernels/"], cwd=root, check=True,
                             capture_output=True, text=True).stdout.split()
    for name in ["quant_matmul.c"] + [Path(h).name for h in headers if h.endswith(".h")]:
        text = subprocess.run(["git", "show", f"{rev}:pipeserve/kernels/{name}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        (tmp / name).write_text(text)
    subprocess.run([_compiler(), *_FLAGS, str(tmp / "quant_matmul.c"), "-o", str(tmp / "ref.so"), "-lm"], check=True)
    return QuantKernels(ctypes.CDLL(str(tmp / "ref.so")))


def roofline(threads: int) -> float:
    torch.set_num_threads(threads)
    big = torch.ones(64 << 20, dtype=torch.float32)   # 256 MB
    return big.nbytes / _best(lambda: big.sum(), 5) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", metavar="REV", help="also time quant_matmul.c as of this git revision")
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock (one thread)")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != "1":
            parser.error("--cpu-time measures one thread: use it with --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    k = cpu_kernels()
    kernels = {"this tree": k}
    if args.compare:
        kernels[args.compare] = kernels_at(args.compare)
    print(f"isa={k.isa}")
    weights = {name: _weight(n, kd, bits) for name, (n, kd, bits) in SHAPES.items()}
    cold = {name: _copies(w, max(2, COLD_BYTES // w.nbytes)) for name, w in weights.items()}
    chain = [cold[name][layer % len(cold[name])] for layer in range(LAYERS) for name in ("qkv", "o", "gate_up", "down")]
    chain.append(cold["head"][0])
    token_bytes = sum(w.nbytes for w in chain)
    tiny = _weight(16, 64, 4)
    for threads in (int(t) for t in args.threads.split(",")):
        roof = roofline(threads)
        torch.set_num_threads(threads)
        print(f"\nthreads={threads}  roofline (torch.sum, 256 MB) {roof:5.1f} GB/s")
        x1 = torch.randn(1, 64).bfloat16()
        print(f"  tiny gemv [16, 64]: {_best(lambda: k.gemv(tiny, x1), 200) * 1e6:6.1f} us per call")
        for name, copies in cold.items():
            x = torch.randn(1, copies[0].in_features).bfloat16()
            cells = []
            for label, kern in kernels.items():
                def run(kern=kern) -> None:
                    for w in copies:
                        kern.gemv(w, x)
                per_call = _best(run, args.repeats) / len(copies)
                warm = _best(lambda kern=kern: kern.gemv(copies[0], x), 20)   # the same matrix again: from cache
                gbs = copies[0].nbytes / per_call / 1e9
                cells.append(f"[{label}] {per_call * 1e6:7.1f} us {gbs:5.1f} GB/s ({gbs / roof * 100:3.0f} %), "
                             f"cached {warm * 1e6:7.1f} us")
            print(f"  {name:8} {copies[0].out_features:>5}x{copies[0].in_features:<5} {copies[0].nbytes / 1e3:6.0f} KB  "
                  + "  ".join(cells))
        xs = {kd: torch.randn(1, kd).bfloat16() for kd in (576, 1536)}
        for label, kern in kernels.items():
            def token(kern=kern) -> None:
                for w in chain:
                    kern.gemv(w, xs[w.in_features])
            t = _best(token, args.repeats)
            print(f"  [{label}] token chain ({len(chain)} gemvs, {token_bytes / 1e6:.1f} MB): {t * 1e3:6.2f} ms = "
                  f"{token_bytes / t / 1e9:5.1f} GB/s ({token_bytes / t / 1e9 / roof * 100:3.0f} % of roofline), "
                  f"{1 / t:6.1f} tok/s gemv-only; roofline limit {roof * 1e9 / token_bytes:6.1f} tok/s")

if __name__ == "__main__":
    main()
