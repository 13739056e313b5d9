"""Hardware descriptions: presets and ``--hardware FILE`` (YAML or JSON).

Every number is an *effective* rate (what kernels achieve), not a datasheet peak;
the presets take the peak times a typical achieved fraction (see docs/PLANNER.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeserve.plan.presets import PlanInputError, find_preset

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    name: str
    flops_prefill: float          # FLOP/s of a layer's matmuls in a prefill (hundreds of tokens)
    flops_decode: float           # FLOP/s of a layer's matmuls in a decode (a few tokens)
    mem_bandwidth: float          # bytes/s of device memory
    mem_bytes: float              # device memory size
    gpus_per_node: int
    intra_node_bandwidth: float   # bytes/s, one direction, device to device in a node
    intra_node_latency: float     # s per message
    inter_node_bandwidth: float   # bytes/s, one direction, between nodes
    inter_node_latency: float     # s per message
    layer_overhead: float = 0.0   # s per decoder layer forward (kernel launch / dispatch)
    dtype: str = "bfloat16"       # default dtype of weights, activations and KV
    memory_utilization: float = 0.9
    reserved_bytes: float = 0.0   # runtime context, allocator slack
    # True where all stages of a node share one pool of compute and bandwidth
    # (cpu-local: P stage processes split the cores), so a stage gets 1/(stages on node).
    shared_compute: bool = False
    # Shared compute only: the node's cores, and how well one stage uses several of them
    # (1.0 = linear; a stage given c cores runs at 1 + (c - 1)·e cores' worth).
    cores: int = 1
    parallel_efficiency: float = 1.0
    # Attention's cost per KV byte attended, relative to a plain read at mem_bandwidth:
    # 1 for a memory-bound fused paged kernel; `--calibrate` measures it on the runtime's
    # decoder layer (the CPU backend's C decode kernel is partly compute-bound, so > 1).
    kv_read_amplification: float = 1.0
    # The engine's own CPU work, outside the layers (`--calibrate` measures both on
    # the runtime's code; 0 = not modelled):
    # - the driver, per micro-batch: schedule it, build its step, take its sampled
    #   tokens back (detokenize, stop checks): driver_step_overhead + driver_seq_overhead
    #   per sequence in it; one serial resource, ahead of the micro-batch's first stage;
    # - each stage, per micro-batch: decode the step (JSON) and build its attention
    #   metadata (slots, block tables): stage_step_overhead + stage_seq_overhead per sequence.
    driver_step_overhead: float = 0.0
    driver_seq_overhead: float = 0.0
    stage_step_overhead: float = 0.0
    stage_seq_overhead: float = 0.0
    # Seconds of one tensor-parallel collective beyond its bytes at T = 2 (launch, and the
    # wait for the ranks to meet), per ring step pair: a collective over T ranks costs its
    # bandwidth term + (T - 1)·this. 0 = not set: 2(T - 1)·intra_node_latency (a ring's
    # message latencies). cpu-local's default is measured (calibrate.CPU_TP_ALLREDUCE_LATENCY).
    tp_allreduce_latency: float = 0.0
    # Fitted on measured runs (`python -m pipeserve.plan.validate --heldout`; 1 = not fitted):
    # - engine_work_scale: a stage's work in a full engine run over the calibrated layer's
    #   (caches shared with other sequences' KV and other processes, allocator, ...);
    # - oversubscription_efficiency: the share of a node's cores its threads get when more
    #   of them are runnable than there are cores (time slices, context switches, caches).
    # - quantized_work_scale: the same, further, for kept-quantized weights (their kernels
    #   dequantize; the calibrated layer is dense), fitted on the calibration runs that keep
    #   them (the built-in GGUF's Q4_1 here);
    # - engine_overhead_scale: on time-shared (CPU) hosts, the serial part of a stage's work
    #   (per-layer dispatch, per-step bookkeeping) in a whole run over the calibrated one:
    #   what sets a small batch's step, so the tail of a run;
    engine_work_scale: float = 1.0
    oversubscription_efficiency: float = 1.0
    quantized_work_scale: float = 1.0
    engine_overhead_scale: float = 1.0
    # - quantized_parallel_efficiency: parallel_efficiency for kept-quantized weights (their
    #   kernels dequantize: more arithmetic per byte than the calibrated dense layer, so they
    #   may share two cores differently); fitted where the calibration holds kept-quantized
    #   runs at one and at several threads per process, else 0: the dense layer's.
    quantized_parallel_efficiency: float = 0.0
    # - oversubscribed_barrier: how much a multi-thread process waits at its kernels' barriers
    #   when more threads are runnable than there are cores: 1 (the default) = its parallel
    #   part advances at one thread's share (the thread the scheduler left out ends every op;
    #   measured on the AVX-512 machine, 2 stages x 2 threads on 2 cores: 1.9x slower than 1
    #   thread each), 0 = its threads share the cores like any others (the AVX2 VM: the same
    #   speed); fitted where the calibration holds a run with such processes.
    oversubscribed_barrier: float = 1.0
    # - oversubscribed_layer_wait: the other model of that wait, where set (seconds, > 0): a
    #   fixed wait per layer, whatever its length (the thread left out gets its turn within a
    #   scheduler slice or so), on top of the layer's kernels at its threads' shares, in place
    #   of oversubscribed_barrier's wait in proportion to the work; it weighs on short layers
    #   (decodes) and vanishes into long ones (prefill chunks), as on the AVX2 VM (2 stages
    #   x 2 threads on 2 cores: a stage 1.1-1.35x slower than with 1 thread each, the most
    #   at 8-row decodes). 0 (the default): oversubscribed_barrier's model. Fitted with it,
    #   where the calibration holds a run with such processes.
    oversubscribed_layer_wait: float = 0.0
    # - memory_contention: on time-shared (CPU) hosts, a process's kernels run 1 + this
    #   slower for each other process of its node in its kernels at the same time (they share
    #   the node's memory bandwidth: on the AVX2 VM one thread reads ~17.5 GB/s alone, two
    #   ~27 together); fitted where the calibration holds dense runs of one process and of
    #   several, else 0.
    memory_contention: float = 0.0
    # The validation's observed predicted / measured throughput on held-out runs with this
    # file (0 = not validated): `pipeserve plan` prints it next to its predictions.
    validated_ratio_low: float = 0.0
    validated_ratio_high: float = 0.0
    validated_runs: int = 0

    def __post_init__(self) -> None:
        for f in ("flops_prefill", "flops_decode", "mem_bandwidth", "mem_bytes",
                  "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, f) > 0:
                raise PlanInputError(f"hardware {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.gpus_per_node < 1:
            raise PlanInputError(f"hardware {self.name!r}: gpus_per_node must be >= 1")
        if not (self.engine_work_scale > 0 and self.quantized_work_scale > 0 and self.engine_overhead_scale > 0
                and 0 < self.oversubscription_efficiency <= 1
                and 0 <= self.quantized_parallel_efficiency <= 1 and 0 <= self.oversubscribed_barrier <= 1
                and self.memory_contention >= 0 and self.oversubscribed_layer_wait >= 0):
            raise PlanInputError(f"hardware {self.name!r}: engine_work_scale, quantized_work_scale and "
                                 "engine_overhead_scale must be > 0, oversubscription_efficiency in (0, 1] "
                                 "and quantized_parallel_efficiency and oversubscribed_barrier in [0, 1], "
                                 "memory_contention and oversubscribed_layer_wait >= 0")
        if self.dtype not in DTYPE_BYTES:
            raise PlanInputError(f"hardware {self.name!r}: dtype must be one of {', '.join(DTYPE_BYTES)}")

    def stage_compute_share(self, stages_on_node: int) -> float:
        """Fraction of the node's compute one of ``stages_on_node`` stages gets."""
        if not self.shared_compute:
            return 1.0
        cores_each = self.cores / stages_on_node
        if cores_each <= 1.0:
            return 1.0 / stages_on_node          # time-sliced cores: no threading loss
        speedup = 1.0 + (cores_each - 1.0) * self.parallel_efficiency
        return speedup / self.cores

    @property
    def usable_bytes(self) -> float:
        return self.mem_bytes * self.memory_utilization - self.reserved_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _gpu(name: str, peak_flops: float, peak_bw: float, mem: float, gpn: int, intra_bw: float,
         intra_lat: float, inter_bw: float, inter_lat: float) -> Hardware:
    # Achieved fractions: ~70% of dense BF16 peak for GEMMs, ~80% of HBM peak for
    # streaming reads, ~80% of NVLink/PCIe and ~90% of the NIC line rate.
    return Hardware(name=name, flops_prefill=0.7 * peak_flops, flops_decode=0.7 * peak_flops,
                    mem_bandwidth=0.8 * peak_bw, mem_bytes=mem, gpus_per_node=gpn,
                    intra_node_bandwidth=0.8 * intra_bw, intra_node_latency=intra_lat,
                    inter_node_bandwidth=0.9 * inter_bw, inter_node_latency=inter_lat,
                    reserved_bytes=2 * GIB)


