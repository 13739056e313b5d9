"""Where transformers finds a model that pipeserve names: an HF dir or a GGUF file.

The benchmarks use transformers twice: for the tokenizer that sizes the
workload, and for the baseline backend. Both load the same sources as the
engine, so ``--model`` means the same thing everywhere.
"""

from __future__ import annotations


def hf_location(model: str) -> tuple[str, str | None]:
    """(directory, GGUF file name inside it or None) for ``from_pretrained``."""
    from pipeserve.model.loader import resolve_model
    source = resolve_model(model)
    return str(source.directory), source.gguf_file


def load_hf_tokenizer(model: str, tokenizer: str | None = None):
    from transformers import AutoTokenizer
    directory, gguf = hf_location(tokenizer or model)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf) if gguf else \
        AutoTokenizer.from_pretrained(directory)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # batching needs a pad id; its positions are masked out
    return tok


def load_hf_model(model: str, dtype: str, device: str = "cpu"):
    """transformers' model on ``device`` (the engine's: a CUDA run is compared with transformers on the GPU),
    in ``dtype``; ``auto`` is the engine's (``config.auto_dtype``: float32 on a CPU without native
    bfloat16, where both engines then compute in float32, as the report says)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeserve.config import auto_dtype
    torch_dtype = getattr(torch, auto_dtype(device) if dtype == "auto" else dtype)
    directory, gguf = hf_location(model)
    kwargs = {"gguf_file": gguf} if gguf else {}
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, **kwargs)
    return hf.to(device).eval()
