"""The planner's tensor-parallel terms: collective counts, the per-all-reduce latency, the
rank processes sharing a CPU's cores, and the TP validation rows (closed-form answers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeserve.plan import formulas
from pipeserve.plan.hardware import load_hardware
from pipeserve.plan.presets import load_model
from pipeserve.plan.roofline import BatchShape
from pipeserve.plan.stages import PipelineCosts
from pipeserve.plan.validate import main, tp_latency_rows


def test_collective_count_is_two_per_layer_plus_the_ends():
    assert formulas.tp_collectives(30, first=True, last=True) == 62     # SmolLM2 at PP = 1
    assert formulas.tp_collectives(15, first=True, last=False) == 31
    assert formulas.tp_collectives(15, first=False, last=True) == 31
    assert formulas.tp_collectives(4, first=False, last=False) == 8


def test_all_reduce_time_closed_form():
    # 2(T-1)/T * 100 B / 10 B/s, plus 2(T-1) ring latencies of 1 s when no call latency is set
    assert formulas.tp_allreduce_time(100.0, 2, 10.0, 1.0) == pytest.approx(10 + 2)
    # a measured per-call latency replaces the ring's: (T-1) * 0.5 s
    assert formulas.tp_allreduce_time(100.0, 2, 10.0, 1.0, 0.5) == pytest.approx(10 + 0.5)
    assert formulas.tp_allreduce_time(100.0, 4, 10.0, 1.0, 0.5) == pytest.approx(15 + 1.5)
    assert formulas.tp_allreduce_time(100.0, 1, 10.0, 1.0, 0.5) == 0.0


@pytest.mark.parametrize("pp", [1, 2])
def test_each_collective_pays_the_call_latency_once(pp):
    """Raising the per-all-reduce latency by d raises a chunk's time by exactly
    (2 * layers + embedding + logits gather) * d at T = 2."""
    _, cfg = load_model("SmolLM2-135M")
    hw = load_hardware("cpu-local")
    layers = [cfg.num_layers // pp] * pp
    shape = BatchShape.decode(3, 200)
    slow = PipelineCosts(cfg, replace(hw, tp_allreduce_latency=2e-3), layers, pp, tp=2)
    fast = PipelineCosts(cfg, replace(hw, tp_allreduce_latency=1e-3), layers, pp, tp=2)
    for chunk in range(pp):
        count = formulas.tp_collectives(layers[chunk], chunk == 0, chunk == pp - 1)
        assert slow.chunk_time(chunk, shape) - fast.chunk_time(chunk, shape) == pytest.approx(count * 1e-3)
    one = PipelineCosts(cfg, replace(hw, tp_allreduce_latency=2e-3), layers, pp, tp=1)
    assert one.chunk_time(0, shape) == PipelineCosts(cfg, hw, layers, pp, tp=1).chunk_time(0, shape)


def test_tp_ranks_share_a_cpus_cores():
    """cpu-local: P stages of T ranks are P * T processes on the node's cores."""
    _, cfg = load_model("SmolLM2-135M")
    hw = load_hardware("cpu-local")
    assert PipelineCosts(cfg, hw, [30], 1, tp=2).share == [2]
    assert PipelineCosts(cfg, hw, [15, 15], 2, tp=2).share == [4, 4]
    assert PipelineCosts(cfg, hw, [15, 15], 2, tp=1).share == [2, 2]


def test_tp_validation_rows(capsys):
    table = {r["label"]: r for r in tp_latency_rows("cpu-local")}
    assert len(table) == 4
    for r in table.values():
        assert r["predicted"] > 0 and r["ratio"] == pytest.approx(r["predicted"] / r["measured"])
    shm = table["TP=2, shared-memory all-reduce, 1 thread each"]
    gloo = table["TP=2, gloo all-reduce, 1 thread each"]
    # the rows differ only in the per-all-reduce latency: 62 collectives per token
    assert gloo["predicted"] - shm["predicted"] == pytest.approx(62 * (1.35 - 0.58))
    assert main(["--tp-latency", "--hardware", "cpu-local"]) == 0
    assert "| TP=2, gloo all-reduce, 1 thread each | 1 | 2 | 120.7 |" in capsys.readouterr().out


