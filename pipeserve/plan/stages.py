"""Time of each pipeline stage and each hop between stages, from the roofline.

A *chunk* is a contiguous run of layers on one worker; without interleaving there
is one chunk per worker, with V virtual stages there are P·V chunks and chunk c
lives on worker c mod P. Worker w holds TP ranks w·T … w·T+T-1, so it sits on
node (w·T) // gpus_per_node; a hop between workers on different nodes uses the
inter-node link.
"""

from __future__ import annotations

from pipeserve.model.config import ModelConfig
from pipeserve.plan import formulas
from pipeserve.plan.hardware import DTYPE_BYTES, Hardware
from pipeserve.plan.quantization import weight_format
from pipeserve.plan.roofline import BatchShape, LayerCosts, OpCost, flops_rate
from pipeserve.plan.simulator import CpuSharing

TOKEN_RETURN_BYTES = 8  # sampled token id (+ logprob) per row sent back to the driver


class PipelineCosts:
    """Seconds per chunk and per hop for a micro-batch shape; the simulator's cost model."""

    def __init__(self, model: ModelConfig, hw: Hardware, chunk_layers: list[int],
                 num_workers: int, tp: int = 1, dtype: str | None = None,
                 compute_scale: float = 1.0, quantization: str | None = None,
                 threads_per_rank: int | None = None) -> None:
        """``compute_scale``: the fraction of each worker's compute left to it
        (below 1 where another process, the driver, shares the cores);
        ``quantization``: the weights' storage format (None: the dtype);
        ``threads_per_rank``: threads of each rank process on shared compute (None: the
        engine's default, the node's cores // its rank processes, at least 1)."""
        self.model, self.hw, self.tp = model, hw, tp
        self.threads_per_rank = threads_per_rank
        self.compute_scale = compute_scale
        self.chunk_layers = list(chunk_layers)
        self.num_workers = num_workers
        self.dtype = dtype or hw.dtype
        fmt = None if quantization is None else weight_format(quantization)
        self.costs = LayerCosts(model, DTYPE_BYTES[self.dtype], tp, hw.kv_read_amplification,
                                fmt and fmt.bytes, fmt and fmt.head_bytes_for(model.hidden_size),
                                fmt.block if fmt else 1)
        nodes = [self.node_of(w) for w in range(num_workers)]
        # With shared compute every rank process on a node (T per worker) gets an equal slice.
        self.share = [nodes.count(n) * tp if hw.shared_compute else 1 for n in nodes]
        # A stage's work relative to the calibrated layer (both fitted on measured runs).
        self.quantized = quantization is not None
        self.work_scale = hw.engine_work_scale * (hw.quantized_work_scale if quantization is not None else 1.0)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_layers)

    def worker_of(self, chunk: int) -> int:
        return chunk % self.num_workers

    def node_of(self, worker: int) -> int:
        return (worker * self.tp) // self.hw.gpus_per_node

    def _rates(self, tokens: int, worker: int) -> tuple[float, float]:
        """(FLOP/s, bytes/s) this worker gets for an op over ``tokens`` rows."""
        rate = flops_rate(self.hw.flops_decode, self.hw.flops_prefill, tokens)
        share = self.share[worker]
        scale = self._compute_scale(worker)
        return rate * self.hw.stage_compute_share(share) * scale, self.hw.mem_bandwidth / share * scale

    def _compute_scale(self, worker: int) -> float:
        """compute_scale for workers on node 0, where the driver runs; 1 elsewhere."""
        return self.compute_scale if self.node_of(worker) == 0 else 1.0

    def _op_time(self, cost: OpCost, tokens: int, worker: int) -> float:
        return cost.time(*self._rates(tokens, worker))

    def layer_time(self, shape: BatchShape, worker: int = 0) -> float:
        """One decoder layer on one worker: dispatch overhead + matmul roofline term +
        attention roofline term (separate kernels, no overlap) + its TP all-reduces."""
        if shape.new_tokens == 0:
            return 0.0
        compute = self.costs.layer_time(shape, *self._rates(shape.new_tokens, worker))
        return compute + 2 * self.allreduce_time(shape) + self.hw.layer_overhead

    def allreduce_time(self, shape: BatchShape) -> float:
        """One TP all-reduce of the micro-batch's [new_tokens, hidden] activations (0 at T = 1)."""
        return formulas.tp_allreduce_time(self.costs.allreduce_bytes(shape), self.tp, self.hw.intra_node_bandwidth,
                                          self.hw.intra_node_latency, self.hw.tp_allreduce_latency)

    def embedding_time(self, shape: BatchShape, worker: int = 0) -> float:
        """The vocabulary-split embedding: each rank looks up its ids, one all-reduce completes them."""
        return self._op_time(self.costs.embedding(shape), shape.new_tokens, worker) + self.allreduce_time(shape)

    def head_time(self, shape: BatchShape, worker: int = 0) -> float:
        """The LM head's vocabulary slices, gathered on TP rank 0: half a ring all-reduce's
        bytes, one collective's latency."""
        if shape.logit_rows == 0:
            return 0.0
        compute = self._op_time(self.costs.head(shape), shape.logit_rows, worker)
        if self.tp == 1:
            return compute
        nbytes = shape.logit_rows * self.model.vocab_size * 4   # fp32 logits
        return compute + formulas.tp_allreduce_time(nbytes / 2, self.tp, self.hw.intra_node_bandwidth,
                                                    self.hw.intra_node_latency / 2, self.hw.tp_allreduce_latency)

    def chunk_time(self, chunk: int, shape: BatchShape) -> float:
        """Forward time of one chunk: its layers, plus the embedding / LM head at the ends;
        the fitted work scale applies to the engine's work, not to the collectives (timed
        as the runtime runs them)."""
        worker = self.worker_of(chunk)
        t = self.chunk_layers[chunk] * self.layer_time(shape, worker) + self.stage_step_time(shape, worker)
        if chunk == 0:
            t += self.embedding_time(shape, worker)
        if chunk == self.num_chunks - 1:
            t += self.head_time(shape, worker)
        collectives = self.collectives_time(chunk, shape)
        return (t - collectives) * self.work_scale + collectives

    def collectives_time(self, chunk: int, shape: BatchShape) -> float:
        """The chunk's TP collectives: 2 all-reduces a layer, the embedding's, the logits gather."""
        if self.tp == 1 or shape.new_tokens == 0:
            return 0.0
        seconds = self.chunk_layers[chunk] * 2 * self.allreduce_time(shape)
        if chunk == 0:
            seconds += self.allreduce_time(shape)
        if chunk == self.num_chunks - 1 and shape.logit_rows:
            seconds += self.head_time(shape) - self._op_time(self.costs.head(shape), shape.logit_rows, 0)
        return seconds

    def stage_step_time(self, shape: BatchShape, worker: int = 0) -> float:
        """A stage's per-micro-batch work outside its layers (step unpickling,
        attention metadata), slowed like its compute when the cores are shared."""
        if shape.new_tokens == 0:
            return 0.0
        seconds = self.hw.stage_step_overhead + self.hw.stage_seq_overhead * shape.num_seqs
        return seconds / (self._share_speed(worker) * self._compute_scale(worker))

    def _share_speed(self, worker: int) -> float:
        """This worker's speed relative to one core (shared compute), else 1."""
        if not self.hw.shared_compute:
            return 1.0
        return min(1.0, self.hw.stage_compute_share(self.share[worker]) * self.hw.cores)

    def driver_time(self, shape: BatchShape) -> float:
        """The driver's serial work for one micro-batch (schedule, build, process results)."""
        if shape.num_seqs == 0:
            return 0.0
        return self.hw.driver_step_overhead + self.hw.driver_seq_overhead * shape.num_seqs

    def link(self, src_worker: int, dst_worker: int) -> tuple[float, float]:
        """(bandwidth, latency) of the link between two workers."""
        if self.node_of(src_worker) == self.node_of(dst_worker):
            return self.hw.intra_node_bandwidth, self.hw.intra_node_latency
        return self.hw.inter_node_bandwidth, self.hw.inter_node_latency

    def hop_time(self, chunk: int, shape: BatchShape) -> float:
        """Send after ``chunk``: hidden states to the next chunk, or token ids to the driver."""
        src = self.worker_of(chunk)
        if chunk == self.num_chunks - 1:
            bandwidth, latency = self.link(src, 0)
            return latency + shape.logit_rows * TOKEN_RETURN_BYTES / bandwidth
        dst = self.worker_of(chunk + 1)
        if src == dst:
            return 0.0
        bandwidth, latency = self.link(src, dst)
        return latency + self.costs.hidden_bytes(shape) / bandwidth

    # -- time-shared cores (the simulator's processor sharing) ----------------
    def cpu_sharing(self) -> CpuSharing | None:
        """Where the stages share a node's cores (``shared_compute``): each worker's
        rank processes (T), threads per rank and node, for the simulator to time-share;
        None otherwise (each worker owns its device)."""
        if not self.hw.shared_compute:
            return None
        nodes = [self.node_of(w) for w in range(self.num_workers)]
        threads = [self.threads_per_rank or max(1, int(self.hw.cores) // (nodes.count(node) * self.tp))
                   for node in nodes]
        # Each TP rank computes its own shard (chunk_work is one rank's), in step with the others.
        return CpuSharing(cores=(float(self.hw.cores),) * (max(nodes) + 1), node_of=tuple(nodes),
                          threads=tuple(threads), efficiency=self.parallel_efficiency,
                          oversubscribed=self.hw.oversubscription_efficiency, ranks=(self.tp,) * len(nodes),
                          barrier=self.hw.oversubscribed_barrier, contention=self.hw.memory_contention,
                          layer_wait=self.hw.oversubscribed_layer_wait)

    @property
    def parallel_efficiency(self) -> float:
        """How a rank's threads share its kernels: the dense layer's (calibrated), or the
        kept-quantized kernels' where the hardware file has it (fitted)."""
        if self.quantized and self.hw.quantized_parallel_efficiency > 0:
            return self.hw.quantized_parallel_efficiency
        return self.hw.parallel_efficiency

    def chunk_work(self, chunk: int, shape: BatchShape) -> tuple[float, float]:
        """One chunk's work on one TP rank, in seconds on one core: (serial part: per-layer dispatch,
        the stage's per-step work, collectives' latencies; parallel part: the kernels,
        which the process's threads share). Memory bandwidth: the node's / its cores."""
        if shape.new_tokens == 0:
            return 0.0, 0.0
        layers = self.chunk_layers[chunk]
        rates = self._core_rates(shape.new_tokens)
        serial = (layers * self.hw.layer_overhead
                  + self.hw.stage_step_overhead + self.hw.stage_seq_overhead * shape.num_seqs)
        parallel = layers * self.costs.layer_time(shape, *rates)
        if chunk == 0:
            parallel += self.costs.embedding(shape).time(*rates)
        if chunk == self.num_chunks - 1 and shape.logit_rows:
            parallel += self.costs.head(shape).time(*self._core_rates(shape.logit_rows))
        # The collectives are timed as the runtime runs them (calibrate.measure_shm_allreduce),
        # so neither fitted scale of the engine's own work applies to them.
        return (serial * self.work_scale * self.hw.engine_overhead_scale + self.collectives_time(chunk, shape),
                parallel * self.work_scale)

    def _core_rates(self, tokens: int) -> tuple[float, float]:
        """(FLOP/s, bytes/s) of one thread on one core."""
        rate = flops_rate(self.hw.flops_decode, self.hw.flops_prefill, tokens)
        return rate / self.hw.cores, self.hw.mem_bandwidth / self.hw.cores

    def stage_times(self, shape: BatchShape) -> list[float]:
        """Per-worker compute time for one pass of the micro-batch (all its chunks)."""
        times = [0.0] * self.num_workers
        for chunk in range(self.num_chunks):
            times[self.worker_of(chunk)] += self.chunk_time(chunk, shape)
        return times

    def activation_hop_time(self, shape: BatchShape) -> float:
        """The slowest activation hop between consecutive chunks (t_comm)."""
        hops = [self.hop_time(c, shape) for c in range(self.num_chunks - 1)]
        return max(hops, default=0.0)
