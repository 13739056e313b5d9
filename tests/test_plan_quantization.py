"""The planner's memory model with quantized weights: real bytes per weight, and
how many stages of a given memory a model needs."""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from pipeserve.plan.__main__ import main
from pipeserve.plan.analysis import PlanRequest, evaluate
from pipeserve.plan.hardware import load_hardware
from pipeserve.plan.presets import PlanInputError, load_model
from pipeserve.plan.quantization import WEIGHT_FORMATS, weight_format
from pipeserve.plan.recommend import fewest_stages, model_weight_bytes
from pipeserve.plan.roofline import BatchShape, LayerCosts

GB = 1e9


@pytest.mark.parametrize("name", ["q8_0", "q6_k", "q5_0", "q5_1", "q4_0", "q4_1"])
def test_block_types_match_ggml_block_sizes(name):
    weights, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]
    assert weight_format(name).bits == pytest.approx(8 * nbytes / weights)


def test_bits_per_weight():
    assert weight_format("Q4_0").bits == 4.5 and weight_format("q8_0").bits == 8.5
    q4km = weight_format("Q4_K_M")
    assert q4km.bits == 4.84 and q4km.head_bits == 6.5625   # mix average; head at Q6_K
    assert weight_format("q8_0").head_bits == 8.5
    # A Q6_K head needs rows of 256 weights: SmolLM2's 576 falls back to Q8_0 (the built-in file's)
    assert weight_format("q4_1").head_bytes_for(576) == 8.5 / 8
    assert weight_format("q4_1").head_bytes_for(4096) == 6.5625 / 8    # Q6_K held as its file holds it
    # What a stage holds: Q4_K_M's Q4_K with its two-level scales (sub-scales a byte each), its Q6_K as
    # the file holds it, ~1.02x the file; IQ4 as nibbles with a float16 scale per 32; Q3_K / Q2_K as
    # their file's bytes (Q3_K's 6-bit sub-scales a byte each), the mixes' Q4_K as Q4_K_M's
    assert q4km.bytes == pytest.approx(4.84 * 1.023 / 8, rel=1e-3) and weight_format("q4_0").bytes == 4.5 / 8
    assert weight_format("q4_k_s").bytes == pytest.approx(4.58 * 1.028 / 8, rel=1e-3)
    assert weight_format("iq4_xs").bits == 4.25 and weight_format("iq4_xs").bytes == 4.5 / 8
    assert weight_format("q3_k_m").bytes == pytest.approx(3.91 * 1.033 / 8, rel=1e-3)
    assert weight_format("q2_k").bytes == pytest.approx(3.35 * 1.006 / 8, rel=1e-3)
    # Q5_K as Q4_K: its two-level scales kept (5.625 bits against the file's 5.5)
    assert weight_format("q5_k_m").bytes == pytest.approx(5.68 * 1.020 / 8, rel=1e-3)
    assert weight_format("q5_k_s").bytes == pytest.approx(5.52 * 1.023 / 8, rel=1e-3)
    assert weight_format("int8").bits == 8.5 and weight_format("int4").bits == 5.0   # group 32, float16 scale (+ min)
    assert weight_format("bf16").bytes == 2 and weight_format("f32").head_bytes == 4
    with pytest.raises(PlanInputError, match="unknown --quantization 'q4_k_x'.*q4_k_m"):
        weight_format("q4_k_x")


@pytest.mark.parametrize("model,quant,published_gb", [
    ("Llama-3.1-70B", "q4_k_m", 42.5),   # Meta-Llama-3.1-70B-Instruct-Q4_K_M.gguf
    ("Llama-3.1-8B", "q4_k_m", 4.92),
    ("Llama-3.1-8B", "q8_0", 8.54),
    ("Llama-3.1-70B", "bf16", 141.1),
])
def test_whole_model_bytes_near_published_file_sizes(model, quant, published_gb, monkeypatch):
    """The file's bits give the published size; a stage holds the resident bits (Q4_K_M
    ~1.02x the file, the legacy types and dense ones as they are)."""
    _, cfg = load_model(model)
    req = PlanRequest(pp=1, quantization=quant)
    held = model_weight_bytes(cfg, load_hardware("L4"), req) / GB
    fmt = WEIGHT_FORMATS[quant]
    monkeypatch.setitem(WEIGHT_FORMATS, quant, dataclasses.replace(fmt, resident_bits=None, resident_head_bits=None))
    assert model_weight_bytes(cfg, load_hardware("L4"), req) / GB == pytest.approx(published_gb, rel=0.02)
    assert held == pytest.approx(published_gb * fmt.bytes * 8 / fmt.bits, rel=0.03)


