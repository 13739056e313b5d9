"""Partition math: uniform, manual, auto (costs, stage speeds, memory limits). No torch."""

from __future__ import annotations

import sys

import pytest

from pipeserve.config import EngineConfig
from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.part_costs import PartCosts
from pipeserve.pipeline.partition import (auto_partition, choose_partition, manual_partition,
                                          parse_stage_speeds, partition_for_config, stage_times,
                                          shape_costs, uniform_partition)

# SmolLM2-135M-like: the LM head costs about as much as eight decoder layers.
SMOL = PartCosts(embed=0.01, layer=1.0, head=8.0)


def counts(partition: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in partition]


def test_module_imports_no_torch() -> None:
    assert "pipeserve.pipeline.partition" in sys.modules
    import subprocess
    code = "import sys, pipeserve.pipeline.partition; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("layers,parts,expected", [
    (30, 2, [15, 15]), (30, 4, [8, 8, 7, 7]), (7, 3, [3, 2, 2]), (5, 5, [1] * 5), (30, 1, [30])])
def test_uniform_spreads_the_remainder(layers: int, parts: int, expected: list[int]) -> None:
    part = uniform_partition(layers, parts)
    assert counts(part) == expected
    assert part[0][0] == 0 and part[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(part, part[1:]))


def test_uniform_refuses_more_parts_than_layers() -> None:
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        uniform_partition(3, 4)


def test_manual_partition() -> None:
    assert manual_partition("19,11", 30, 2) == [(0, 19), (19, 30)]
    assert manual_partition("1, 2 ,3", 6, 3) == [(0, 1), (1, 3), (3, 6)]


@pytest.mark.parametrize("text,match", [
    ("19,12", "sums to 31 layers; the model has 30"),
    ("30", "has 1 counts; 2 pipeline chunks"),
    ("30,0", "at least one layer"),
    ("a,b", "one layer count per stage"),
])
def test_manual_partition_errors_name_the_numbers(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        manual_partition(text, 30, 2)


def test_auto_gives_the_head_stage_fewer_layers() -> None:
    part = auto_partition(30, 2, SMOL)
    c = counts(part)
    assert c[1] < c[0]
    assert c == [19, 11]          # 19 vs 11 + 8 = 19: perfectly balanced
    times = stage_times(part, SMOL)
    assert max(times) < max(stage_times(uniform_partition(30, 2), SMOL))


def test_auto_is_optimal_against_brute_force() -> None:
    costs = PartCosts(embed=2.5, layer=1.0, head=4.0)
    best = auto_partition(12, 3, costs)
    brute = min(max(stage_times([(0, a), (a, a + b), (a + b, 12)], costs))
                for a in range(1, 11) for b in range(1, 12 - a))
    assert max(stage_times(best, costs)) == pytest.approx(brute)


def test_auto_with_equal_costs_is_uniform() -> None:
    assert counts(auto_partition(12, 4, PartCosts(0.0, 1.0, 0.0))) == [3, 3, 3, 3]


def test_stage_speeds_shift_layers_to_the_fast_stage() -> None:
    flat = PartCosts(0.0, 1.0, 0.0)
    part = auto_partition(30, 2, flat, speeds=[1.0, 0.5])
    assert counts(part) == [20, 10]   # 20/1 == 10/0.5
    assert stage_times(part, flat, [1.0, 0.5]) == [20.0, 20.0]


def test_parse_stage_speeds() -> None:
    assert parse_stage_speeds("1,0.5", 2) == [1.0, 0.5]
    assert parse_stage_speeds(None, 3) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="2 positive numbers"):
        parse_stage_speeds("1,0", 2)
    with pytest.raises(ValueError, match="2 positive numbers"):
        parse_stage_speeds("1", 2)
    with pytest.raises(ValueError, match="one relative speed"):
        parse_stage_speeds("fast,slow", 2)


def test_memory_limit_caps_a_stage() -> None:
    costs = PartCosts(0.0, 1.0, 8.0, layer_bytes=100, head_bytes=0)
    # Unconstrained: [19, 11]. Stage 0 may hold at most 16 layers (1600 bytes).
    part = auto_partition(30, 2, costs, memory_limits=[1600, None])
    assert counts(part) == [16, 14]


def test_memory_limits_that_cannot_fit_raise() -> None:
    costs = PartCosts(0.0, 1.0, 0.0, layer_bytes=100, embed_bytes=1000)
    with pytest.raises(ValueError, match="fits the memory limits"):
        auto_partition(10, 2, costs, memory_limits=[500, 500])


