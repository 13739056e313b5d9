"""Whole models with quantized weights: the built-in SmolLM2 GGUF kept as shipped
against its dequantized float32 self, and int8/int4 of a tiny safetensors model."""

from __future__ import annotations

import math

import pytest
import torch

from pipeserve.model.loader import resolve_model
from pipeserve.model.quant.cpu_kernels import GEMV_MAX_ROWS, PROMPT_INT8_KINDS, cpu_kernels
from pipeserve.model.quant.modules import QuantEmbedding, QuantLinear
from pipeserve.worker.model_runner import ModelRunner
from pipeserve.worker.step import SeqSampling, SeqStep, StepInput
from tests.checkpoints import build_checkpoint

BLOCK = 16
POSITIONS = 600     # of the reference text (tests/conftest.py)


def _runner(source, quantization: str, cfg=None, blocks: int = 48, dtype=torch.float32) -> ModelRunner:
    cfg = cfg or source.load_config()   # reading a GGUF's metadata takes seconds: pass it when known
    return ModelRunner(source, cfg, start_layer=0, end_layer=cfg.num_layers, is_first=True, is_last=True,
                       dtype=dtype, device=torch.device("cpu"), num_blocks=blocks, num_host_blocks=0,
                       block_size=BLOCK, quantization=quantization)


@torch.inference_mode()
def _all_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] from one prefill."""
    table = list(range(-(-len(ids) // BLOCK)))
    sampling = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)
    hidden = runner._forward(StepInput(1, [SeqStep(0, ids, 0, table, sampling)]), None)
    return runner.model.compute_logits(hidden)


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.fixture(scope="module")
def smollm2(smollm2_text):
    source, cfg, ids = smollm2_text
    assert len(ids) >= POSITIONS
    return source, cfg, ids[:POSITIONS]


@pytest.fixture(scope="module")
def dense_logits(smollm2) -> torch.Tensor:
    """The dequantized float32 model's teacher-forced logits: the reference both kept paths meet."""
    source, cfg, ids = smollm2
    return _all_logits(_runner(source, "none", cfg), ids)


