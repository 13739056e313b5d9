"""Every engine flag that would hang or crash the engine later is refused up front, naming the flag."""

from __future__ import annotations

import pytest

from pipeserve.config import EngineConfig

REFUSED = [
    ({"pp_max_inflight": -1}, "--pp-max-inflight"),
    ({"pp_max_inflight": 0}, "--pp-max-inflight"),
    ({"pp_micro_batches": 0}, "--pp-micro-batches"),
    ({"threads_per_stage": 0}, "--threads-per-stage"),
    ({"max_model_len": 0}, "--max-model-len"),
    ({"num_gpu_blocks_override": -3}, "--num-gpu-blocks-override"),
    ({"stage_timeout": 0}, "--stage-timeout"),
    ({"stage_timeout": -5.0}, "--stage-timeout"),
    ({"stage_timeout": float("inf")}, "--stage-timeout"),
    ({"rendezvous_timeout": 0}, "--rendezvous-timeout"),
    ({"nnodes": 0}, "--nnodes"),
    ({"nnodes": 2, "node_rank": 2}, "--node-rank"),
    ({"node_rank": -1}, "--node-rank"),
    ({"master_port": 70000}, "--master-port"),
    ({"device": "tpu"}, "--device"),
    ({"pp_virtual_stages": 0}, "--pp-virtual-stages"),
    ({"pp_virtual_stages": 2}, "--pp-virtual-stages"),   # only meaningful for interleaved
    ({"max_n": 0}, "--max-n"),
    ({"block_size": 0}, "--block-size"),
    ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"kv_cache_memory": "lots"}, "size"),
]


@pytest.mark.parametrize("kwargs,flag", REFUSED, ids=[next(iter(k)) + "=" + str(next(iter(k.values())))
                                                      for k, _ in REFUSED])
def test_bad_flag_is_refused_naming_it(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**kwargs)


def test_defaults_and_sensible_values_are_accepted() -> None:
    EngineConfig()
    EngineConfig(pp_max_inflight=4, stage_timeout=0.5, nnodes=2, node_rank=1, device="cuda:1",
                 pp_schedule="interleaved", pp_virtual_stages=2, max_n=1)


def test_cli_reports_a_bad_flag_without_a_traceback(capsys) -> None:
    from pipeserve.entrypoints.cli import main
    assert main(["generate", "--prompt", "x", "--pp-max-inflight", "-1"]) != 0
    err = capsys.readouterr().err
    assert "--pp-max-inflight" in err and "Traceback" not in err