HARDWARE_PRESETS: dict[str, Hardware] = {
    # H100 SXM: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, NVLink4 450 GB/s per direction,
    # one 400 Gb/s NIC per GPU (50 GB/s).
    "H100-SXM": _gpu("H100-SXM", 989e12, 3.35e12, 80 * GIB, 8, 450e9, 8e-6, 50e9, 15e-6),
    "H200": _gpu("H200", 989e12, 4.8e12, 141e9, 8, 450e9, 8e-6, 50e9, 15e-6),
    # A100 SXM 80 GB: 312 TFLOP/s, 2.04 TB/s, NVLink3 300 GB/s, HDR 200 Gb/s.
    "A100-80G": _gpu("A100-80G", 312e12, 2.039e12, 80 * GIB, 8, 300e9, 10e-6, 25e9, 15e-6),
    # L4: 121 TFLOP/s BF16 dense, 300 GB/s GDDR6, PCIe Gen4 x16 (32 GB/s), 100 GbE.
    "L4": _gpu("L4", 121e12, 300e9, 24 * GIB, 8, 32e9, 15e-6, 12.5e9, 30e-6),
}

_PREFIX = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "m": 1e-3, "u": 1e-6, "µ": 1e-6}
_QUANTITY = re.compile(r"^\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([kMGTP]i?|[muµ])?\s*"
                       r"(FLOP/s|flop/s|B/s|b/s|bit/s|B|b|bit|s)?\s*$")