def test_kept_smollm2_agrees_with_dequantized_float32(smollm2, dense_logits):
    source, cfg, ids = smollm2
    kept = _runner(source, "auto", cfg)
    assert any(isinstance(m, QuantLinear) for m in kept.model.modules())
    assert isinstance(kept.model.embed_tokens, QuantEmbedding)
    # Resident weights ≈ the file: ≤ 1.25 x its size (the tied head shares the embedding).
    assert kept.weight_bytes <= 1.25 * source.path.stat().st_size, kept.weight_bytes
    kept_logits = _all_logits(kept, ids)
    assert kept_logits.shape == (POSITIONS, cfg.vocab_size)
    agree = (kept_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean().item()
    ppl_kept, ppl_dense = _perplexity(kept_logits, ids), _perplexity(dense_logits, ids)
    print(f"top-1 agreement {agree:.4f} over {POSITIONS} positions; perplexity kept {ppl_kept:.3f} "
          f"dense {ppl_dense:.3f}")
    assert agree >= 0.98, agree
    assert abs(ppl_kept / ppl_dense - 1) <= 0.02, (ppl_kept, ppl_dense)


def test_kept_smollm2_decode_kernel_with_int8_activations_agrees(smollm2, dense_logits, monkeypatch):
    """The decode kernel's integer-activation path (VNNI or AVX2) over every position: each
    matmul runs as decode does, in chunks of at most GEMV_MAX_ROWS rows; in bfloat16 where
    the CPU computes in it natively (VNNI machines), else in float32 (AVX2 ones)."""
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_integer_activations:
        pytest.skip("integer activations need the C kernel built with AVX512-VNNI or AVX2 + FMA + F16C")
    dtype = torch.bfloat16 if kernels.isa == "avx512-vnni" else torch.float32
    source, cfg, ids = smollm2

    def decode_shaped(w, x):   # [M, K] -> [M, N], through gemv only
        assert kernels.int8_activations(w, x[:GEMV_MAX_ROWS]), (w.source, x.dtype)
        return torch.cat([kernels.gemv(w, x[i:i + GEMV_MAX_ROWS]) for i in range(0, len(x), GEMV_MAX_ROWS)])

    monkeypatch.setattr(kernels, "matmul", decode_shaped)
    kept_logits = _all_logits(_runner(source, "auto", cfg, dtype=dtype), ids).float()
    agree = (kept_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean().item()
    ppl_kept, ppl_dense = _perplexity(kept_logits, ids), _perplexity(dense_logits, ids)
    print(f"int8 activations: top-1 agreement {agree:.4f}; perplexity kept {ppl_kept:.3f} dense {ppl_dense:.3f}")
    assert agree >= 0.98, agree
    assert abs(ppl_kept / ppl_dense - 1) <= 0.02, (ppl_kept, ppl_dense)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int8_int4_of_a_safetensors_model(mode, tmp_path):
    source = resolve_model(str(build_checkpoint("qwen2_bias", tmp_path)))
    dense, quant = _runner(source, "none", blocks=8), _runner(source, mode, blocks=8)
    assert quant.weight_bytes < (0.45 if mode == "int8" else 0.3) * dense.weight_bytes
    ids = list(range(3, 40))
    ref, got = _all_logits(dense, ids), _all_logits(quant, ids)
    # Round-to-nearest weight error, relative to the logits' spread.
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < (0.02 if mode == "int8" else 0.2), rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= (0.95 if mode == "int8" else 0.6)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_five_bit_gguf_stage_stays_at_its_file_size(qtype, tmp_path):
    """A stage of a tiny GGUF whose matrices are 5-bit holds about the file's bytes (the
    codes as nibbles + high-bit planes; a byte per code would be 34 / 22 or 36 / 24 of
    them), and computes what its dequantized float32 self does."""
    import gguf

    from tests.checkpoints import write_llama_gguf
    path = write_llama_gguf(build_checkpoint("llama_tied_gqa", tmp_path / "hf"), tmp_path / "m.gguf", qtype)
    file_tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    source = resolve_model(str(path))
    kept, dense = _runner(source, "auto", blocks=8), _runner(source, "none", blocks=8)
    assert any(isinstance(m, QuantLinear) and m.sources == [qtype] for m in kept.model.modules())
    print(f"{qtype}: resident {kept.weight_bytes} B, file tensors {file_tensor_bytes} B")
    assert kept.weight_bytes <= 1.01 * file_tensor_bytes, (kept.weight_bytes, file_tensor_bytes)
    ids = list(range(3, 40))
    ref, got = _all_logits(dense, ids), _all_logits(kept, ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    kernels = cpu_kernels()
    if kernels is not None and kernels.isa == "avx2" and "q5" in PROMPT_INT8_KINDS:
        # The prompt's rows take int8 activations, as a decode does (2 % measured on this tiny model).
        assert rel < 0.05, rel
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    else:                   # the tiles: the dequantized weights, exactly
        assert rel < 1e-5, rel


def test_the_cuda_path_is_chosen_by_name_and_a_wrong_name_is_refused(monkeypatch):
    """``PIPESERVE_CUDA_QUANT`` (cuda_kernels.py): ``torch`` keeps PyTorch's ops, a typo says what
    it takes; the Triton kernels themselves run on a GPU only (tests/test_cuda.py)."""
    from pipeserve.model.quant import cuda_kernels as ck
    try:
        monkeypatch.setenv("PIPESERVE_CUDA_QUANT", "torch")
        ck.cuda_kernels.cache_clear()
        assert ck.cuda_kernels() is None
        monkeypatch.setenv("PIPESERVE_CUDA_QUANT", "trition")
        ck.cuda_kernels.cache_clear()
        with pytest.raises(ValueError, match="expected 'triton' or 'torch'"):
            ck.cuda_kernels()
        monkeypatch.delenv("PIPESERVE_CUDA_QUANT")
        ck.cuda_kernels.cache_clear()
        kernels = ck.cuda_kernels()
        assert (kernels is None) == (ck.triton is None)
        if kernels is not None:   # a CPU tensor never takes the GPU's kernels
            assert not kernels.applies(torch.zeros(2, 32))
    finally:
        ck.cuda_kernels.cache_clear()
