"""Cycles per block of 32 weights of the integer decode gemv (pipeserve_quant_rows), this tree
against another git revision, side by side in one process.

Two measures per SmolLM2-135M shape (Q4_1 layers, the Q8_0 tied head; one activation row):
- hot: the rows of one thread's share that fit in L2, computed over and over from one
  quantized x (pipeserve_quant_prepare once), one thread: the kernel's compute alone, in
  cycles per block at the TSC clock (``--ghz``, /proc/cpuinfo's MHz by default);
- chain: a whole token's gemvs in layer order (30 x qkv, o, gate_up, down + head) through
  ``QuantKernels.decode_fn``, on copies of the weights larger than the last-level cache, at
  each thread count: ms per token, and GB/s of codes + scales (+ minimums).
The two builds alternate ``--rounds`` times and the best of each is kept, so a busy
neighbour slows both alike; read the ratio.

``--kinds`` times the hot measure per kept GGUF type instead (Q4_K, Q6_K, Q5_K, Q5_0, Q5_1,
Q8_0, repacked from GGUF blocks as the loader does) on SmolLM2's shapes and on rows of 4096
and 8192 (Llama 3 8B / 70B): cycles per 32 weights and GB/s of codes + scales (+ minimums)
read from L2, where the q4 pair path sets the pace for the others (``--types Q6_K,Q4_K``: only those).

``--gguf FILE`` times one decode token's gemvs of a GGUF file instead (every quantized 2-D weight
but the embedding, repacked as the loader does, one row of x, in file order, so the weights come
from memory; at each of ``--threads``: one thread calls pipeserve_quant_rows on activations prepared
once, more take the decode path, ``QuantKernels.decode_fn``): ms per token, best of ``--rounds`` alternating builds, which a paused
or busy host slows alike (a Q4_K_M file: how much its Q6_K tensors cost beside its Q4_K ones).

``--march haswell`` builds both sides as an AVX2 CPU would (the kernels that CPU runs, timed here).

    PYTHONPATH=$PWD python benchmarks/gemv_avx2_bench.py [--compare HEAD] [--threads 1,2] [--kinds [--types T,...]]
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from benchmarks.quant_gemv_bw import COLD_BYTES, LAYERS, SHAPES, _copies, _weight
from benchmarks.quant_kernels import timed
from pipeserve.kernels.build import _FLAGS, _compiler, load_kernel
from pipeserve.model.quant.cpu_kernels import QuantKernels, _kind, _weight_args
from pipeserve.model.quant.gguf_repack import repack
from pipeserve.model.quant.packed import K4_SUPER, PackedWeight, k4_group_scales, k6_group_scales

HOT_BYTES = 256 << 10   # codes + scales a hot run reads: within L2 (512 KB a core here)
T = gguf.GGMLQuantizationType
KINDS = (T.Q4_K, T.Q6_K, T.Q5_K, T.Q5_0, T.Q5_1, T.Q8_0)
KIND_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 4096), (8192, 8192))


def lib_at(rev: str | None, march: str | None = None) -> ctypes.CDLL:
    """quant_matmul.c and the kernel headers as of git revision ``rev`` (None: the working tree),
    built with the project's flags, or for ``-march=march`` (an older CPU's build, run here)."""
    root = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix="gemv-avx2-"))
    if rev is None:
        src = root / "pipeserve" / "kernels"
    else:
        src = tmp
        names = subprocess.run(["git", "ls-tree", "--name-only", rev, "pipeserve/kernels/"], cwd=root, check=True,
                               capture_output=True, text=True).stdout.split()
        for name in names:
            if name.endswith((".c", ".h")):
                (tmp / Path(name).name).write_text(subprocess.run(["git", "show", f"{rev}:{name}"], cwd=root,
                                                                  check=True, capture_output=True, text=True).stdout)
    flags = [f"-march={march}" if f == "-march=native" and march else f for f in _FLAGS]
    subprocess.run([_compiler(), *flags, str(src / "quant_matmul.c"), "-o", str(tmp / "lib.so"), "-lm"], check=True)
    return ctypes.CDLL(str(tmp / "lib.so"))


def for_build(lib: ctypes.CDLL, w: PackedWeight) -> PackedWeight:
    """``w`` as the build ``lib`` takes it: a build from before Q4_K's / Q5_K's / Q6_K's two-level
    scales gets the float16 scales (and minimums) per group it held then (each d * sub rounded)."""
    lib.pipeserve_quant_takes.argtypes, lib.pipeserve_quant_takes.restype = [ctypes.c_int], ctypes.c_int
    if not w.two_level or lib.pipeserve_quant_takes(_kind(w)):
        return w
    if w.kind == "q6":
        return PackedWeight("q6", 16, w.qs, k6_group_scales(w).half(), None, w.source,
                            w.qh[:, w.in_features // 16:].contiguous(), w.zero)
    scale, minv = k4_group_scales(w)   # q4 / q5: the q5 planes after the sub-scales
    planes = w.qh[:, w.in_features // 16:].contiguous() if w.kind == "q5" else None
    return PackedWeight(w.kind, 32, w.qs, scale.half(), minv.half(), w.source, planes, w.zero)


class Rows:
    """pipeserve_quant_prepare / pipeserve_quant_rows of one build, bound to one weight and x."""

    def __init__(self, lib: ctypes.CDLL, w, x: torch.Tensor) -> None:
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.pipeserve_quant_act_bytes.argtypes = [i32, i64, i64, i64]
        lib.pipeserve_quant_act_bytes.restype = i64
        lib.pipeserve_quant_prepare.argtypes = [i32, i64, ptr, i64, ptr]
        lib.pipeserve_quant_rows.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, ptr, i32, ptr, i64, i64, i64, ptr]
        self.w = w = for_build(lib, w)   # held: the arguments point into its tensors
        self.args = _weight_args(w)
        kind, k = self.args[0], self.args[5]
        self.act = torch.empty(lib.pipeserve_quant_act_bytes(kind, k, self.args[6], x.shape[0]), dtype=torch.uint8)
        self.out = torch.empty(x.shape[0], self.args[4])
        lib.pipeserve_quant_prepare(kind, k, x.data_ptr(), x.shape[0], self.act.data_ptr())
        self.rows, self.m = lib.pipeserve_quant_rows, x.shape[0]

    def __call__(self, n0: int, n1: int) -> None:
        kind, qs, sc, mn, n, k, group, qh, zero = self.args
        self.rows(kind, qs, sc, mn, n, k, group, qh, zero, self.act.data_ptr(), self.m, n0, n1, self.out.data_ptr())


def side_by_side(runs: dict, rounds: int, repeats: int) -> dict:
    """Best time of each labelled function, the labels alternating ``rounds`` times."""
    out = {label: float("inf") for label in runs}
    for _ in range(rounds):
        for label, fn in runs.items():
            out[label] = min(out[label], timed(fn, repeats) / 1e6)   # seconds
    return out


def _time_rows(libs: dict, w: PackedWeight, x: torch.Tensor, rows: int, rounds: int):
    """Each library's best time for enough passes over ``rows`` rows of ``w`` to make ~2M
    weights: (times by label, passes, blocks of 32 weights in all)."""
    k = w.in_features
    calls = max(1, 2_000_000 // (rows * k))
    runs = {label: (lambda r=Rows(lib, w, x): [r(0, rows) for _ in range(calls)]) for label, lib in libs.items()}
    return side_by_side(runs, rounds, 7), calls, calls * rows * k / 32


def hot(libs: dict, ghz: float, rounds: int) -> None:
    print(f"hot (in L2, one thread), cycles per block of 32 at {ghz:.3f} GHz:")
    for name, (n, k, bits) in SHAPES.items():
        w = _weight(n, k, bits)
        rows = min(n, HOT_BYTES // (w.nbytes // n))
        t, calls, blocks = _time_rows(libs, w, torch.randn(1, k), rows, rounds)
        cells = "  ".join(f"[{label}] {s * ghz * 1e9 / blocks:5.2f}" for label, s in t.items())
        print(f"  {name:8} {rows:>5}x{k:<5} q{bits}  {cells}" + _ratio(t))


def gguf_weight(ttype: T, n: int, k: int, rng: np.random.Generator) -> PackedWeight:
    """[n, k] of ``ttype`` through the loader's repack: gguf's quantizer where it has one, else
    random blocks with modest float16 scales (the kernels' speed does not depend on the codes).
    A row shorter than a super-block multiple (SmolLM2's 576 for the K-quants) is the first k
    weights of a longer repacked row: every array of a layout holds a row's groups in order
    (but Q4_K's, Q5_K's and Q6_K's two-level scales, per 256 weights: such rows are
    refused there; real files store such tensors in another type)."""
    block, size = gguf.GGML_QUANT_SIZES[ttype]
    wide = -(-k // block) * block
    try:
        raw = gguf.quants.quantize(rng.standard_normal((n, wide)).astype(np.float32), ttype)
    except NotImplementedError:
        raw = rng.integers(0, 256, (n, wide // block, size), dtype=np.uint8)
        for off in (208,) if ttype == T.Q6_K else (0, 2):   # d (and dmin)
            raw[..., off:off + 2] = np.full(raw.shape[:2], 0.01, np.float16).view(np.uint8).reshape(n, -1, 2)
    w = repack(ttype, raw.reshape(n, -1))
    return w.map(lambda t: t[:, :t.shape[1] * k // wide].contiguous()) if wide != k else w


def hot_kinds(libs: dict, ghz: float, rounds: int, types: tuple = KINDS) -> None:
    print(f"hot per GGUF type (in L2, one thread, one row of x), cycles per 32 weights at {ghz:.3f} GHz, "
          "GB/s of codes + scales read:")
    rng = np.random.default_rng(0)
    for ttype in types:
        for n, k in KIND_SHAPES:
            if k % K4_SUPER and ttype in (T.Q6_K, T.Q5_K, T.Q4_K):   # no SmolLM2-width rows (above)
                continue
            probe = gguf_weight(ttype, 1, k, rng)
            rows = min(n, max(1, HOT_BYTES // probe.nbytes))
            w = gguf_weight(ttype, rows, k, rng)   # only the rows a hot run reads
            t, calls, blocks = _time_rows(libs, w, torch.randn(1, k), rows, rounds)
            cells = "  ".join(f"[{label}] {s * ghz * 1e9 / blocks:5.2f} {calls * w.nbytes / s / 1e9:5.1f} GB/s"
                              for label, s in t.items())
            print(f"  {ttype.name:5} {w.kind} g{w.group:<2} {n:>5}x{k:<5} ({rows:>3} rows)  {cells}" + _ratio(t))


def gguf_token(libs: dict, path: str, rounds: int, threads: tuple[int, ...] = (1,)) -> None:
    reader = gguf.GGUFReader(path)
    weights = [repack(t.tensor_type, np.asarray(t.data).reshape(int(t.shape[1]), -1)) for t in reader.tensors
               if len(t.shape) == 2 and t.name != "token_embd.weight" and t.tensor_type not in (T.F32, T.F16, T.BF16)]
    types = sorted({w.source for w in weights})
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        runs = {}
        for label, lib in libs.items():
            if n_threads == 1:   # pipeserve_quant_rows on activations prepared once
                rows = [(Rows(lib, w, torch.randn(1, w.in_features)), w.out_features) for w in weights]
                runs[label] = lambda rows=rows: [r(0, n) for r, n in rows]
            else:                # the decode path: activations prepared per call, rows over the threads
                kern = QuantKernels(lib)
                fns = [(kern.decode_fn(for_build(lib, w)), torch.randn(1, w.in_features)) for w in weights]
                runs[label] = lambda fns=fns: [f(x) for f, x in fns]
        t = side_by_side(runs, rounds, 1)
        cells = "  ".join(f"[{label}] {s * 1e3:6.1f} ms" for label, s in t.items())
        print(f"one token of {path} ({len(weights)} gemvs: {', '.join(types)}), {n_threads} thread(s):  {cells}"
              + _ratio(t))
    torch.set_num_threads(1)


def chain(kernels: dict, threads: int, rounds: int) -> None:
    torch.set_num_threads(threads)
    weights = {name: _weight(n, k, bits) for name, (n, k, bits) in SHAPES.items()}
    cold = {name: _copies(w, max(2, COLD_BYTES // w.nbytes)) for name, w in weights.items()}
    order = [cold[name][layer % len(cold[name])] for layer in range(LAYERS) for name in ("qkv", "o", "gate_up", "down")]
    order.append(cold["head"][0])
    token_bytes = sum(w.nbytes for w in order)
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    runs = {}
    for label, kern in kernels.items():
        fns = [(kern.decode_fn(w), xs[w.in_features]) for w in order]
        runs[label] = lambda fns=fns: [f(x) for f, x in fns]
    t = side_by_side(runs, rounds, 5)
    cells = "  ".join(f"[{label}] {s * 1e3:6.2f} ms {token_bytes / s / 1e9:5.1f} GB/s" for label, s in t.items())
    print(f"chain, {threads} thread(s), {len(order)} gemvs, {token_bytes / 1e6:.1f} MB:  {cells}" + _ratio(t))


def _ratio(t: dict) -> str:
    values = list(t.values())
    return f"  old/new {values[1] / values[0]:.3f}" if len(values) == 2 else ""


def _tsc_ghz() -> float:
    return float(re.search(r"cpu MHz\s*:\s*([\d.]+)", Path("/proc/cpuinfo").read_text()).group(1)) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", metavar="REV", help="also time the kernels as of this git revision")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ghz", type=float, default=None, help="clock for cycles (default: /proc/cpuinfo)")
    parser.add_argument("--skip-chain", action="store_true")
    parser.add_argument("--kinds", action="store_true", help="the hot measure per GGUF type, long rows too")
    parser.add_argument("--types", default=",".join(t.name for t in KINDS), help="--kinds: which GGUF types")
    parser.add_argument("--gguf", metavar="FILE", help="time one decode token's gemvs of this GGUF file")
    parser.add_argument("--march", help="build both for this -march (e.g. haswell: an AVX2 CPU's kernels, run here)")
    args = parser.parse_args()
    libs = {"tree": lib_at(None, args.march) if args.march else load_kernel("quant_matmul")}
    if args.compare:
        libs[args.compare] = lib_at(args.compare, args.march)
    kernels = {label: QuantKernels(lib) for label, lib in libs.items()}
    print(f"isa={kernels['tree'].isa}")
    torch.set_num_threads(1)
    if args.gguf:
        gguf_token(libs, args.gguf, args.rounds, tuple(int(t) for t in args.threads.split(",")))
        return
    if args.kinds:
        hot_kinds(libs, args.ghz or _tsc_ghz(), args.rounds, tuple(T[name] for name in args.types.split(",")))
        return
    hot(libs, args.ghz or _tsc_ghz(), args.rounds)
    if not args.skip_chain:
        for threads in (int(t) for t in args.threads.split(",")):
            chain(kernels, threads, args.rounds)


if __name__ == "__main__":
    main()
