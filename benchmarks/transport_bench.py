"""Activation send latency and throughput between two processes on this host.

    PYTHONPATH=<tree> python benchmarks/transport_bench.py [--rounds N]

Rank 0 sends STEP messages (a ``StepEnvelope``: 16 decoding sequences, or one
prefill, plus its activation tensor) to rank 1, which echoes a small PONG: the
round trip is the latency of one pipeline hop + its answer. Then rank 0
streams the same activations and rank 1 acknowledges the last one: throughput.
It runs whichever transport the tree on PYTHONPATH has: our TCP transport, or
(at commit 54eb7d3 and before) torch.distributed gloo + pickle, so the two are
compared with the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

HIDDEN = 576           # SmolLM2-135M
SIZES = {"decode 16 tok bf16": (16, torch.bfloat16), "prefill 512 tok f32": (512, torch.float32),
         "prefill 4096 tok f32": (4096, torch.float32)}


def make_transport(rank: int, port: int, host: str = "127.0.0.1"):
    import pipeserve.comm.transport as tr
    if hasattr(tr, "TorchTransport"):        # the old gloo + pickle transport
        from pipeserve.comm.rendezvous import client_store, master_store
        if rank == 1:
            time.sleep(5)                    # the store's client gives up if the master is not up yet
        store = master_store(host, port, 2, 60) if rank == 0 else client_store(host, port, 60)
        return tr.TorchTransport(store, rank, 2, host), "gloo+pickle"
    from pipeserve.comm.messages import Hello
    from pipeserve.comm.tcp import TcpTransport
    t = TcpTransport(rank, 2, b"bench-key")
    if rank == 0:
        t.listen(host, port)
        t.recv(timeout=60)                      # rank 1's HELLO
    else:
        for _ in range(300):
            try:
                t.connect(0, host, port, Hello(1, os.getpid()))
                break
            except OSError:
                time.sleep(0.1)
    return t, "tcp+json"


def envelope(step_id: int, num_tokens: int):
    from pipeserve.pipeline.spec import StepEnvelope
    from pipeserve.worker.step import SeqSampling, SeqStep, StepInput
    greedy = SeqSampling(0.0, 1.0, 0, 0.0, None, 0)
    seqs = [SeqStep(i, [100 + i], 300 + i, list(range(i * 32, i * 32 + 20)), greedy) for i in range(16)]
    if num_tokens > 16:
        seqs = [SeqStep(0, list(range(num_tokens)), 0, list(range(num_tokens // 16 + 1)), greedy)]
    return StepEnvelope(StepInput(step_id, seqs), 1)


def sender(port: int, rounds: int) -> dict:
    from pipeserve.comm.transport import Kind
    t, name = make_transport(0, port)
    results = {"transport": name}
    for label, (tokens, dtype) in SIZES.items():
        hidden = torch.randn(tokens, HIDDEN).to(dtype)
        env = envelope(0, tokens)
        n = rounds if tokens <= 16 else max(5, rounds // (tokens // 16))
        rtts = []
        for _ in range(n):
            start = time.perf_counter()
            t.send(1, Kind.STEP, env, hidden)
            t.recv()
            rtts.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(n):
            t.send(1, Kind.TIMELINE, [], hidden)   # not answered
        t.send(1, Kind.PING, None)
        t.recv()
        elapsed = time.perf_counter() - start
        nbytes = hidden.numel() * hidden.element_size()
        results[label] = {"round_trip_us_median": statistics.median(rtts) * 1e6,
                          "stream_MBps": n * nbytes / elapsed / 1e6, "bytes": nbytes, "messages": n}
    t.send(1, Kind.STOP, None)
    return results


def receiver(port: int) -> None:
    from pipeserve.comm.transport import Kind
    t, _ = make_transport(1, port)
    while True:
        message = t.recv()
        if message.kind == Kind.STOP:
            break
        if message.kind in (Kind.STEP, Kind.PING):
            t.send(0, Kind.PONG, 0.0)
    time.sleep(0.5)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--receiver", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.receiver is not None:
        receiver(args.receiver)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = subprocess.Popen([sys.executable, __file__, "--receiver", str(port)])
    try:
        print(json.dumps(sender(port, args.rounds), indent=1))
    finally:
        peer.wait(timeout=30)
    os._exit(0)


if __name__ == "__main__":
    main()
