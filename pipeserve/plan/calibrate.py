"""``pipeserve plan --calibrate``: measure this machine and write a hardware file.

torch is imported lazily here and nowhere else in the planner. Measures: matmul
FLOP/s at a decoder layer's decode and prefill shapes, memory bandwidth (large
copy), the fixed per-layer dispatch overhead, and a loopback gloo point-to-point
link between two processes (latency from tiny messages, bandwidth from big ones).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path

from pipeserve.model.config import ModelConfig
from pipeserve.plan.hardware import GIB, Hardware
from pipeserve.plan.presets import MODEL_PRESETS
from pipeserve.plan.roofline import DECODE_TOKENS, PREFILL_TOKENS

_P2P_SIZES = (8, 4 * 1024**2)  # bytes: latency probe, bandwidth probe
_DTYPES = ("float32", "bfloat16")


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _layer_weights(torch, model: ModelConfig, dtype) -> list:
    h = model.hidden_size
    shapes = [(h, model.q_size + 2 * model.kv_size), (model.q_size, h),
              (h, 2 * model.intermediate_size), (model.intermediate_size, h)]
    return [torch.randn(k, n, dtype=dtype) * 0.02 for k, n in shapes]


def measure_matmul_flops(torch, model: ModelConfig, dtype, tokens: int) -> float:
    """FLOP/s of a decoder layer's four matmuls for ``tokens`` rows."""
    weights = _layer_weights(torch, model, dtype)
    inputs = [torch.randn(tokens, w.shape[0], dtype=dtype) for w in weights]
    flops = sum(2 * tokens * w.shape[0] * w.shape[1] for w in weights)
    repeats = 20 if tokens <= DECODE_TOKENS else 5

    def run() -> None:
        for x, w in zip(inputs, weights):
            torch.matmul(x, w)
    return flops / _timed(run, repeats)


def measure_parallel_efficiency(torch, model: ModelConfig, dtype, cores: int) -> float:
    """How much of a linear speed-up one process gets from ``cores`` threads on a
    decode-shaped layer: e in 1 + (cores - 1)·e."""
    if cores < 2:
        return 1.0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = measure_matmul_flops(torch, model, dtype, DECODE_TOKENS)
        torch.set_num_threads(cores)
        many = measure_matmul_flops(torch, model, dtype, DECODE_TOKENS)
    finally:
        torch.set_num_threads(threads)
    return min(1.0, max(0.0, (many / one - 1.0) / (cores - 1)))


