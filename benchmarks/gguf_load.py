"""What loading a GGUF costs before the first token, at start-up and at every stage restart:
opening the file (the header and its metadata: pipeserve's reader vs the gguf package's) and
re-laying out each kept type into the kernels' layouts (``gguf_repack.repack``), in MB of
file bytes per second, one thread.

    PYTHONPATH=$PWD python benchmarks/gguf_load.py [--rows 4096] [--cols 4096] [--repeats 3]

The repack runs on random blocks (speed does not depend on the values); a 70B Q4_K_M file is
about 40 GB, mostly Q4_K with Q6_K for some tensors, so MB/s here is the load time per stage.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import gguf
import numpy as np

from pipeserve.model.loader.gguf_file import GGUFFile
from pipeserve.model.quant.gguf_repack import KEPT_TYPES, repack


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from pipeserve.model.loader import resolve_model
    path = str(resolve_model("smollm2-135m-instruct").path)
    print(f"open {os.path.basename(path)} ({os.path.getsize(path) / 1e6:.0f} MB, 49k-token vocabulary):")
    ours, theirs = best(lambda: GGUFFile(path), args.repeats), best(lambda: gguf.GGUFReader(path), args.repeats)
    print(f"  pipeserve gguf_file.GGUFFile {ours:.3f} s, gguf.GGUFReader {theirs:.3f} s ({theirs / ours:.0f}x)")
    print(f"repack [{args.rows}, {args.cols}] per kept type, best of {args.repeats}:")
    rng = np.random.default_rng(0)
    warnings.filterwarnings("ignore")   # random float16 scales overflow in the K-quants' products
    for ttype in KEPT_TYPES:
        block, type_size = gguf.GGML_QUANT_SIZES[ttype]
        raw = rng.integers(0, 256, (args.rows, args.cols // block * type_size), dtype=np.uint8)
        seconds = best(lambda: repack(ttype, raw), args.repeats)
        print(f"  {ttype.name:5s} {raw.nbytes / 1e6:6.1f} MB  {seconds:.3f} s  {raw.nbytes / 1e6 / seconds:6.0f} MB/s")


if __name__ == "__main__":
    main()
