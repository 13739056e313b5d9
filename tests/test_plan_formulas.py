"""The planner's formulas and roofline against hand-computed values."""

from __future__ import annotations

import math

import pytest

from pipeserve.plan import formulas
from pipeserve.plan.analysis import PlanRequest, evaluate
from pipeserve.plan.hardware import load_hardware, parse_quantity
from pipeserve.plan.presets import PlanInputError, load_model
from pipeserve.plan.roofline import BatchShape, LayerCosts, ring_allreduce_time


def test_pipeline_efficiency_hand_value() -> None:
    # N=4, P=2, t=1, t_comm=0.5: 4 / (4 + 1 + 0.5)
    assert formulas.pipeline_efficiency(4, 2, 1.0, 0.5) == pytest.approx(4 / 5.5)
    assert formulas.pipeline_efficiency(3, 1, 2.0, 9.0) == pytest.approx(1.0)


def test_best_micro_batch_argmin() -> None:
    # t_fwd(B) = 1 + 0.1·B, t_comm(B) = 0.2·B, P = 2: cost(B) = (2 + 0.4B)/B, min at the largest B
    b, cost = formulas.best_micro_batch(2, lambda b: 1 + 0.1 * b, lambda b: 0.2 * b, [1, 2, 4, 8])
    assert (b, cost) == (8, pytest.approx((2 + 3.2) / 8))
    # A superlinear forward makes the middle size best: t_fwd = 1 + B², cost = 2(1+B²)/B, min at B=1
    b, _ = formulas.best_micro_batch(2, lambda b: 1 + b * b, lambda b: 0.0, [1, 2, 4])
    assert b == 1


def test_throughput_gain_and_kv_memory() -> None:
    assert formulas.throughput_gain(4, 0.8, 0.1) == pytest.approx(4 * 0.8 / 1.3)
    # Llama-3.1-8B: 2·32·8·128·B=1·S=1·2 bytes = 131072 bytes per token
    assert formulas.kv_memory(32, 8, 128, 1, 1, 2) == 131072
    assert formulas.kv_memory(32, 8, 128, 4, 1000, 2) == 131072 * 4000


def test_latency_terms() -> None:
    assert formulas.request_latency(1.0, 2.0, 3.0, 0.5) == 6.5
    assert formulas.decode_time(11, 4, 0.01) == pytest.approx(10 * 4 * 0.01)
    # M/D/1: rho = 0.5, s = 1: 0.5 / (2·0.5) = 0.5
    assert formulas.md1_queue_wait(0.5, 1.0) == pytest.approx(0.5)
    assert math.isinf(formulas.md1_queue_wait(2.0, 1.0))


def test_roofline_layer_counts_smollm2() -> None:
    _, model = load_model("smollm2-135m")
    costs = LayerCosts(model, dtype_bytes=2)
    shape = BatchShape.decode(batch=1, context=0)
    h, i, q, kv = 576, 1536, 576, 192
    params = 2 * h * q + 2 * h * kv + 3 * h * i
    assert costs.layer(shape).flops == pytest.approx(2 * params)
    # one token with no context: weights + activations + its own KV write
    act = 6 * h + 2 * q + 2 * kv + 4 * i
    assert costs.layer(shape).bytes == pytest.approx((params + act) * 2 + 2 * kv * 2)
    # ... split into the matmul part (weights + activations) and attention (its own KV row)
    assert costs.matmuls(shape).flops == pytest.approx(2 * params)
    assert costs.matmuls(shape).bytes == pytest.approx((params + act) * 2)
    assert costs.attention(shape).flops == 0.0
    assert costs.attention(shape).bytes == pytest.approx(2 * kv * 2)
    assert costs.head(shape).flops == pytest.approx(2 * h * 49152)


def test_moe_reads_only_touched_experts() -> None:
    _, mixtral = load_model("mixtral-8x7b")
    costs = LayerCosts(mixtral, 2)
    assert costs.experts_touched(1) == pytest.approx(2.0)
    assert costs.experts_touched(1000) == pytest.approx(8.0)


def test_allreduce_and_units() -> None:
    assert ring_allreduce_time(100.0, 4, 10.0, 1.0) == pytest.approx(2 * 3 / 4 * 10 + 6)
    assert ring_allreduce_time(100.0, 1, 10.0, 1.0) == 0.0
    assert parse_quantity("400Gb/s", "x") == pytest.approx(50e9)
    assert parse_quantity("80GiB", "x") == 80 * 2**30
    assert parse_quantity("5us", "x") == pytest.approx(5e-6)
    with pytest.raises(PlanInputError):
        parse_quantity("fast", "x")


def test_planner_partitions_with_the_runtimes_partitioner() -> None:
    from pipeserve.pipeline.partition import min_max_split
    # The last part carries a head worth 8 layers: it gets fewer layers.
    counts = min_max_split(30, 2, lambda part, start, end: end - start + (8 if part == 1 else 0))
    assert counts == [19, 11]
    # The last part capped at 10 layers (memory): the cap wins over balance; nothing fits: None.
    capped = min_max_split(30, 2, lambda part, start, end: math.inf if end - start > 10 and part == 1
                           else end - start + (8 if part == 1 else 0))
    assert capped == [20, 10]
    assert min_max_split(30, 2, lambda part, start, end: math.inf if end - start > 14 else 1.0) is None
    _, smol = load_model("SmolLM2-135M")
    hw = load_hardware("cpu-local")
    assert evaluate(smol, hw, PlanRequest(pp=4, partition="uniform")).chunk_layers == [8, 8, 7, 7]
    assert evaluate(smol, hw, PlanRequest(pp=2, partition="20,10")).chunk_layers == [20, 10]
    # balanced: the engine's default, so a recorded run's "balanced" is planned as it ran
    assert evaluate(smol, hw, PlanRequest(pp=2, partition="balanced")).chunk_layers == [16, 14]
    with pytest.raises(PlanInputError, match="cannot split 30 layers into 32 pipeline chunks.*--pp or"):
        evaluate(smol, hw, PlanRequest(pp=32, partition="uniform"))
    with pytest.raises(PlanInputError, match="--partition '20,9' sums to 29 layers"):
        evaluate(smol, hw, PlanRequest(pp=2, partition="20,9"))


