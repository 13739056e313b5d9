"""``pipeserve plan --calibrate``: measure this machine and write a hardware file.

torch (and the runtime's model code) is imported lazily here and nowhere else in
the planner, and only through the runtime's public functions:
``pipeline.costs.random_stage`` / ``step_tensors`` (a stage model with random
weights and a step's tensors), ``worker.model_runner.prepare_step`` (a stage's
per-step metadata) and ``LLMEngine(config, executor=...)``. The compute numbers come from timing the runtime's OWN decoder layer
(``pipeserve.pipeline.costs``: one layer of the model with random weights, the
configured attention backend, its real metadata and paged KV cache), not bare
matmuls: a real layer costs much more than its four matmuls (RMSNorm in fp32,
RoPE, SiLU and residual adds, the KV write, attention, per-op dispatch), and
fitting the planner's roofline to the layer makes its predictions match engine
runs. All layer timings use one thread and the minimum of several repeats (other
processes on a shared machine only ever add time). With T(q, c) the layer's time
for ``q`` sequences of query lengths / context lengths ``c``:

- layer_overhead = T(1 decode, context 1): the dispatch floor of a layer;
- kv_read_amplification = ΔT · (bandwidth / cores) / ΔKV bytes between 64 decodes
  at context 1024 and at context 16: attention's cost per KV byte it reads,
  relative to a plain read (the C decode kernel is partly compute-bound, so > 1);
- flops_decode = matmul FLOPs of DECODE_TOKENS decodes / (T − overhead − the
  attention term), at context 16, times the cores;
- flops_prefill = (matmul + attention FLOPs) of 2 fresh prompts of
  PREFILL_TOKENS / 2 tokens / (T − overhead), times the cores (prefill attention
  is compute-bound, so it runs at the same rate);
- parallel_efficiency: the layer at 64 decodes, context 256, on 1 thread vs all cores.

So the planner's layer time, overhead + matmul term + attention term, reproduces
the measured layer at these shapes. The engine's work outside the layers is
timed on its own code too: each stage's per-micro-batch step (decode, attention
metadata) and the driver's (schedule, build, process tokens, detokenize), the
latter with an executor that answers at once so only the driver is timed. Memory bandwidth comes from a large copy, and
the link from loopback gloo point-to-point between two processes (latency from
tiny messages, bandwidth from big ones), and the TP collective's cost from the
runtime's own shared-memory all-reduce between two rank processes (a decode's
activations, the ranks arriving apart as inside a step: ``tp_allreduce_latency``).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path

from pipeserve.model.config import ModelConfig
from pipeserve.plan.hardware import DTYPE_BYTES, GIB, Hardware
from pipeserve.plan.presets import MODEL_PRESETS
from pipeserve.plan.roofline import DECODE_TOKENS, PREFILL_TOKENS, BatchShape, LayerCosts

_P2P_SIZES = (8, 4 * 1024**2)  # bytes: latency probe, bandwidth probe
_DTYPES = ("float32", "bfloat16")
_BLOCK_SIZE = 16
_KV_SEQS, _KV_SHORT, _KV_LONG = 64, 16, 1024   # amplification: 64 decodes, context 16 vs 1024
_DECODE_CONTEXT = 16                           # decode FLOP/s: a tiny context
_EFFICIENCY_SEQS, _EFFICIENCY_CONTEXT = 64, 256
# K + V bytes of one layer's cache in the timed layer: the engine's default 1 GiB of KV per
# stage over SmolLM2's 15 layers at PP = 2; block tables are scattered over it.
_CACHE_BYTES_PER_LAYER = 64 * 1024**2


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _best(fn, repeats: int) -> float:
    """Minimum seconds of ``fn()`` after one warm-up call: other processes only add time."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class LayerTimer:
    """Times the runtime's own decoder layer (a one-layer stage, random weights) on the CPU."""

    def __init__(self, torch, model: ModelConfig, dtype, attention_backend: str = "auto",
                 block_size: int = _BLOCK_SIZE) -> None:
        from pipeserve.pipeline.costs import random_stage
        self.torch, self.model, self.dtype, self.block_size = torch, model, dtype, block_size
        self.device = torch.device("cpu")
        self.measured: list[tuple[str, float]] = []   # (shape, best seconds), for the log
        torch.manual_seed(0)
        with torch.inference_mode():
            self.stage = random_stage(model, 0, 1, False, False, dtype, self.device, attention_backend)

    @property
    def backend_name(self) -> str:
        return type(self.stage.backend).__name__

    def time(self, query_lens: list[int], context_lens: list[int], repeats: int) -> float:
        """Best seconds of one layer forward over sequences with these query / context
        lengths (context includes the new tokens; its KV is read from the paged cache,
        a cache of the runtime's default size with the blocks scattered over it)."""
        from pipeserve.pipeline.costs import step_tensors
        torch = self.torch
        block_bytes = 2 * self.block_size * self.model.num_kv_heads * self.model.head_dim * self.dtype.itemsize
        with torch.inference_mode():
            kv, meta, positions, _ids, hidden = step_tensors(
                self.model, self.stage.backend, query_lens, context_lens, self.block_size,
                self.dtype, self.device, cache_blocks=_CACHE_BYTES_PER_LAYER // block_bytes)
            seconds = _best(lambda: self.stage(hidden, positions, meta, kv), repeats)
        label = (f"{len(query_lens)}x(q={query_lens[0]}, ctx={context_lens[0]}), "
                 f"{torch.get_num_threads()} thread(s)")
        self.measured.append((label, seconds))
        return seconds

    def decode(self, seqs: int, context: int, repeats: int) -> float:
        """``seqs`` decodes, each attending to ``context`` cached keys plus its own."""
        return self.time([1] * seqs, [context + 1] * seqs, repeats)

    def prefill(self, prompts: int, prompt_len: int, repeats: int) -> float:
        """``prompts`` fresh prompts of ``prompt_len`` tokens (no cached prefix)."""
        return self.time([prompt_len] * prompts, [prompt_len] * prompts, repeats)


def measure_layer_overhead(timer: LayerTimer) -> float:
    """The layer's time for one decode token at context 1: its dispatch floor."""
    return timer.time([1], [1], 100)


def measure_kv_amplification(timer: LayerTimer, costs: LayerCosts, core_bandwidth: float,
                             seqs: int = _KV_SEQS, short: int = _KV_SHORT, long: int = _KV_LONG) -> float:
    """Attention's cost per KV byte read, relative to a plain read at one core's
    bandwidth: the extra time of ``seqs`` decodes at a long context over a short one
    (same matmuls) divided by the time to read the extra KV bytes. Floored at 1."""
    extra = timer.decode(seqs, long, 10) - timer.decode(seqs, short, 10)
    extra_bytes = (costs.attention(BatchShape.decode(seqs, long)).bytes
                   - costs.attention(BatchShape.decode(seqs, short)).bytes)  # costs has amplification 1
    return max(1.0, extra * core_bandwidth / extra_bytes)


def measure_decode_flops(timer: LayerTimer, costs: LayerCosts, overhead: float, amplification: float,
                         core_bandwidth: float) -> float:
    """Per-core FLOP/s of the layer's matmuls at DECODE_TOKENS decodes (tiny context):
    matmul FLOPs / (T − overhead − the attention term the planner will add)."""
    shape = BatchShape.decode(DECODE_TOKENS, _DECODE_CONTEXT)
    seconds = timer.decode(DECODE_TOKENS, _DECODE_CONTEXT, 30)
    attention = costs.attention(shape).bytes * amplification / core_bandwidth
    matmul_s = seconds - overhead - attention
    return costs.matmuls(shape).flops / max(matmul_s, 0.05 * seconds)


def measure_prefill_flops(timer: LayerTimer, costs: LayerCosts, overhead: float) -> float:
    """Per-core FLOP/s of a prefill of PREFILL_TOKENS fresh tokens (2 prompts):
    (matmul + attention FLOPs) / (T − overhead); prefill attention is compute-bound."""
    prompts, prompt_len = 2, PREFILL_TOKENS // 2
    shape = BatchShape.prefill(prompts, prompt_len)
    seconds = timer.prefill(prompts, prompt_len, 5)
    flops = costs.matmuls(shape).flops + costs.attention(shape).flops
    return flops / max(seconds - overhead, 0.05 * seconds)


def measure_parallel_efficiency(timer: LayerTimer, cores: int) -> tuple[float, float, float]:
    """How much of a linear speed-up one process gets from ``cores`` threads on the
    layer at a decode batch: e in 1 + (cores - 1)·e. Returns (e, T 1 thread, T cores)."""
    torch = timer.torch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = timer.decode(_EFFICIENCY_SEQS, _EFFICIENCY_CONTEXT, 15)
        if cores < 2:
            return 1.0, one, one
        torch.set_num_threads(cores)
        many = timer.decode(_EFFICIENCY_SEQS, _EFFICIENCY_CONTEXT, 15)
    finally:
        torch.set_num_threads(threads)
    return min(1.0, max(0.0, (one / many - 1.0) / (cores - 1))), one, many


def _fit_two(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) with seconds = a·steps + b·seq_steps through two (steps, seq_steps, seconds)
    points, each clamped at 0 (noise can push a tiny fixed part below zero)."""
    (n1, s1, t1), (n2, s2, t2) = points
    det = n1 * s2 - n2 * s1
    a, b = (t1 * s2 - t2 * s1) / det, (n1 * t2 - n2 * t1) / det
    if a < 0:
        return 0.0, (t1 + t2) / (s1 + s2)
    if b < 0:
        return (t1 + t2) / (n1 + n2), 0.0
    return a, b


def measure_driver_overhead(model: str = "smollm2-135m-instruct", requests: int = 128,
                            prompt_len: int = 64, output_len: int = 48) -> tuple[float, float]:
    """(s per micro-batch, s per sequence in it) of the engine's driver: the real
    LLMEngine (scheduler, step builder, output processing and detokenizer, the step
    through the wire format both ways as the transport does) over an executor that
    answers at once, so all the time measured is the driver's. Two runs, small and
    large micro-batches, separate the fixed and per-sequence parts."""
    import json

    from pipeserve.config import EngineConfig
    from pipeserve.engine.llm_engine import LLMEngine
    from pipeserve.sampling_params import SamplingParams
    from pipeserve.worker.executor import Executor
    from pipeserve.worker.step import SampledToken, StepInput, StepOutput
    from pipeserve.worker.step_wire import dumps, from_wire

    class InstantExecutor(Executor):
        def __init__(self, inflight: int) -> None:
            self.max_inflight = inflight
            self.done: list = []
            self.steps = self.seq_steps = 0

        def submit(self, step) -> None:
            from_wire(StepInput, json.loads(dumps(step)))   # the transport's serialization, both ends
            self.steps += 1
            self.seq_steps += len(step.seqs)
            out = StepOutput(step.step_id, [SampledToken(s.seq_id, 1000 + s.seq_id % 7, 0.0)
                                            for s in step.seqs if s.sampling is not None])
            self.done.append(from_wire(StepOutput, json.loads(dumps(out))))

        def wait(self, timeout: float | None = None) -> list:
            done, self.done = self.done, []
            return done

        @property
        def num_inflight(self) -> int:
            return len(self.done)

    points = []
    for max_seqs in (8, requests):
        config = EngineConfig.from_kwargs(model=model, pipeline_parallel_size=2, pp_partition="uniform",
                                          max_num_seqs=max_seqs, kv_cache_memory="256MiB")
        engine = LLMEngine(config, executor=InstantExecutor(2))
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
        start = time.perf_counter()
        for i in range(requests):
            engine.add_request(str(i), {"prompt_token_ids": [(i * 31 + j) % 5000 + 100 for j in range(prompt_len)]},
                               params)
        while engine.has_unfinished_requests():
            engine.step()
        points.append((engine.executor.steps, engine.executor.seq_steps, time.perf_counter() - start))
        engine.shutdown()
    return _fit_two(points)


def measure_stage_step_overhead(timer: LayerTimer, context: int = 256) -> tuple[float, float]:
    """(s per micro-batch, s per sequence) of a stage's work outside its layers:
    decode the step from the wire, build the attention metadata and positions (the
    runner's ``prepare_step``), for decode batches of 1 and 64 sequences."""
    import json

    from pipeserve.worker.model_runner import prepare_step
    from pipeserve.sampling.inputs import SeqSampling
    from pipeserve.worker.step import SeqStep, StepInput
    from pipeserve.worker.step_wire import dumps, from_wire

    bs = timer.block_size
    blocks = (context + 1 + bs - 1) // bs
    points = []
    for seqs in (1, 64):
        step = StepInput(0, [SeqStep(i, [100 + i], context, list(range(i * blocks, (i + 1) * blocks)),
                                     SeqSampling(0.0, 1.0, 0, 0.0, None, 5)) for i in range(seqs)])
        wire = dumps(step)
        seconds = _best(lambda: prepare_step(from_wire(StepInput, json.loads(wire)), timer.stage.backend, bs,
                                             timer.device), 20)
        points.append((1, seqs, seconds))
    return _fit_two(points)


def measure_bandwidth(torch, nbytes: int = 256 * 1024**2) -> float:
    """Bytes/s of a large copy (a read and a write of every byte)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), 5)


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
    """(bandwidth bytes/s, latency s) of loopback gloo send/recv between two processes.

    The two processes are daemons and are ended however the measurement ends: a
    timeout raises ``TimeoutError`` and leaves nothing running.
    """
    import queue

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, repeats, results), daemon=True) for r in (0, 1)]
    try:
        for proc in procs:
            proc.start()
        try:
            timings = results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the gloo link measurement did not finish within {timeout:.0f} s") from None
        for proc in procs:
            proc.join(timeout=timeout)
    finally:
        _end_processes(procs)
    small, large = _P2P_SIZES
    latency = timings[small]
    bandwidth = large / max(timings[large] - latency, 1e-9)
    return bandwidth, latency


# Work between two all-reduces in the measurement: the ranks take turns being late by
# (_AR_LATE - _AR_EARLY), as a step's attention and MLP halves are paced by different ranks
# under an uneven split; the early rank waits in the collective (spins, then sleeps).
_AR_EARLY, _AR_LATE = 100e-6, 300e-6


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _shm_allreduce_worker(rank: int, path: str, hidden: int, dtype: str, repeats: int, created, results) -> None:
    import torch

    from pipeserve.model.tensor_parallel import SharedMemoryAllReduce
    torch.set_num_threads(1)
    if rank == 1:
        created.wait(30)
    group = SharedMemoryAllReduce(path, rank, 2, hidden, getattr(torch, dtype), create=rank == 0)
    if rank == 0:
        created.set()
    x = torch.randn(1, hidden, dtype=getattr(torch, dtype))
    samples = []
    for i in range(repeats + 20):
        start = time.perf_counter()
        _busy(_AR_LATE if (i + rank) % 2 else _AR_EARLY)
        group.all_reduce(x)
        if i >= 20:   # the first calls fault the mapping in
            # beyond the late rank's work: what the collective adds to a step's critical path
            samples.append(time.perf_counter() - start - _AR_LATE)
    if rank == 0:
        results.put(samples)


def measure_shm_allreduce(hidden: int = 576, dtype: str = "bfloat16", repeats: int = 400,
                          timeout: float = 60.0) -> tuple[float, float]:
    """(median, mean) seconds one TP = 2 all-reduce of a decode's [1, hidden] activations
    (in ``dtype``) adds to a step, through the runtime's own ``SharedMemoryAllReduce``
    (``--tp-all-reduce shm``): two rank processes of one thread each, working between calls
    with the late rank alternating (``_AR_EARLY``/``_AR_LATE``), as inside a step where the
    ranks never arrive together: the early one has gone to sleep in the collective and the
    late one must wake it. The time beyond the late rank's work is the collective's cost
    (copy in, publish, the wake-up, sum); called back to back, the ranks meet spinning and
    it looks several times cheaper than in a run. Calibrate on an idle host."""
    import queue
    import tempfile

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results, created = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        path = os.path.join(folder, "allreduce")
        procs = [ctx.Process(target=_shm_allreduce_worker, args=(r, path, hidden, dtype, repeats, created, results),
                             daemon=True) for r in (0, 1)]
        try:
            for proc in procs:
                proc.start()
            try:
                samples = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"the shared-memory all-reduce measurement did not finish within "
                                   f"{timeout:.0f} s") from None
            for proc in procs:
                proc.join(timeout=timeout)
        finally:
            _end_processes(procs)
    return statistics.median(samples), statistics.fmean(samples)


def _end_processes(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def calibrate(dtype: str = "float32", model: ModelConfig | None = None,
              log=print, attention_backend: str = "auto") -> Hardware:
    """Measure this machine; the model (default SmolLM2-135M) is the layer that is timed."""
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
    bandwidth = measure_bandwidth(torch)
    core_bandwidth = bandwidth / cores
    log(f"memory bandwidth: {bandwidth / 1e9:.2f} GB/s ({core_bandwidth / 1e9:.2f} GB/s per core)")
    timer = LayerTimer(torch, model, tdtype, attention_backend)
    costs = LayerCosts(model, DTYPE_BYTES[dtype])
    log(f"timing the runtime's decoder layer: {model.hidden_size} hidden, {dtype}, "
        f"attention backend {timer.backend_name}, 1 thread, best of repeats")
    torch.set_num_threads(1)
    try:
        overhead = measure_layer_overhead(timer)
        log(f"per-layer overhead (1 decode, context 1): {overhead * 1e6:.1f} us")
        amplification = measure_kv_amplification(timer, costs, core_bandwidth)
        log(f"KV read amplification ({_KV_SEQS} decodes, context {_KV_LONG} vs {_KV_SHORT}): "
            f"{amplification:.2f}x")
        decode = measure_decode_flops(timer, costs, overhead, amplification, core_bandwidth)
        prefill = measure_prefill_flops(timer, costs, overhead)
        stage_step, stage_seq = measure_stage_step_overhead(timer)
    finally:
        torch.set_num_threads(threads)
    log(f"stage work per micro-batch outside the layers: {stage_step * 1e6:.0f} us + "
        f"{stage_seq * 1e6:.1f} us per sequence")
    try:
        driver_step, driver_seq = measure_driver_overhead()
        log(f"driver work per micro-batch: {driver_step * 1e6:.0f} us + {driver_seq * 1e6:.1f} us per sequence")
    except Exception as exc:   # no tokenizer files here: leave the driver out of the model
        driver_step = driver_seq = 0.0
        log(f"warning: driver overhead not measured ({exc}); the planner will leave it out")
    log(f"layer FLOP/s per core: decode ({DECODE_TOKENS} tokens) {decode / 1e9:.1f} GFLOP/s, "
        f"prefill ({PREFILL_TOKENS} tokens) {prefill / 1e9:.1f} GFLOP/s")
    efficiency, one, many = measure_parallel_efficiency(timer, cores)
    log(f"parallel efficiency of {cores} threads in one stage: {efficiency:.2f} "
        f"({_EFFICIENCY_SEQS} decodes at context {_EFFICIENCY_CONTEXT}: {one * 1e3:.2f} ms on 1 thread, "
        f"{many * 1e3:.2f} ms on {cores})")
    for label, seconds in timer.measured:
        log(f"  layer {label}: {seconds * 1e3:.3f} ms")
    if cores > 1 and many > one:
        log(f"warning: the layer ran slower on {cores} threads than on 1: other processes hold "
            f"the cores (or thread pools contend); parallel_efficiency is unreliable, rerun "
            f"--calibrate on an idle machine")
    link_bw, link_lat = measure_gloo_link()
    log(f"gloo loopback: latency {link_lat * 1e6:.1f} us, bandwidth {link_bw / 1e9:.2f} GB/s")
    try:
        median, allreduce = measure_shm_allreduce(model.hidden_size, dtype)
        log(f"TP = 2 shared-memory all-reduce of [1, {model.hidden_size}] (the runtime's SharedMemoryAllReduce, "
            f"2 rank processes): mean {allreduce * 1e3:.3f} ms (tp_allreduce_latency), median {median * 1e3:.3f} ms")
    except Exception as exc:   # no /dev/shm or no second process: the documented default
        allreduce = CPU_TP_ALLREDUCE_LATENCY
        log(f"warning: shared-memory all-reduce not measured ({exc}); using {allreduce * 1e3:.2f} ms")
    log(f"calibration took {time.perf_counter() - started:.1f} s ({cores} cores)")
    return Hardware(
        name="cpu-local", flops_prefill=prefill * cores, flops_decode=decode * cores, mem_bandwidth=bandwidth,
        mem_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        gpus_per_node=64, intra_node_bandwidth=link_bw, intra_node_latency=link_lat,
        inter_node_bandwidth=link_bw, inter_node_latency=link_lat, layer_overhead=overhead,
        dtype=dtype, memory_utilization=0.5, reserved_bytes=1 * GIB, shared_compute=True,
        cores=cores, parallel_efficiency=efficiency, kv_read_amplification=amplification,
        driver_step_overhead=driver_step, driver_seq_overhead=driver_seq,
        stage_step_overhead=stage_step, stage_seq_overhead=stage_seq,
        tp_allreduce_latency=allreduce)


# The default where --calibrate cannot measure the shared-memory all-reduce (measure_shm_allreduce):
# one TP = 2 all-reduce of a decode's activations (--tp-all-reduce shm), SmolLM2-135M, one request,
# 0.58 ms on average (benchmarks/README.md, "Tensor parallelism", measured on the shared 2-core
# machine under load: mostly the wait for the other rank to be scheduled; idle it is ~0.14 ms);
# the same run's gloo all-reduce took 1.35 ms (use that with --tp-all-reduce gloo).
CPU_TP_ALLREDUCE_LATENCY = 0.58e-3
CPU_TP_ALLREDUCE_LATENCY_GLOO = 1.35e-3


def write_hardware_file(hw: Hardware, path: str) -> None:
    """YAML unless the name ends in .json; readable back with ``--hardware FILE``."""
    data = hw.to_dict()
    target = Path(path)
    if target.suffix.lower() == ".json":
        target.write_text(json.dumps(data, indent=2) + "\n")
        return
    import yaml
    target.write_text(yaml.safe_dump(data, sort_keys=False))
