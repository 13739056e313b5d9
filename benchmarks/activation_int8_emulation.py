"""What an activation quantization would cost the kept SmolLM2 before a kernel is written for it.

Every kept matmul of the built-in SmolLM2 (bfloat16 model, its Q4_1 layers and Q8_0 head kept) is
replaced by a PyTorch emulation: each row of x quantized per block of ``B`` activations to int8
(d = max|x| / 127, q = round(x / d)), optionally with a second int8 term for the remainder
(x ~ d * (q1 + q2 / 256), q2 clamped to +-127: the decode kernel's two-term form), then
multiplied in float32 with the dequantized weight. Teacher-forced over the reference text (the
suite's first 600 positions of Python's LICENSE.txt), each scheme's logits are compared with the
file dequantized to float32: top-1 agreement and perplexity, the measures of issue 11 and of
``test_kept_smollm2_decode_kernel_with_int8_activations_agrees`` (which holds the decode kernel's
integer activations to 0.98 in bfloat16).

    PYTHONPATH=$PWD python benchmarks/activation_int8_emulation.py [--schemes 32x1,16x1,32x2,32x1:down] [--positions 600]

A scheme ``BxT:ROLE[+ROLE...]`` applies to the matrices of those roles only (``down``, ``gate_up``,
``attn``: q/k/v and o, ``head``), the others taking two int8 terms per 32 (the decode kernel's finest
form).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kv_cache_fidelity import TEXT_FILE, compare, make_runner, prefill_logits
from pipeserve.model.loader import resolve_model
from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.quant.packed import dequantize
from pipeserve.tokenizer import load_tokenizer


def role(w, cfg) -> str:
    """Which of a layer's matrices (or the head) a kept weight is, by its shape."""
    if w.out_features >= cfg.vocab_size:
        return "head"
    if w.in_features == cfg.intermediate_size:
        return "down"
    return "gate_up" if w.out_features in (cfg.intermediate_size, 2 * cfg.intermediate_size) else "attn"


def emulated_matmul(block: int, terms: int, only=None):
    """kernels.matmul's stand-in: x [M, K] quantized per `block` with `terms` int8 terms, times W^T
    (where only(w) is false: two terms per 32)."""
    dense: dict[int, torch.Tensor] = {}

    def matmul(w, x: torch.Tensor) -> torch.Tensor:
        if only is not None and not only(w):
            return emulated(w, x, 32, 2)
        return emulated(w, x, block, terms)

    def emulated(w, x: torch.Tensor, block: int, terms: int) -> torch.Tensor:
        if id(w) not in dense:
            dense[id(w)] = dequantize(w).float()
        xb = x.float().reshape(x.shape[0], -1, block)
        d = xb.abs().amax(-1, keepdim=True) / 127
        d = torch.where(d > 0, d, torch.ones_like(d))
        q1 = torch.round(xb / d)
        xq = q1
        if terms == 2:
            xq = q1 + torch.clamp(torch.round((xb / d - q1) * 256), -127, 127) / 256
        return ((xq * d).reshape(x.shape) @ dense[id(w)].t()).to(x.dtype)

    return matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="32x1,16x1,32x2", help="BLOCKxTERMS,... (activations per scale, int8 terms)")
    ap.add_argument("--positions", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model("smollm2-135m-instruct")
    cfg = source.load_config()
    ids = load_tokenizer(source).encode(TEXT_FILE.read_text())[:args.positions]
    targets = torch.tensor(ids[1:])
    ref = prefill_logits(make_runner(source, cfg, "auto", len(ids), torch.float32, quantization="none"), ids)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the quantized-weight C kernel did not build: nothing to emulate")
    for scheme in args.schemes.split(","):
        form, _, only = scheme.partition(":")
        block, terms = (int(v) for v in form.split("x"))
        roles = set(only.split("+")) if only else None
        kernels.matmul = emulated_matmul(block, terms, (lambda w: role(w, cfg) in roles) if roles else None)
        got = prefill_logits(make_runner(source, cfg, "auto", len(ids), torch.bfloat16), ids).float()
        m = compare(got, ref, targets)
        print(f"block {block:3d}, {terms} int8 term(s){' on ' + only if only else ''}: "
              f"top-1 agreement {m['top1_agreement']:.4f}, "
              f"perplexity {m['ppl']:.3f} (float32 {m['ppl_ref']:.3f})", flush=True)


if __name__ == "__main__":
    main()