def test_presets_case_insensitive() -> None:
    assert load_hardware("h100-sxm").name == "H100-SXM"
    assert load_model("LLAMA-3.1-405b")[1].num_layers == 126
    with pytest.raises(PlanInputError, match="unknown hardware preset"):
        load_hardware("tpu-v9")


def test_stage_compute_share_models_threading_loss():
    from pipeserve.plan.hardware import load_hardware
    import dataclasses
    base = dataclasses.replace(load_hardware("cpu-local"), cores=4, parallel_efficiency=0.5)
    # One stage with 4 cores at e = 0.5: 1 + 3 * 0.5 = 2.5 cores' worth of 4.
    assert base.stage_compute_share(1) == pytest.approx(2.5 / 4)
    # Two stages, 2 cores each: (1 + 0.5) / 4 each.
    assert base.stage_compute_share(2) == pytest.approx(1.5 / 4)
    # More stages than cores: time-sliced, an equal slice each, no threading loss.
    assert base.stage_compute_share(8) == pytest.approx(1 / 8)
    linear = dataclasses.replace(base, parallel_efficiency=1.0)
    assert linear.stage_compute_share(2) == pytest.approx(0.5)


def test_kv_read_amplification_scales_only_the_kv_bytes():
    from pipeserve.plan.presets import load_model
    from pipeserve.plan.roofline import BatchShape, LayerCosts
    _, cfg = load_model("smollm2-135m")
    shape = BatchShape.decode(8, 256)
    one = LayerCosts(cfg, 2).layer(shape)
    three = LayerCosts(cfg, 2, kv_read_amplification=3.0).layer(shape)
    kv = (shape.kv_tokens + shape.new_tokens) * LayerCosts(cfg, 2).kv_bytes_per_token_layer()
    assert three.bytes - one.bytes == pytest.approx(2 * kv)
    assert three.flops == one.flops


def test_attention_costs_hand_values():
    _, cfg = load_model("smollm2-135m")
    # 4 sequences decoding at context 100: 400 pairs; reads 4·100 cached + 4 new KV rows.
    shape = BatchShape.decode(4, 100)
    costs = LayerCosts(cfg, 2, kv_read_amplification=5.0)
    kv_row = 2 * 3 * 64 * 2   # K and V, 3 KV heads of 64, bf16
    assert costs.attention(shape).flops == pytest.approx(4 * 400 * 576)
    assert costs.attention(shape).bytes == pytest.approx(5.0 * 404 * kv_row)
    # A prompt of 8 fresh tokens: 8·9/2 causal pairs.
    assert LayerCosts(cfg, 2).attention(BatchShape.prefill(1, 8)).flops == pytest.approx(4 * 36 * 576)


def test_layer_time_is_overhead_plus_matmul_plus_attention_terms():
    import dataclasses

    from pipeserve.plan.hardware import Hardware
    from pipeserve.plan.stages import PipelineCosts
    _, cfg = load_model("smollm2-135m")
    hw = Hardware(name="t", flops_prefill=1e11, flops_decode=1e11, mem_bandwidth=1e10, mem_bytes=1e10,
                  gpus_per_node=1, intra_node_bandwidth=1e9, intra_node_latency=1e-5,
                  inter_node_bandwidth=1e9, inter_node_latency=1e-5, layer_overhead=50e-6,
                  dtype="bfloat16", kv_read_amplification=4.0)
    costs = PipelineCosts(cfg, hw, [cfg.num_layers], 1)
    shape = BatchShape.decode(64, 1024)
    mm, attn = costs.costs.matmuls(shape), costs.costs.attention(shape)
    mm_term = max(mm.flops / 1e11, mm.bytes / 1e10)
    attn_term = max(attn.flops / 1e11, attn.bytes / 1e10)
    assert mm_term == pytest.approx(mm.flops / 1e11)      # 64 decodes: matmuls compute-bound
    assert attn_term == pytest.approx(attn.bytes / 1e10)  # long context: attention memory-bound
    assert costs.layer_time(shape) == pytest.approx(50e-6 + mm_term + attn_term)
    # The sum, not one roofline of the totals: it is larger than max(total FLOPs, total bytes).
    total = costs.costs.layer(shape)
    assert costs.layer_time(shape) > 50e-6 + max(total.flops / 1e11, total.bytes / 1e10) * 1.01
    # Attention grows with the context, the matmul term does not.
    longer = BatchShape.decode(64, 2048)
    grow = costs.layer_time(longer) - costs.layer_time(shape)
    assert grow == pytest.approx(64 * 1024 * 2 * 3 * 64 * 2 * 4.0 / 1e10)
    free = PipelineCosts(cfg, dataclasses.replace(hw, layer_overhead=0.0), [cfg.num_layers], 1)
    assert free.layer_time(shape) == pytest.approx(mm_term + attn_term)
