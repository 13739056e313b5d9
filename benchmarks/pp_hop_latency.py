"""What the pipeline runtime adds to one token: serial decode steps through stages that
compute nothing.

    PYTHONPATH=<tree> python benchmarks/pp_hop_latency.py [--pp 2 3] [--steps 400] [--hidden 576]
        [--compute-ms 5]

Each stage is a ``SleepRunner`` with no sleep, so a step's round trip (driver -> stage 0
-> ... -> last stage -> driver, one decode token of one sequence, ``hidden`` float32
activations) is the runtime alone: framing, sockets, thread hand-offs, the stage loop.
One request pays it on every token at PP > 1 and not at PP = 1 (the model runs in the
driver's process there). Prints the median and the 10th/90th percentiles per step and per
hop (P + 1 messages a step), and the same for a bare ping-pong of one socket between two
processes (the floor of one hop on this host).

``--compute-ms C``: each stage instead reads a 64 MiB buffer for C ms per step, so its core
is busy and its caches are cold when the next message comes, as in a real run (where
receiving and sending cost several times what they cost back to back); the figures are
then the step minus P x C, what the hops add.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time

import torch

from pipeserve.config import EngineConfig
from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.executor import PipelineExecutor
from pipeserve.pipeline.partition import uniform_partition
from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource
from pipeserve.worker.step import SeqSampling, SeqStep, StepInput


def pipeline_round_trips(pp: int, steps: int, hidden: int, compute_ms: float = 0.0) -> list[float]:
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=2 * pp, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=4096)
    conf = EngineConfig(pipeline_parallel_size=pp, dtype="float32", block_size=16, threads_per_stage=1,
                        stage_timeout=20.0, rendezvous_timeout=60.0)
    source = SyntheticSource(step_seconds=compute_ms / 1e3, stream_mib=64 if compute_ms else 0)
    ex = PipelineExecutor(conf, source, cfg, uniform_partition(cfg.num_layers, pp),
                          64, 0, runner_factory=SleepRunner)
    times = []
    try:
        for i in range(steps + 20):
            step = StepInput(i, [SeqStep(0, [i % 1000], 128 + i, list(range(16)), SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0))])
            start = time.perf_counter()
            ex.submit(step)
            while not ex.wait():
                pass
            if i >= 20:                        # warm-up: connections, first frames
                times.append(time.perf_counter() - start)
    finally:
        ex.shutdown()
    return times


def _echo(port: int, hidden: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(hidden * 4)
        while True:
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = sock.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            sock.sendall(buf)


def socket_round_trips(steps: int, hidden: int) -> list[float]:
    import multiprocessing
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    proc = multiprocessing.get_context("spawn").Process(target=_echo, args=(server.getsockname()[1], hidden))
    proc.start()
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, buf = bytes(hidden * 4), bytearray(hidden * 4)
    times = []
    for i in range(steps + 20):
        start = time.perf_counter()
        conn.sendall(payload)
        view, got = memoryview(buf), 0
        while got < len(buf):
            got += conn.recv_into(view[got:])
        if i >= 20:
            times.append(time.perf_counter() - start)
    conn.close()
    server.close()
    proc.join(5)
    return times


def summary(times: list[float], hops: int) -> str:
    q = statistics.quantiles(times, n=10)
    med = statistics.median(times)
    return (f"median {med * 1e3:.3f} ms (p10 {q[0] * 1e3:.3f}, p90 {q[-1] * 1e3:.3f}); "
            f"per hop {med / hops * 1e3:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--compute-ms", type=float, default=0.0, help="busy compute per stage and step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"socket ping-pong, 2 processes: {summary(socket_round_trips(args.steps, args.hidden), 2)}")
    for pp in args.pp:
        times = pipeline_round_trips(pp, args.steps, args.hidden, args.compute_ms)
        if args.compute_ms:
            times = [t - pp * args.compute_ms / 1e3 for t in times]
            print(f"PP={pp}, one decode step, minus {args.compute_ms:g} ms of compute per stage: "
                  f"{summary(times, pp + 1)}")
        else:
            print(f"PP={pp}, one decode step through stages that compute nothing: {summary(times, pp + 1)}")
    sys.stdout.flush()


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
