"""The runtime's own SmolLM2 stage in bfloat16 with each bf16 linear path, side by side.

A stage of the model's layers with random weights (``pipeline.costs.random_stage``,
as ``pipeserve plan --calibrate`` times it: the configured attention backend, the
fused elementwise kernels, a paged KV cache of the runtime's size), one thread,
timed for a prefill step (``--prompts`` fresh prompts of ``--prompt-len`` tokens)
and a decode step (``--decodes`` sequences at context ``--context``), alternating
between the paths in one process: ``F.linear`` (the path before), oneDNN with
packed weights, and ``bf16_gemm.c`` (the default now). Thread CPU time, best of
rounds (the machine may be shared); GFLOP/s count the matmuls only (2 x tokens x
the layers' weights), so they are a lower bound on the GEMMs' own rate.

    PYTHONPATH=$PWD python benchmarks/prefill_stage.py [--layers 30] [--prompts 2 --prompt-len 256]
        [--decodes 64 --context 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeserve.model import packed_linear
from pipeserve.model.layers import Linear
from pipeserve.pipeline.costs import random_stage, step_tensors
from pipeserve.plan.presets import load_model

CACHE_BYTES_PER_LAYER = 64 * 1024**2   # as calibrate: blocks scattered over a cache of the runtime's size


def linears(stage) -> list[Linear]:
    return [m for m in stage.modules() if isinstance(m, Linear)]


def use(stage, mode: str, packs: dict) -> None:
    """Switch every Linear of the stage to ``mode``'s packed copies (made on first use)."""
    Linear.prepack = mode != "F.linear"
    for i, layer in enumerate(linears(stage)):
        layer.packed = packs.setdefault((mode, i), packed_linear.PackedWeight())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, cfg = load_model("SmolLM2-135M")
    dev, dtype = torch.device("cpu"), torch.bfloat16
    torch.manual_seed(0)
    with torch.inference_mode():
        stage = random_stage(cfg, 0, args.layers, False, False, dtype, dev)
        block = 16
        kv_blocks = CACHE_BYTES_PER_LAYER // (2 * block * cfg.num_kv_heads * cfg.head_dim * 2)
        shapes = {"prefill": ([args.prompt_len] * args.prompts, [args.prompt_len] * args.prompts),
                  "decode": ([1] * args.decodes, [args.context + 1] * args.decodes)}
        steps = {}
        for name, (q, c) in shapes.items():
            kv, meta, pos, _ids, hidden = step_tensors(cfg, stage.backend, q, c, block, dtype, dev,
                                                       cache_blocks=kv_blocks)
            steps[name] = (hidden, pos, meta, [kv[0]] * args.layers, sum(q))
        weights = sum(layer.weight.numel() for layer in linears(stage))
        modes = ["F.linear", "oneDNN-packed"] + (["bf16_gemm"] if packed_linear.gemm_kernel() else [])
        packs: dict = {}
        real_kernel = packed_linear.gemm_kernel
        for mode in modes:   # make each mode's packed copies (oneDNN: with the C kernel hidden)
            if mode == "oneDNN-packed":
                packed_linear.gemm_kernel = lambda: None
            use(stage, mode, packs)
            h, pos, meta, kv, _ = steps["decode"]
            stage(h, pos, meta, kv)
            packed_linear.gemm_kernel = real_kernel
        best = {(s, m): float("inf") for s in steps for m in modes}
        for _ in range(args.rounds):
            for s, (h, pos, meta, kv, _) in steps.items():
                for m in modes:
                    use(stage, m, packs)
                    t = time.thread_time()
                    stage(h, pos, meta, kv)
                    best[s, m] = min(best[s, m], time.thread_time() - t)
        Linear.prepack = True
    print(f"SmolLM2 stage of {args.layers} layers, bfloat16, 1 thread, thread CPU time, best of {args.rounds}")
    for s, (*_, tokens) in steps.items():
        base = best[s, "F.linear"]
        row = "  ".join(f"{m} {1e3 * best[s, m]:7.1f} ms ({base / best[s, m]:.2f}x, "
                        f"{2 * tokens * weights / best[s, m] / 1e9:5.1f} GFLOP/s)" for m in modes)
        print(f"{s:7} {tokens:5} tokens: {row}")


if __name__ == "__main__":
    main()