def test_stage_weight_bytes_per_part():
    _, cfg = load_model("Llama-3.1-8B")
    req = PlanRequest(pp=2, partition="16,16", quantization="q8_0")
    first, last = evaluate(cfg, load_hardware("H100-SXM"), req).memory
    layers = 16 * cfg.layer_params() * 8.5 / 8
    assert first.weights == pytest.approx(layers + cfg.embedding_params() * 8.5 / 8)
    assert last.weights == pytest.approx(layers + cfg.hidden_size * 2 + cfg.vocab_size * cfg.hidden_size * 8.5 / 8)


def test_decode_reads_the_quantized_bytes():
    _, cfg = load_model("Llama-3.1-8B")
    shape = BatchShape.decode(1, 1024)
    bf16, q4 = LayerCosts(cfg, 2), LayerCosts(cfg, 2, weight_bytes=4.5 / 8, head_weight_bytes=6.5625 / 8)
    act = bf16.matmuls(shape).bytes - bf16.attn_params * 2 - bf16.expert_params * 2
    assert q4.matmuls(shape).bytes == pytest.approx((bf16.attn_params + bf16.expert_params) * 4.5 / 8 + act)
    assert q4.matmuls(shape).flops == bf16.matmuls(shape).flops
    assert q4.attention(shape).bytes == bf16.attention(shape).bytes   # the KV cache keeps the dtype


@pytest.mark.parametrize("quant,stages", [("q4_k_m", 3), ("q4_0", 3), ("int4", 3), ("q8_0", 4), ("bf16", 8)])
def test_fewest_stages_of_an_l4(quant, stages):
    _, cfg = load_model("llama-3.1-70b")
    hw = load_hardware("L4")   # 24 GiB, 21 GB usable
    req = PlanRequest(pp=1, quantization=quant)
    est = fewest_stages(cfg, hw, req)
    assert est is not None and est.fits and est.req.pp == stages
    fewer = dataclasses.replace(req, pp=stages - 1, partition="auto")
    assert not evaluate(cfg, hw, fewer).fits


def test_cli_says_how_many_stages(capsys):
    argv = ["--model", "llama-3.1-70b", "--quantization", "Q4_K_M", "--hardware", "L4", "--no-simulate"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "weights q4_k_m" in out and "Stages needed: 43.88 GB of weights -> at least PP=3 x TP=1" in out
    assert main([*argv, "--device-memory", "48GiB"]) == 0
    assert "at least PP=2 x TP=1" in capsys.readouterr().out
    assert main(["--model", "llama-3.1-70b", "--quantization", "q3", "--no-simulate"]) == 2
    assert "unknown --quantization 'q3'" in capsys.readouterr().err


def test_kept_quantized_weights_share_the_cores_at_their_own_efficiency():
    """quantized_parallel_efficiency (fitted where the calibration has kept-quantized runs at
    one and at several threads) is how a quantized stage's threads share its kernels; 0
    leaves the dense layer's calibrated efficiency; dense weights always use that one."""
    from pipeserve.plan.stages import PipelineCosts
    _, cfg = load_model("SmolLM2-135M")
    hw = dataclasses.replace(load_hardware("cpu-local"), parallel_efficiency=0.7)
    fitted = dataclasses.replace(hw, quantized_parallel_efficiency=0.95)
    assert PipelineCosts(cfg, fitted, [30], 1, quantization="q4_1").cpu_sharing().efficiency == 0.95
    assert PipelineCosts(cfg, fitted, [30], 1).cpu_sharing().efficiency == 0.7
    assert PipelineCosts(cfg, hw, [30], 1, quantization="q4_1").cpu_sharing().efficiency == 0.7