def measure_kv_amplification(torch, model: ModelConfig, dtype, bandwidth: float,
                             seqs: int = 64, context: int = 256, block_size: int = 16) -> float:
    """Memory traffic per attended KV byte of a decode step done the way the
    PyTorch CPU backend does it: gather whole blocks (a copy), then two batched
    matmuls over the copy. Plain torch ops of those shapes, no runtime import."""
    kv, d, heads = model.num_kv_heads, model.head_dim, model.num_heads
    blocks = -(-context // block_size)
    cache = [torch.randn(seqs * blocks * 2, block_size * kv * d).to(dtype) for _ in range(2)]
    index = torch.randperm(seqs * blocks * 2)[: seqs * blocks]
    q = torch.randn(seqs, heads, d).to(dtype)
    ctx = blocks * block_size

    def attend():
        k = cache[0].index_select(0, index).view(seqs, ctx * kv, d)
        v = cache[1].index_select(0, index).view(seqs, ctx, kv * d)
        scores = torch.bmm(q, k.transpose(1, 2)).view(seqs, heads, ctx, kv)
        return torch.bmm(scores.sum(-1).softmax(-1), v)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = _timed(attend, 5)
    finally:
        torch.set_num_threads(threads)
    attended = 2 * seqs * ctx * kv * d * (torch.tensor([], dtype=dtype).element_size())
    return max(1.0, seconds * bandwidth / attended)


def measure_bandwidth(torch, nbytes: int = 256 * 1024**2) -> float:
    """Bytes/s of a large copy (a read and a write of every byte)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), 5)


def measure_layer_overhead(torch, dtype) -> float:
    """Seconds of a decoder layer's op sequence on tiny tensors: pure dispatch cost."""
    tiny = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8,
                       intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=8, max_position_embeddings=8)
    wqkv, wo, wgu, wd = _layer_weights(torch, tiny, dtype)
    k_cache = torch.randn(1, 1, 4, 8, dtype=dtype)
    v_cache = torch.randn(1, 1, 4, 8, dtype=dtype)
    x = torch.randn(1, 8, dtype=dtype)
    norm = torch.ones(8, dtype=dtype)

    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * norm

    def layer() -> None:
        qkv = rms(x) @ wqkv                                  # [1, q + 2kv]
        q = qkv[:, :8].view(1, 1, 1, 8)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache)
        y = x + attn.reshape(1, -1) @ wo                     # [1, hidden]
        gate, up = (rms(y) @ wgu).chunk(2, dim=-1)
        _ = y + (torch.nn.functional.silu(gate) * up) @ wd
    return _timed(layer, 200)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _p2p_worker(rank: int, port: int, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    timings = {}
    for nbytes in _P2P_SIZES:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        samples = []
        for i in range(repeats + 2):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 2:  # the first round trips set up the connection
                samples.append(time.perf_counter() - start)
        # Lower quartile: a busy shared machine adds long scheduler stalls to some round trips.
        timings[nbytes] = statistics.quantiles(samples, n=4)[0] / 2  # one way
    if rank == 0:
        results.put(timings)
    dist.barrier()
    dist.destroy_process_group()


def measure_gloo_link(repeats: int = 60, timeout: float = 60.0) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of loopback gloo send/recv between two processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, repeats, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    timings = results.get(timeout=timeout)
    for proc in procs:
        proc.join(timeout=timeout)
    small, large = _P2P_SIZES
    latency = timings[small]
    bandwidth = large / max(timings[large] - latency, 1e-9)
    return bandwidth, latency


def calibrate(dtype: str = "float32", model: ModelConfig | None = None,
              log=print) -> Hardware:
    """Measure this machine; the model's shapes (default SmolLM2-135M) set the matmul sizes."""
    import torch
    if dtype not in _DTYPES:
        raise ValueError(f"calibration dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    model = model or ModelConfig.from_hf_dict(MODEL_PRESETS["SmolLM2-135M"])
    tdtype = getattr(torch, dtype)
    started = time.perf_counter()
    # The runtime gives each stage cores // P threads; measure one core and scale by
    # the core count, so that a stage's share (shared_compute) is one core's worth.
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    decode = measure_matmul_flops(torch, model, tdtype, DECODE_TOKENS)
    prefill = measure_matmul_flops(torch, model, tdtype, PREFILL_TOKENS)
    torch.set_num_threads(threads)
    log(f"matmul per core: decode {decode / 1e9:.1f} GFLOP/s, prefill {prefill / 1e9:.1f} GFLOP/s")
    bandwidth = measure_bandwidth(torch)
    log(f"memory bandwidth: {bandwidth / 1e9:.2f} GB/s")
    torch.set_num_threads(1)
    overhead = measure_layer_overhead(torch, tdtype)
    torch.set_num_threads(threads)
    log(f"per-layer dispatch overhead: {overhead * 1e6:.1f} us")
    efficiency = measure_parallel_efficiency(torch, model, tdtype, cores)
    log(f"parallel efficiency of {cores} threads in one stage: {efficiency:.2f}")
    amplification = measure_kv_amplification(torch, model, tdtype, bandwidth / cores)
    log(f"KV read amplification of the CPU attention backend: {amplification:.2f}x")
    link_bw, link_lat = measure_gloo_link()
    log(f"gloo loopback: latency {link_lat * 1e6:.1f} us, bandwidth {link_bw / 1e9:.2f} GB/s")
    log(f"calibration took {time.perf_counter() - started:.1f} s ({cores} cores)")
    return Hardware(
        name="cpu-local", flops_prefill=prefill * cores, flops_decode=decode * cores, mem_bandwidth=bandwidth,
        mem_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        gpus_per_node=64, intra_node_bandwidth=link_bw, intra_node_latency=link_lat,
        inter_node_bandwidth=link_bw, inter_node_latency=link_lat, layer_overhead=overhead,
        dtype=dtype, memory_utilization=0.5, reserved_bytes=1 * GIB, shared_compute=True,
        cores=cores, parallel_efficiency=efficiency, kv_read_amplification=amplification)


def write_hardware_file(hw: Hardware, path: str) -> None:
    """YAML unless the name ends in .json; readable back with ``--hardware FILE``."""
    data = hw.to_dict()
    target = Path(path)
    if target.suffix.lower() == ".json":
        target.write_text(json.dumps(data, indent=2) + "\n")
        return
    import yaml
    target.write_text(yaml.safe_dump(data, sort_keys=False))
