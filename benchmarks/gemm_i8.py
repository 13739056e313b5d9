"""The 8-bit many-row kernel (pipeserve/kernels/quant_gemm_i8.c) against the paths it replaced.

Per weight shape and row count, bfloat16 activations, one process, the three timed in turn
(best of ``--rounds``; the machine is shared: read the ratios):
- ``gemv``: the decode kernel in passes of 8 rows (quant_matmul.c; what the fused decode stage
  ran for 9-24 decodes on AVX512-VNNI builds),
- ``bf16``: quant_gemm.c's bfloat16 panels and vdpbf16ps (what bfloat16 prompts and batched
  decodes ran from 5 rows),
- ``i8``: quant_gemm_i8.c (vpdpbusd on int8 activations; now taken beyond 8 rows),
- ``amx``, where the CPU has AMX-BF16: quant_gemm.c's AMX kernel (the same bfloat16 panels as B
  tiles; what ``QuantKernels.matmul`` takes from ``amx_from(out_features)`` rows there), its
  speed-up over i8 printed last.
Weights: Q4_1-like q4 (group 32, with minimum) for the layers, Q8_0-like q8 for the head (or,
``--weights Q6_K`` (or Q4_K, Q5_K, Q3_K, Q2_K, IQ4_XS), that GGUF type everywhere as the loader keeps it:
random valid blocks, widths a multiple of 256, so the llama2k shapes); a layer
shape is timed over ``--copies`` copies of its weight (the default 30 is SmolLM2's layer count,
more than the L3 holds), so the weights come from memory as in a model's forward. Prints
microseconds per matmul and GFLOP/s.

    PYTHONPATH=$PWD python benchmarks/gemm_i8.py [--threads 1] [--rows 5,8,12,16,24,32,64,256,512]
        [--shapes smol,llama2k] [--rounds 5] [--weights q4|Q4_K|Q5_K|Q6_K|Q3_K|Q2_K|IQ4_XS]

``--compare-source OLD.c``: instead of the other paths, quant_gemm_i8.c as built from OLD.c (say
``git show BASE:pipeserve/kernels/quant_gemm_i8.c > /tmp/old.c``) against this tree's, in turn each
round, their outputs checked bit for bit; prints old / new per shape (best of the rounds, and
the median of the rounds' ratios).

``--compare-amx-source OLD.c``: the same for quant_gemm.c's AMX kernel (``git show
BASE:pipeserve/kernels/quant_gemm.c > /tmp/old.c``; CPUs with AMX-BF16): OLD.c's build against this
tree's (``QuantKernels.gemm(amx=True)``), outputs checked bit for bit.

``--memory``: instead, the 8-bit kernel on a Q8_0-like head (49152 x 576, SmolLM2's) from memory
against its first 1024 and 16384 rows (in L2 and in L3 after the first call), nanoseconds per weight
row at each of ``--rows`` (with ``--compare-source``: both builds): what waiting on memory costs.

``--fidelity``: instead, the built-in SmolLM2 (kept Q4_1, bfloat16) teacher-forced over windows of
the reference text (Python's LICENSE.txt: tokens 0-600, the suite's, and 600-1600), with the 8-bit
kernel and with the bfloat16 one, against the file dequantized to float32: top-1 agreement and
perplexity change.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.packed import quantize_weight

SHAPES = {
    "smol": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)},
    "llama2k": {"qkv": (3072, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="5,8,12,16,24,32,64,256,512")
    ap.add_argument("--shapes", default="smol,llama2k")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--weights", choices=["q4", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS"], default="q4")
    ap.add_argument("--fidelity", action="store_true")
    ap.add_argument("--memory", action="store_true", help="the head from memory against its first rows in cache")
    ap.add_argument("--compare-source", metavar="OLD.c", help="time quant_gemm_i8.c built from this file against "
                    "this tree's (outputs checked equal)")
    ap.add_argument("--compare-amx-source", metavar="OLD.c", help="time quant_gemm.c's AMX kernel built from "
                    "this file against this tree's (outputs checked equal)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.fidelity:
        fidelity()
        return
    kernels = cpu_kernels()
    if kernels is None or kernels.gemm_i8_isa is None:
        raise SystemExit("the 8-bit many-row kernel needs AVX512-VNNI (quant_gemm_i8.c); nothing to compare")
    gen = torch.Generator().manual_seed(0)
    old = _old_gemm_i8(args.compare_source) if args.compare_source else None
    new = kernels.gemm_i8
    if args.compare_amx_source:
        if kernels.gemm_amx_isa is None:
            raise SystemExit("no AMX-BF16 kernel on this CPU (quant_gemm.c's pipeserve_quant_gemm_amx); nothing to compare")
        old = _old_gemm_amx(args.compare_amx_source)
        new = lambda w, x: kernels.gemm(w, x, amx=True)   # noqa: E731
    if args.memory:
        memory(new, old, [int(r) for r in args.rows.split(",")], args.rounds, gen)
        return
    print(f"threads {args.threads}; " + ("microseconds per matmul, the old build against this tree's" if old else
                                         "us per matmul (GFLOP/s); i8 speed-up over the faster of the others"))
    for family in args.shapes.split(","):
        for name, (n, k) in SHAPES[family].items():
            head = name == "head"
            copies = 1 if head else max(1, min(args.copies, (256 << 20) // (n * k)))
            if args.weights != "q4":
                if k % 256:
                    continue                     # the K-quants' super-blocks are 256 weights of a row
                ws = [_gguf_weight(args.weights, n, k, seed) for seed in range(copies)]
            else:
                ws = [quantize_weight(torch.randn(n, k, generator=gen), 8 if head else 4, 32) for _ in range(copies)]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen).bfloat16()
                paths = {
                    "gemv": lambda w: torch.cat([kernels.gemv(w, x[r:r + 8]) for r in range(0, rows, 8)]),
                    "bf16": lambda w: kernels.gemm(w, x),
                    "i8": lambda w: kernels.gemm_i8(w, x),
                }
                if kernels.gemm_amx_isa is not None:
                    paths["amx"] = lambda w: kernels.gemm(w, x, amx=True)
                if rows > 64:
                    del paths["gemv"]            # passes of 8 rows over many rows: not a path anything takes
                if old is not None:
                    paths = {"old": lambda w: old(w, x), "i8": lambda w: new(w, x)}
                    if not all(torch.equal(old(w, x), new(w, x)) for w in ws[:2]):
                        raise SystemExit(f"{name} rows {rows}: the two builds' outputs differ")
                best = dict.fromkeys(paths, float("inf"))
                ratios = []
                for _ in range(args.rounds):
                    took = {}
                    for label, fn in paths.items():
                        t0 = time.perf_counter()
                        for w in ws:
                            fn(w)
                        took[label] = (time.perf_counter() - t0) / len(ws)
                        best[label] = min(best[label], took[label])
                    if old is not None:
                        ratios.append(took["old"] / took["i8"])
                flop = 2 * rows * n * k
                if old is not None:
                    print(f"{family:8s} {name:8s} {n:6d}x{k:<5d} rows {rows:4d}: old {best['old'] * 1e6:8.1f}  new "
                          f"{best['i8'] * 1e6:8.1f} us  old/new x{best['old'] / best['i8']:.3f} (rounds' median "
                          f"x{statistics.median(ratios):.3f}), outputs equal")
                    continue
                cells = "  ".join(f"{label} {t * 1e6:8.1f} ({flop / t / 1e9:5.1f})" for label, t in best.items())
                other = min(t for label, t in best.items() if label not in ("i8", "amx"))
                amx = f"  amx speed-up over i8 x{best['i8'] / best['amx']:.2f}" if "amx" in best else ""
                print(f"{family:8s} {name:8s} {n:6d}x{k:<5d} rows {rows:4d}: {cells}  x{other / best['i8']:.2f}{amx}")


def memory(new, old, row_counts: list[int], rounds: int, gen: torch.Generator) -> None:
    n, k = SHAPES["smol"]["head"]
    head = quantize_weight(torch.randn(n, k, generator=gen), 8, 32)
    weights = {"memory": head, "1024 rows": head.rows(torch.arange(1024)), "16384 rows": head.rows(torch.arange(16384))}
    builds = {"new": new} | ({"old": old} if old is not None else {})
    print(f"threads {torch.get_num_threads()}; 8-bit kernel (--compare-amx-source: AMX), Q8_0-like head rows: "
          f"ns per weight row, best of {rounds}")
    for rows in row_counts:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        for label, fn in builds.items():
            cells = []
            for where, w in weights.items():
                fn(w, x)
                best = float("inf")
                for _ in range(rounds):
                    calls, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < 0.3:
                        fn(w, x)
                        calls += 1
                    best = min(best, (time.perf_counter() - t0) / calls / w.out_features)
                cells.append(f"{where} {best * 1e9:6.1f}")
            print(f"rows {rows:3d} {label}: " + "  ".join(cells))


def _old_gemm_i8(source: str):
    """``QuantKernels.gemm_i8`` as quant_gemm_i8.c built from ``source`` (this tree's headers)."""
    import ctypes
    import os
    import subprocess
    import tempfile

    from pipeserve.kernels import build
    from pipeserve.model.quant.cpu_kernels import bind_gemm_i8, run_gemm_i8
    kdir = os.path.dirname(build.__file__)
    lib_path = os.path.join(tempfile.mkdtemp(prefix="gemm_i8_old_"), "old.so")
    subprocess.run([os.environ.get("CC", "cc"), *build._FLAGS, "-I", kdir, source, "-o", lib_path], check=True)
    fn = bind_gemm_i8(ctypes.CDLL(lib_path))

    def gemm_i8(w, x):
        rc, out = run_gemm_i8(fn, w, x, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("the old build refused the matmul")
        return out
    return gemm_i8


def _old_gemm_amx(source: str):
    """``QuantKernels.gemm(amx=True)`` as quant_gemm.c built from ``source`` (this tree's headers)."""
    import ctypes
    import os
    import subprocess
    import tempfile

    from pipeserve.kernels import build
    from pipeserve.model.quant.cpu_kernels import _kind, _ptr
    kdir = os.path.dirname(build.__file__)
    lib_path = os.path.join(tempfile.mkdtemp(prefix="gemm_amx_old_"), "old.so")
    subprocess.run([os.environ.get("CC", "cc"), *build._FLAGS, "-I", kdir, source, "-o", lib_path], check=True)
    fn = ctypes.CDLL(lib_path).pipeserve_quant_gemm_amx
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes, fn.restype = [i32, p, p, p, i64, i64, i64, p, i64, p, i32, p, i32], i32

    def gemm_amx(w, x):
        out = torch.empty(x.shape[0], w.out_features, dtype=torch.bfloat16)
        if fn(_kind(w), w.qs.data_ptr(), w.scale.data_ptr(), _ptr(w.minv), w.out_features, w.in_features, w.group,
              x.data_ptr(), x.shape[0], out.data_ptr(), torch.get_num_threads(), _ptr(w.qh), w.zero) != 0:
            raise RuntimeError("the old build refused the matmul")
        return out
    return gemm_amx


def _gguf_weight(name: str, n: int, k: int, seed: int):
    """A weight [n, k] of GGUF type ``name``, random valid blocks (float16 scales of a trained
    model's size: tests/checkpoints.py), in the layout the loader keeps it in."""
    import gguf
    import numpy as np

    from pipeserve.model.quant.gguf_repack import repack
    from tests.checkpoints import random_quant_blocks
    ttype = gguf.GGMLQuantizationType[name]
    return repack(ttype, random_quant_blocks(ttype, n, k, np.random.default_rng(seed)))


def fidelity() -> None:
    import math
    import os

    import pipeserve.model.quant.cpu_kernels as quant_cpu
    from pipeserve.model.loader import resolve_model
    from pipeserve.tokenizer import load_tokenizer
    from pipeserve.worker.model_runner import ModelRunner
    from pipeserve.worker.step import SeqSampling, SeqStep, StepInput

    source = resolve_model("smollm2-135m-instruct")
    cfg = source.load_config()
    text = open(os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")).read()
    ids_all = load_tokenizer(source).encode(text)
    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)

    @torch.inference_mode()
    def logits(quantization: str, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
        runner = ModelRunner(source, cfg, start_layer=0, end_layer=cfg.num_layers, is_first=True, is_last=True,
                             dtype=dtype, device=torch.device("cpu"), num_blocks=128, num_host_blocks=0,
                             block_size=16, quantization=quantization)
        table = list(range(-(-len(ids) // 16)))
        hidden = runner._forward(StepInput(1, [SeqStep(0, ids, 0, table, greedy)]), None)
        return runner.model.compute_logits(hidden).float()

    def ppl(out: torch.Tensor, ids: list[int]) -> float:
        return math.exp(torch.nn.functional.cross_entropy(out[:-1], torch.tensor(ids[1:])).item())

    for lo, hi in ((0, 600), (600, 1600)):
        ids = ids_all[lo:hi]
        dense = logits("none", torch.float32, ids)
        for on in (False, True):
            quant_cpu.GEMM_I8 = on
            kept = logits("auto", torch.bfloat16, ids)
            agree = (kept.argmax(-1) == dense.argmax(-1)).float().mean().item()
            print(f"positions {lo}-{hi}, {'8-bit' if on else 'bfloat16'} kernel: top-1 {agree:.4f}, "
                  f"perplexity {ppl(kept, ids) / ppl(dense, ids) - 1:+.2%}")


if __name__ == "__main__":
    main()
