"""Fidelity of the 8-bit KV cache (``--kv-cache-dtype int8 | fp8``) against the model-dtype cache.

Teacher-forced top-1 agreement: the same text (Python's own LICENSE.txt, real
English prose shipped with every CPython) is fed to the built-in SmolLM2 GGUF
(bfloat16, weights as shipped) with a bfloat16 cache and with each 8-bit
cache, and the argmax of every position's logits is compared; perplexity and
the mean KL divergence from the bfloat16-cache distribution come alongside.
Two ways of feeding:

- ``prefill``: the whole text in one prefill (every query attends to the
  stored keys: the C prefill kernel reads the cache, the torch path attends to
  the K/V as stored);
- ``decode``: the text cut into ``--segments`` sequences run as one batch:
  each prefills its first ``--first-chunk`` tokens, then takes one token per
  step, every later position scored by the decode kernel reading the paged
  cache (as serving does); ``--positions`` decode positions in all.

``--noise-floor`` adds the float32 model (float32 cache) against the bfloat16
model's cache in the same mode: how much bfloat16 rounding alone moves the
argmax, for scale.

    PYTHONPATH=$PWD python benchmarks/kv_cache_fidelity.py --positions 600 --modes prefill,decode --noise-floor
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from pipeserve.model.loader import resolve_model
from pipeserve.tokenizer import load_tokenizer
from pipeserve.worker.model_runner import ModelRunner
from pipeserve.worker.step import SeqSampling, SeqStep, StepInput

TEXT_FILE = Path(os.__file__).parent / "LICENSE.txt"
BLOCK = 16
GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)


def make_runner(source, cfg, kv_cache_dtype: str, tokens: int, dtype: torch.dtype,
                backend: str = "auto", quantization: str = "auto") -> ModelRunner:
    return ModelRunner(source, cfg, start_layer=0, end_layer=cfg.num_layers, is_first=True, is_last=True,
                       dtype=dtype, device=torch.device("cpu"), num_blocks=-(-tokens // BLOCK) + 16,
                       num_host_blocks=0, block_size=BLOCK, attention_backend=backend,
                       kv_cache_dtype=kv_cache_dtype, quantization=quantization)


@torch.inference_mode()
def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits from one prefill."""
    table = list(range(-(-len(ids) // BLOCK)))
    hidden = runner._forward(StepInput(1, [SeqStep(0, ids, 0, table, GREEDY)]), None)
    return runner.model.compute_logits(hidden).float()


@torch.inference_mode()
def decode_logits(runner: ModelRunner, segments: list[list[int]], first: int) -> torch.Tensor:
    """[segments * (len - first), vocab]: per segment, the logits after each of its
    tokens first - 1 .. len - 2 (a prefill of ``first`` tokens, then one decode per
    token, the segments batched), in segment order."""
    per_seq = -(-len(segments[0]) // BLOCK)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(len(segments))]
    rows = [runner.forward_logits(StepInput(0, [SeqStep(s, seg[:first], 0, tables[s], GREEDY)
                                                for s, seg in enumerate(segments)]))]
    for p in range(first, len(segments[0]) - 1):
        rows.append(runner.forward_logits(StepInput(p, [SeqStep(s, [seg[p]], p, tables[s], GREEDY)
                                                        for s, seg in enumerate(segments)])))
    return torch.stack(rows, dim=1).flatten(0, 1).float()   # [segments, steps, vocab] -> segment order


def compare(test: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict:
    """Top-1 agreement, perplexities on the text, mean KL(ref || test) per position."""
    agree = (test.argmax(-1) == ref.argmax(-1)).float().mean().item()
    logp_ref, logp_test = torch.log_softmax(ref, -1), torch.log_softmax(test, -1)
    kl = (logp_ref.exp() * (logp_ref - logp_test)).sum(-1).mean().item()
    n = len(targets)
    ppl = lambda lp: math.exp(-lp[:n].gather(1, targets[:, None]).mean().item())   # noqa: E731
    return {"top1_agreement": agree, "positions": int(ref.shape[0]), "kl_mean": kl,
            "ppl": ppl(logp_test), "ppl_ref": ppl(logp_ref)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--positions", type=int, default=600)
    parser.add_argument("--kv-dtypes", default="int8,fp8")
    parser.add_argument("--modes", default="prefill,decode")
    parser.add_argument("--first-chunk", type=int, default=32, help="decode mode: tokens of the first prefill")
    parser.add_argument("--segments", type=int, default=8, help="decode mode: sequences decoded as one batch")
    parser.add_argument("--noise-floor", action="store_true",
                        help="also compare the float32 model against the bfloat16 one (both model-dtype caches)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    cfg = source.load_config()
    text = load_tokenizer(source).encode(TEXT_FILE.read_text())
    seg_len = args.first_chunk + -(-args.positions // args.segments)
    if len(text) < max(args.positions, args.segments * seg_len):
        raise SystemExit(f"{TEXT_FILE} has only {len(text)} tokens")
    ids = text[:args.positions]
    segments = [text[s * seg_len:(s + 1) * seg_len] for s in range(args.segments)]
    dtype = getattr(torch, args.dtype)
    runs = [("auto", dtype)] + [(kv, dtype) for kv in args.kv_dtypes.split(",")]
    if args.noise_floor:
        runs.append(("auto", torch.float32))
    results = []
    for mode in args.modes.split(","):
        logits = {}
        for kv, run_dtype in runs:
            name = kv if run_dtype == dtype else f"{kv} ({str(run_dtype)[6:]} model)"
            runner = make_runner(source, cfg, kv, args.segments * seg_len + len(ids), run_dtype)
            start = time.perf_counter()
            logits[name] = prefill_logits(runner, ids) if mode == "prefill" else \
                decode_logits(runner, segments, args.first_chunk)
            print(f"{mode:8} {name:5} {time.perf_counter() - start:6.1f} s", flush=True)
            del runner
        # Position i's logits predict token i + 1.
        if mode == "prefill":
            targets = torch.tensor(ids[1:])
        else:
            targets = torch.tensor([t for seg in segments for t in seg[args.first_chunk:]])
        for kv in [n for n in logits if n != "auto"]:
            row = {"mode": mode, "kv_cache_dtype": kv, "reference": f"{args.dtype} cache",
                   **compare(logits[kv], logits["auto"], targets)}
            results.append(row)
            print(f"{mode:8} {kv} vs {args.dtype} cache: top-1 agreement {row['top1_agreement']:.4f} over "
                  f"{row['positions']} positions, mean KL {row['kl_mean']:.2e}, perplexity {row['ppl']:.3f} "
                  f"(reference {row['ppl_ref']:.3f})", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "text": str(TEXT_FILE),
                                                 "results": results}, indent=2))


if __name__ == "__main__":
    main()