# -- the runtime's split --------------------------------------------------------------
def test_tp_costs_follow_the_runtimes_uneven_split():
    """SmolLM2 at T = 2: the runtime gives 6 + 3 q heads (2 + 1 KV heads) and 672 + 864 MLP
    rows; the planner prices the busiest rank with the same function (not T dividing 9)."""
    from pipeserve.model.tensor_parallel import plan_shard
    from pipeserve.plan.roofline import LayerCosts, tp_shards
    _, cfg = load_model("SmolLM2-135M")
    assert tp_shards(cfg, 2) == [plan_shard(cfg, r, 2) for r in range(2)]
    costs = LayerCosts(cfg, 2, tp=2)
    assert (costs.q_heads_per_rank, costs.kv_heads_per_rank) == (6, 2)
    h, d = cfg.hidden_size, cfg.head_dim
    busiest = max(h * d * 2 * (6 + 2) + 3 * h * 672, h * d * 2 * (3 + 1) + 3 * h * 864)
    assert costs.layer_fraction == pytest.approx(busiest / (costs.attn_params + costs.dense_mlp_params))
    assert 0.5 < costs.layer_fraction < 0.52        # the MLP rows rebalance the uneven heads
    shape = BatchShape.decode(4, 300)
    one = LayerCosts(cfg, 2)
    assert costs.attention(shape).flops == pytest.approx(one.attention(shape).flops * 6 / 9)
    assert costs.attention(shape).bytes == pytest.approx(one.attention(shape).bytes * 2 / 3)   # 2 of 3 KV heads
    # Time is paced per all-reduce segment: rank 0's attention half (6 + 2 heads), then
    # rank 1's MLP half (864 rows), each the slower rank's; memory is the fuller rank's layer.
    paced = (h * d * 2 * (6 + 2) + 3 * h * 864) / (costs.attn_params + costs.dense_mlp_params)
    assert costs.paced_fraction == pytest.approx(paced)
    assert costs.matmuls(shape).flops == pytest.approx(one.matmuls(shape).flops * paced)


@pytest.mark.parametrize("quant", [None, "q4_0", "q8_0", "int4"])
def test_tp_memory_is_the_busiest_ranks_share_at_the_formats_bytes(quant):
    """A stage's weights per rank at T = 2: the busiest rank's share of each layer and half
    the (padded) vocabulary, at the format's bytes per weight; the final norm on each rank."""
    from pipeserve.plan.memory import stage_weight_bytes
    from pipeserve.plan.quantization import weight_format
    _, cfg = load_model("SmolLM2-135M")
    hw = load_hardware("cpu-local")
    two = PipelineCosts(cfg, hw, [30], 1, tp=2, dtype="bfloat16", quantization=quant).costs
    per_weight = weight_format(quant).bytes if quant else 2
    head = weight_format(quant).head_bytes_for(cfg.hidden_size) if quant else 2
    layer = sum(map(cfg.layer_params, range(cfg.num_layers))) / cfg.num_layers
    want = (30 * layer * per_weight * two.layer_fraction + cfg.embedding_params() * head * 0.5
            + cfg.hidden_size * 2)   # tied: the embedding is the head (head bytes); 49152 rows split 2 ways
    assert stage_weight_bytes(cfg, two, 30, True, True) == pytest.approx(want)


def test_plan_runs_tp_that_does_not_divide_the_heads(capsys):
    from pipeserve.plan.__main__ import main as plan_main
    assert plan_main(["--model", "SmolLM2-135M", "--hardware", "cpu-local", "--tp", "2", "--num-prompts", "4"]) == 0
    assert "PP=1 x TP=2" in capsys.readouterr().out
    assert plan_main(["--model", "SmolLM2-135M", "--hardware", "cpu-local", "--tp", "10"]) == 2
    assert "too large for this model" in capsys.readouterr().err


def test_quantized_tp_cuts_fall_on_the_formats_blocks():
    """Llama-3.1-8B (32 heads of 128, 8 KV heads, 14336 MLP rows) at T = 3: the dense MLP
    cut moves onto 256-weight blocks for a K-quant mix and 32 for q4_0."""
    from pipeserve.plan.roofline import tp_shards
    _, cfg = load_model("Llama-3.1-8B")
    for block in (32, 256):
        for shard in tp_shards(cfg, 3, block):
            assert shard.intermediate[0] % block == 0 and shard.q_heads[0] * cfg.head_dim % block == 0
    assert [s.intermediate for s in tp_shards(cfg, 3, 256)] != [s.intermediate for s in tp_shards(cfg, 3)]


def test_collectives_are_not_scaled_by_the_fitted_engine_work():
    """The fitted engine_work_scale / engine_overhead_scale stretch the engine's own work;
    the all-reduces are timed as the runtime runs them, so they are added unscaled."""
    _, cfg = load_model("SmolLM2-135M")
    hw = load_hardware("cpu-local")
    scaled = replace(hw, engine_work_scale=2.0, engine_overhead_scale=1.5)
    shape = BatchShape.decode(8, 200)
    one, two = PipelineCosts(cfg, hw, [30], 1, tp=2), PipelineCosts(cfg, scaled, [30], 1, tp=2)
    gather = formulas.tp_allreduce_time(8 * cfg.vocab_size * 4 / 2, 2, hw.intra_node_bandwidth,
                                        hw.intra_node_latency / 2, hw.tp_allreduce_latency)
    collectives = one.collectives_time(0, shape)
    assert collectives == pytest.approx(61 * one.allreduce_time(shape) + gather)
    serial_one, parallel_one = one.chunk_work(0, shape)
    serial_two, parallel_two = two.chunk_work(0, shape)
    assert serial_two - collectives == pytest.approx(3.0 * (serial_one - collectives))
    assert parallel_two == pytest.approx(2.0 * parallel_one)
    assert two.chunk_time(0, shape) - collectives == pytest.approx(2.0 * (one.chunk_time(0, shape) - collectives))
