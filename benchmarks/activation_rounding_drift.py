"""How far a float32-rounding-sized change upstream moves the decode kernel's output, against
how far its integer activations are from float ones (built-in Q4_1 SmolLM2, kept quantized).

Tensor parallelism adds the ranks' o_proj and down_proj partial sums in another order than one
matmul: a relative change of ~1e-7. This script makes that change directly: every o_proj and
down_proj output times (1 + eps * N(0, 1)), then reads the teacher-forced next-token
log-probabilities of ``--positions`` tokens of real text, every matmul through the decode
kernel (``gemv`` in chunks of GEMV_MAX_ROWS, as decode calls it). It prints, per trial, the
change of the top-1 token's log-probability (max, median over positions), of the top-5's
(max of the five), and how many argmaxes moved; then the same distances between the kernel's
integer activations and its float ones. Where the first equals the second, the change
re-draws the activation rounding's noise rather than adding to it. Run it in two trees to
compare their activation codes:

    PYTHONPATH=$PWD python benchmarks/activation_rounding_drift.py [--eps 6e-8] [--positions 200]
"""

from __future__ import annotations

import argparse
import os

import torch

from pipeserve.model.loader import resolve_model
from pipeserve.model.quant.cpu_kernels import GEMV_MAX_ROWS, cpu_kernels
from pipeserve.model.quant.modules import QuantLinear
from pipeserve.tokenizer import load_tokenizer
from pipeserve.worker.model_runner import ModelRunner
from pipeserve.worker.step import SeqSampling, SeqStep, StepInput

BLOCK = 16
REFERENCE_TEXT = os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")   # as tests/conftest.py


@torch.inference_mode()
def log_probs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Teacher-forced next-token log-probabilities [len(ids), vocab] from one prefill."""
    table = list(range(-(-len(ids) // BLOCK)))
    sampling = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)
    hidden = runner._forward(StepInput(1, [SeqStep(0, ids, 0, table, sampling)]), None)
    return torch.log_softmax(runner.model.compute_logits(hidden).float(), -1)


def distance(base: torch.Tensor, other: torch.Tensor) -> str:
    top = base.topk(5, -1).indices                                           # [positions, 5]
    moved = (other.gather(1, top) - base.gather(1, top)).abs()
    flips = (other.argmax(-1) != base.argmax(-1)).sum().item()
    return (f"top-1 logprob moved max {moved[:, 0].max():.2e} median {moved[:, 0].median():.2e}; "
            f"top-5 max {moved.amax(1).max():.2e} median {moved.amax(1).median():.2e}; "
            f"argmax moved at {flips}/{len(base)}")


def perturb_row_parallel_outputs(runner: ModelRunner, noise: dict) -> None:
    """o_proj and down_proj outputs times (1 + noise["eps"] * N(0, 1)), a generator seeded by
    noise["seed"], advanced per call; the decoder calls ``forward`` directly (no hooks), so the
    method is wrapped."""
    def wrap(forward):
        def perturbed(x: torch.Tensor) -> torch.Tensor:
            out = forward(x)
            if noise["eps"] == 0.0:
                return out
            noise["seed"] += 1
            gen = torch.Generator().manual_seed(noise["seed"])
            return out * (1 + noise["eps"] * torch.randn(out.shape, generator=gen))
        return perturbed
    for name, module in runner.model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            module.forward = wrap(module.forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eps", type=float, default=6e-8, help="relative noise (float32's half ulp: 6e-8)")
    parser.add_argument("--positions", type=int, default=200)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_integer_activations:
        raise SystemExit("needs the C kernel built with integer activations (AVX512-VNNI or AVX2 + FMA + F16C)")
    integer = {"act": True}
    kernels.matmul = lambda w, x: torch.cat([kernels.gemv(w, x[i:i + GEMV_MAX_ROWS], int8_act=integer["act"])
                                             for i in range(0, len(x), GEMV_MAX_ROWS)])
    source = resolve_model("smollm2-135m-instruct")
    cfg = source.load_config()
    ids = load_tokenizer(source).encode(open(REFERENCE_TEXT).read())[:args.positions]
    runner = ModelRunner(source, cfg, start_layer=0, end_layer=cfg.num_layers, is_first=True, is_last=True,
                         dtype=torch.float32, device=torch.device("cpu"), num_blocks=-(-len(ids) // BLOCK),
                         num_host_blocks=0, block_size=BLOCK, quantization="auto")
    kinds = sorted({p.source for m in runner.model.modules() if isinstance(m, QuantLinear) for p in m.parts})
    print(f"isa {kernels.isa}, weights {', '.join(kinds)}, {len(ids)} positions, eps {args.eps:g}")
    noise = {"eps": 0.0, "seed": 0}
    perturb_row_parallel_outputs(runner, noise)
    base = log_probs(runner, ids)
    for trial in range(args.trials):
        noise.update(eps=args.eps, seed=1000 * (trial + 1))
        print(f"perturbed, trial {trial}: {distance(base, log_probs(runner, ids))}")
    noise["eps"], integer["act"] = 0.0, False
    print(f"float activations: {distance(log_probs(runner, ids), base)}")


if __name__ == "__main__":
    main()
