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
