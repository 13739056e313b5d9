"""One CUDA GPU: the engine on ``--device cuda`` at PP = 1.

- every kept quantized type dequantizes on the GPU to the CPU's values (issue 11: "the CUDA path
  at least dequantizes correctly on the device");
- a float32 tiny Llama decodes on the GPU as on the CPU (whose greedy output equals
  transformers', tests/test_engine_behaviour.py): compared as vLLM compares runs whose float
  order differs (``assert_logprobs_close``: equal tokens until they first part, and there each
  run's token among the other's top 5);
- the same for a GGUF kept quantized (Q8_0 with a Q4_0 attn_v), whose weights stay quantized on
  the GPU (the stage's resident weight bytes under half the float32 checkpoint's);
- bfloat16 on the GPU runs a batch to its length;
- the Triton kernels (pipeserve/model/quant/cuda_kernels.py) equal the reference for every kept
  type and the int8 / int4 layouts: the dequantized tile within float32 rounding, the gemv
  (one or a few rows) and dequantize-then-cuBLAS (more) within summation order, in float32,
  bfloat16 and float16.

Skipped, saying so, without a CUDA GPU: CI and the development machines have none, so these run
where the device tool lends one (``scripts/gpu_check.sh``). Tensor parallelism over several GPUs
is tests/test_tensor_parallel_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.quant.gguf_repack import KEPT_TYPES, repack
from pipeserve.model.quant import cuda_kernels as ck
from pipeserve.model.quant.packed import dequantize, quantize_weight
from tests.checkpoints import random_quant_blocks, write_llama_gguf
from tests.test_engine_behaviour import NEW, random_prompts
from tests.test_tensor_parallel_quant import TOP_LOGPROBS, assert_logprobs_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


def _greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=TOP_LOGPROBS)


def _run(model: str, prompts: list[list[int]], **kwargs):
    with LLM(model=model, kv_cache_memory="16MiB", **kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())]
        return outs, llm.stats()


def test_every_kept_type_dequantizes_on_the_gpu_to_the_cpus_values():
    rng = np.random.default_rng(0)
    for qtype in KEPT_TYPES:
        w = repack(qtype, random_quant_blocks(qtype, 8, 512, rng))
        want = dequantize(w)
        got = dequantize(w.map(lambda t: t.to("cuda")))
        assert got.device.type == "cuda", qtype.name
        assert torch.equal(got.cpu(), want), (qtype.name, (got.cpu() - want).abs().max().item())


def test_float32_decodes_on_the_gpu_as_on_the_cpu(tiny_checkpoints):
    path = str(tiny_checkpoints("llama_tied_gqa"))
    prompts = random_prompts(6, seed=3)
    cpu, _ = _run(path, prompts, dtype="float32")
    gpu, _ = _run(path, prompts, dtype="float32", device="cuda")
    assert_logprobs_close(cpu, gpu)


def test_kept_quantized_gguf_on_the_gpu(tiny_checkpoints, tmp_path):
    hf = tiny_checkpoints("llama_tied_gqa")
    gguf_path = write_llama_gguf(hf, tmp_path / "tiny-q8.gguf", qtype="Q8_0", qtypes={"attn_v": "Q4_0"})
    prompts = random_prompts(4, seed=4)
    args = dict(tokenizer=str(hf), dtype="float32", quantization="auto")   # the tiny GGUF holds no tokenizer
    cpu, _ = _run(str(gguf_path), prompts, **args)
    gpu, gpu_stats = _run(str(gguf_path), prompts, device="cuda", **args)
    dense = sum(f.stat().st_size for f in hf.glob("*.safetensors"))       # the float32 checkpoint
    assert sum(gpu_stats["weight_bytes"]) < 0.5 * dense, (gpu_stats["weight_bytes"], dense)   # kept as Q8_0 / Q4_0
    assert_logprobs_close(cpu, gpu)


def test_bfloat16_runs_a_batch_on_the_gpu(tiny_checkpoints):
    prompts = random_prompts(8, seed=5)
    outs, _ = _run(str(tiny_checkpoints("llama_tied_gqa")), prompts, dtype="bfloat16", device="cuda")
    assert [len(o.token_ids) for o in outs] == [NEW] * len(prompts)


def _kernel_cases():
    rng = np.random.default_rng(1)
    cases = [(t.name, repack(t, random_quant_blocks(t, 72, 768, rng))) for t in KEPT_TYPES]
    dense = torch.randn(72, 768, generator=torch.Generator().manual_seed(1)) * 0.05
    return cases + [("int8", quantize_weight(dense, 8, 64)), ("int4", quantize_weight(dense, 4, 32))]


def test_triton_kernels_equal_the_reference_for_every_kept_type():
    assert ck.cuda_kernels() is not None, "Triton is missing on the GPU machine: the kernels did not run"
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, w in _kernel_cases():
        gw = w.map(lambda t: t.to("cuda"))
        ref = dequantize(w).double()                                        # [72, 768]
        tile = ck.dequantize(gw, torch.float32).cpu().double()
        scale = ref.abs().max().item()
        assert (tile - ref).abs().max().item() <= 1e-6 * scale, (name, "dequantize")
        # the gemv (1 and 7 rows of x), then the dequantized weight and cuBLAS
        for m, fused in ((1, True), (7, True), (19, False)):
            x = torch.randn(m, w.in_features, device="cuda", generator=g)
            want = x.cpu().double() @ ref.T
            got = ck.matmul(gw, x, fused).cpu().double()
            err = (got - want).abs().max().item() / want.abs().max().item()
            assert err < 1e-5, (name, m, "float32", err)                     # IEEE float32, no TF32
            for dtype in (torch.bfloat16, torch.float16):
                xd = x.to(dtype)
                want = torch.nn.functional.linear(xd.float(), dequantize(gw, dtype).float())
                got = ck.matmul(gw, xd, fused)
                assert got.dtype == dtype
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), (name, m, dtype, err)   # output rounding