def parse_quantity(value: float | int | str, key: str) -> float:
    """``3.35e12``, ``"80GiB"``, ``"400Gb/s"`` (lower-case b: bits), ``"50GB/s"``, ``"5us"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _QUANTITY.match(str(value))
    if match is None:
        raise PlanInputError(f"hardware field {key}: cannot parse {value!r} "
                             "(write 3.35e12, '80GiB', '400Gb/s', '50GB/s' or '5us')")
    number, prefix, unit = match.group(1), match.group(2) or "", match.group(3) or ""
    if prefix in ("m", "u", "µ") and unit != "s":
        raise PlanInputError(f"hardware field {key}: {value!r}: m/u prefixes are for seconds; use M for mega")
    scale = _PREFIX[prefix] / (8.0 if unit in ("b/s", "bit/s", "b", "bit") else 1.0)
    return float(number) * scale


_FIELD_ALIASES = {
    "flops": ("flops_prefill", "flops_decode"), "flop_s": ("flops_prefill", "flops_decode"),
    "memory_bandwidth": ("mem_bandwidth",), "memory_size": ("mem_bytes",), "memory": ("mem_bytes",),
}
_NESTED = {"intra_node": "intra_node_", "inter_node": "inter_node_"}


def hardware_from_dict(raw: dict, name: str) -> Hardware:
    """Build from a flat or nested mapping (``intra_node: {bandwidth, latency}``)."""
    flat: dict = {}
    for key, value in raw.items():
        if key in _NESTED and isinstance(value, dict):
            for sub, subval in value.items():
                flat[_NESTED[key] + sub] = subval
        else:
            for target in _FIELD_ALIASES.get(key, (key,)):
                flat.setdefault(target, value)
    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(flat) - set(fields))
    if unknown:
        raise PlanInputError(f"hardware file {name!r}: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(fields)}")
    flat.setdefault("name", name)
    missing = [f.name for f in fields.values()
               if f.default is dataclasses.MISSING and f.name not in flat]
    if missing:
        raise PlanInputError(f"hardware file {name!r}: missing field(s) {', '.join(missing)}")
    return Hardware(**{k: _coerce(k, v, fields[k].type) for k, v in flat.items()})


def _coerce(key: str, value, type_name) -> object:
    if type_name in ("str", str):
        return str(value)
    if type_name in ("bool", bool):
        return bool(value)
    if type_name in ("int", int):
        return int(parse_quantity(value, key))
    return parse_quantity(value, key)


def load_hardware(spec: str) -> Hardware:
    """``--hardware``: a preset name (case-insensitive) or a YAML/JSON file."""
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
        return hardware_from_dict(_read_file(path), path.stem)
    name = find_preset(spec, HARDWARE_PRESETS, {}, "hardware")
    return HARDWARE_PRESETS[name]


def _read_file(path: Path) -> dict:
    if not path.exists():
        raise PlanInputError(f"hardware file {str(path)!r} does not exist")
    try:
        text = path.read_text()
        if path.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml  # only needed for YAML hardware files
            raw = yaml.safe_load(text)
    except Exception as exc:  # any parse error is a user input problem
        raise PlanInputError(f"cannot read hardware file {str(path)!r}: {exc}") from exc
    if not isinstance(raw, dict):
        raise PlanInputError(f"hardware file {str(path)!r} must hold a mapping of fields")
    return raw


# This machine, from `pipeserve plan --calibrate --dtype bfloat16` (rounded; rerun
# --calibrate and pass the file for your own host). One process per stage with
# cores // P threads, so stages share the cores.
HARDWARE_PRESETS["cpu-local"] = Hardware(
    name="cpu-local", flops_prefill=2 * 181e9, flops_decode=2 * 222e9, mem_bandwidth=34e9,
    mem_bytes=25.2e9, gpus_per_node=64, intra_node_bandwidth=5.5e9, intra_node_latency=51e-6,
    inter_node_bandwidth=5.5e9, inter_node_latency=51e-6, layer_overhead=519e-6,
    dtype="bfloat16", memory_utilization=0.5, reserved_bytes=1 * GIB, shared_compute=True,
    cores=2, parallel_efficiency=0.80, kv_read_amplification=2.62,
    driver_step_overhead=31e-6, driver_seq_overhead=26e-6, stage_step_overhead=27e-6,
    stage_seq_overhead=9.3e-6, tp_allreduce_latency=0.58e-3)   # TP: calibrate.CPU_TP_ALLREDUCE_LATENCY