def test_choose_partition_interleaved_has_p_times_v_chunks() -> None:
    part = choose_partition("uniform", 12, 2, virtual_stages=3)
    assert counts(part) == [2] * 6
    auto = choose_partition("auto", 12, 2, virtual_stages=2, costs=PartCosts(0.0, 1.0, 3.0))
    assert len(auto) == 4 and counts(auto)[-1] < counts(auto)[0]
    with pytest.raises(ValueError, match="needs layer costs"):
        choose_partition("auto", 12, 2)


def test_partition_for_config_manual_and_uniform() -> None:
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 30, 2, 1, 8, 64)
    assert partition_for_config(EngineConfig(pipeline_parallel_size=2, pp_partition="19,11"), cfg,
                                None) == [(0, 19), (19, 30)]
    part = partition_for_config(EngineConfig(pipeline_parallel_size=2, pp_schedule="interleaved",
                                             pp_virtual_stages=2, pp_partition="uniform"), cfg, None)
    assert counts(part) == [8, 8, 7, 7]


def test_measured_costs_on_smollm2_shapes_favour_a_light_head_stage(caplog) -> None:
    """Costs timed on this CPU with the real SmolLM2-135M shapes (random weights)."""
    import logging

    import torch

    from pipeserve.pipeline.costs import measure_layer_costs
    smol = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                       rope_theta=1e5, tie_word_embeddings=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        costs = measure_layer_costs(smol, torch.float32, repeats=5)
    finally:
        torch.set_num_threads(threads)
    print(f"SmolLM2 shapes, per prompt + generated token (8 decodes, 512 prompt tokens): embed {costs.embed * 1e3:.3f} ms, layer {costs.layer * 1e3:.3f} ms, "
          f"head {costs.head * 1e3:.3f} ms (head = {costs.head / costs.layer:.1f} layers)")
    assert costs.head > 3 * costs.layer > 0 and costs.embed > 0
    assert costs.layer_bytes == smol.layer_params() * 4 and costs.head_bytes == smol.head_params() * 4
    with caplog.at_level(logging.INFO, logger="pipeserve.pipeline.partition"):
        from pipeserve.pipeline.partition import log_partition
        part = auto_partition(30, 2, costs)
        log_partition(part, costs, None)
    assert counts(part)[1] < counts(part)[0]
    assert "predicted chunk loads" in caplog.text


def test_partition_for_config_auto_measures_and_balances() -> None:
    import torch
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=8192, hidden_size=64, intermediate_size=128, num_layers=8,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    part = partition_for_config(EngineConfig(pipeline_parallel_size=2, pp_partition="auto", threads_per_stage=1),
                                cfg, torch.float32)
    assert part[0][0] == 0 and part[-1][1] == 8 and len(part) == 2
    assert torch.get_num_threads() >= 1


def smollm2_like() -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def test_shape_costs_weigh_the_head_by_the_workload_mix() -> None:
    cfg = smollm2_like()
    per_token = cfg.active_layer_params()
    costs = shape_costs(cfg, 4)
    # Three tokens (two prompt, one generated) pass each layer per row through the head.
    assert costs.layer == 3 * per_token
    assert costs.head / costs.layer == pytest.approx(cfg.head_params() / (3 * per_token))
    assert shape_costs(cfg, 4, prompt_per_generated=0.0).head / per_token == pytest.approx(
        cfg.head_params() / per_token)
    assert costs.layer_bytes == cfg.layer_params() * 4


def test_balanced_gives_the_head_stage_fewer_layers() -> None:
    costs = shape_costs(smollm2_like(), 4)
    assert counts(choose_partition("balanced", 30, 2, costs=costs)) == [16, 14]
    assert counts(choose_partition("balanced", 30, 1, costs=costs)) == [30]
    with pytest.raises(ValueError, match="balanced needs layer costs"):
        choose_partition("balanced", 30, 2)


def test_balanced_is_the_default_and_needs_no_measurement() -> None:
    config = EngineConfig(pipeline_parallel_size=2)
    assert config.pp_partition == "balanced"
    assert counts(partition_for_config(config, smollm2_like(), _Dtype(4))) == [16, 14]


class _Dtype:
    """What ``partition_for_config`` reads of a torch dtype (this file runs without torch)."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize
