"""Engine configuration: one frozen dataclass whose fields are the CLI flags.

``--max-num-seqs`` on the command line is ``max_num_seqs`` here and in
``LLM(...)``, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root() -> Path:
    """Where pipeserve keeps what it builds once per machine (compiled kernels, converted
    tokenizers): ``$PIPESERVE_CACHE_DIR``, default ``~/.cache/pipeserve``."""
    return Path(os.environ.get("PIPESERVE_CACHE_DIR") or Path.home() / ".cache" / "pipeserve")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (x86 ``flags``, Arm ``Features``);
    empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (x86 AVX512_BF16 or AMX-BF16, Arm BF16).
    Without it, PyTorch's bfloat16 matmuls convert in software: on an AVX2 EPYC they ran
    9x slower than float32 (64 x 576 x 1536, one thread)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16 tile multiplies (Intel Sapphire Rapids and later), which
    PyTorch's oneDNN matmuls use for bfloat16: 1.1-1.6 TFLOP/s a core at prefill shapes, ~10x
    AVX512_BF16's vdpbf16ps (benchmarks/README.md, thirty-fifth session)."""
    return "amx_bf16" in cpu_flags()


def auto_dtype(device: str) -> str:
    """``--dtype auto``: bfloat16 on CUDA and on CPUs with native bfloat16, float32 on
    other CPUs (as vLLM's CPU backend does where bfloat16 is not supported)."""
    if not device.startswith("cpu"):
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8`` -> [0, 1, 2, 3, 8]; ValueError naming the part that is not a CPU list."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a CPU number or range (e.g. 0-3,8)") from None
        if first < 0 or last < first:
            raise ValueError(f"{part.strip()!r} is not a CPU range (first <= last, both >= 0)")
        cpus.extend(range(first, last + 1))
    return cpus


def check_cpu_bind(setting: str) -> None:
    """--cpu-bind: auto, none, or CPU lists separated by ``|`` (ValueError otherwise; worker/cpu_bind.py)."""
    if setting not in ("auto", "none"):
        for part in setting.split("|"):
            parse_cpu_list(part)


KV_CACHE_DTYPES = ("auto", "int8", "fp8")   # --kv-cache-dtype; the formats live in pipeserve.model.kv_quant


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    chat_template: str | None = None          # a Jinja template, or a file holding one (the model's own: None)
    dtype: str = "auto"                       # auto | float32 | bfloat16 | float16
    device: str = "cpu"                       # cpu | cuda
    seed: int = 0
    max_model_len: int | None = None          # default: the model's context length
    # KV cache
    block_size: int = 16
    kv_cache_memory: str | int = "1GiB"       # bytes, or a size string ("512MiB")
    kv_cache_dtype: str = "auto"              # auto (the model dtype) | int8 | fp8 (8-bit rows + a scale)
    num_gpu_blocks_override: int | None = None
    swap_space: str | int = "1GiB"            # host pool for preemption by swap
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"           # auto | torch | cpu (C decode kernel)
    quantization: str = "auto"                # auto | none | int8 | int4 (weights in memory)
    quantization_group_size: int = 32         # int8/int4: weights per scale (a multiple of 32)
    prepack_weights: bool = False             # bfloat16 CPU Linear layers keep a second, packed copy
    # Scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # PP > 1: a prompt's next chunk may be scheduled while its earlier chunks are in flight
    pipeline_prompt_chunks: bool = True
    # PP > 1, async: while every live sequence is in flight, a micro-batch's next decode is sent
    # before its input tokens are sampled, and the last stage sends them to stage 0 directly
    # (llm_engine, "decode ahead")
    pp_decode_ahead: bool = True
    scheduling_policy: str = "fcfs"           # fcfs | priority | fair
    # auto: swap where the host pool is the same memory as the cache (CPU stages all on this host)
    # and both fit in the memory available, else recompute (llm_engine.resolve_preemption_mode)
    preemption_mode: str = "auto"             # auto | recompute | swap
    # Pipeline
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1             # ranks per stage (pipeserve/model/tensor_parallel.py)
    tp_all_reduce: str = "shm"                # shm (shared memory, one host) | gloo
    threads_per_stage: int | None = None      # per rank; default: cores // (P * T)
    adaptive_threads: bool = True             # fewer threads while other work holds the cores (worker/thread_governor.py)
    cpu_bind: str = "auto"                    # auto | none | "0-3|4-7": a host's stages on their CPUs (worker/cpu_bind.py)
    pp_partition: str = "balanced"            # balanced | uniform | auto | "a,b,c"
    pp_schedule: str = "async"                # async | gpipe | interleaved
    pp_max_inflight: int | None = None        # default: P
    pp_virtual_stages: int = 1
    pp_micro_batches: int | None = None       # gpipe M (default: P)
    pp_lm_head: str = "auto"                  # auto | last | shared (pipeline/lm_head.py)
    stage_speeds: str | None = None           # "1,0.5"
    stage_timeout: float = 60.0
    max_stage_restarts: int = 3               # pipeline restarts after a stage failure, within ...
    stage_restart_window: float = 600.0       # ... this many seconds (0: the engine's lifetime)
    stage_rejoin_timeout: float = 300.0       # wait for a replacement remote `pipeserve worker`
    trace_file: str | None = None
    profile: bool = False                     # time each class of work per stage, and the driver (metrics/profile.py)
    # Several hosts
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29533
    rendezvous_timeout: float = 60.0
    # Front-door bounds
    max_n: int = 128                          # most sequences one request may ask for (OpenAI's n limit)
    # Shared secret every pipeline connection proves (HMAC); default $PIPESERVE_CLUSTER_KEY, or a random
    # per-run key on one host. Never sent to the stages, never shown in repr.
    cluster_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.scheduling_policy in ("fcfs", "priority", "fair"), "scheduling_policy",
                 f"must be fcfs, priority or fair, got {self.scheduling_policy!r}")
        _require(self.preemption_mode in ("auto", "recompute", "swap"), "preemption_mode",
                 f"must be auto, recompute or swap, got {self.preemption_mode!r}")
        _require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size",
                 f"must be >= 1, got {self.pipeline_parallel_size}")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size",
                 f"must be >= 1 (ranks per pipeline stage), got {self.tensor_parallel_size}")
        _require(self.tp_all_reduce in ("shm", "gloo"), "tp_all_reduce",
                 f"must be shm or gloo, got {self.tp_all_reduce!r}")
        _require(self.pp_schedule in ("async", "gpipe", "interleaved"), "pp_schedule",
                 f"must be async, gpipe or interleaved, got {self.pp_schedule!r}")
        _require(self.pp_lm_head in ("auto", "last", "shared"), "pp_lm_head",
                 f"must be auto, last or shared, got {self.pp_lm_head!r}")
        _require(self.attention_backend in ("auto", "torch", "cpu"), "attention_backend",
                 f"must be auto, torch or cpu, got {self.attention_backend!r}")
        _require(self.max_stage_restarts >= 0, "max_stage_restarts",
                 f"must be >= 0 (0: a stage failure ends every request), got {self.max_stage_restarts}")
        _require(self.stage_restart_window >= 0, "stage_restart_window",
                 f"must be >= 0 seconds (0: --max-stage-restarts over the engine's life), "
                 f"got {self.stage_restart_window}")
        _require(self.stage_rejoin_timeout > 0, "stage_rejoin_timeout",
                 f"must be > 0 seconds, got {self.stage_rejoin_timeout}")
        _require(self.quantization in ("auto", "none", "int8", "int4"), "quantization",
                 f"must be auto, none, int8 or int4, got {self.quantization!r}")
        _require(self.quantization_group_size >= 32 and self.quantization_group_size % 32 == 0,
                 "quantization_group_size", f"must be a positive multiple of 32, got {self.quantization_group_size}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be auto (the model dtype), int8 or fp8, got {self.kv_cache_dtype!r}")
        parse_size(self.kv_cache_memory)
        parse_size(self.swap_space)
        self._check_cpu_bind()
        self._check_bounds()

    def _check_cpu_bind(self) -> None:
        try:
            check_cpu_bind(self.cpu_bind)
        except ValueError as exc:
            raise ValueError(f"cpu_bind: must be auto, none or CPU lists per stage separated by '|' "
                             f"(e.g. 0-3|4-7): {exc}") from None
        if self.cpu_bind not in ("auto", "none") and self.nnodes == 1 and self.pipeline_parallel_size > 1:
            sets = len(self.cpu_bind.split("|"))
            _require(sets == self.pipeline_parallel_size, "cpu_bind",
                     f"lists {sets} CPU sets for {self.pipeline_parallel_size} stages (one per stage, '|' between)")

    def _check_bounds(self) -> None:
        """Values that would hang or crash the engine later are refused here, naming the flag."""
        for name in ("max_model_len", "num_gpu_blocks_override", "threads_per_stage", "pp_max_inflight",
                     "pp_micro_batches"):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, f"must be >= 1 (or unset for the default), got {value}")
        for name in ("pp_virtual_stages", "nnodes", "max_n"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("stage_timeout", "rendezvous_timeout"):
            value = getattr(self, name)
            _require(value > 0 and math.isfinite(value), name, f"must be a positive number of seconds, got {value}")
        _require(0 <= self.node_rank < self.nnodes, "node_rank",
                 f"must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        _require(0 <= self.master_port <= 65535, "master_port", f"must be a TCP port (0-65535), got {self.master_port}")
        _require(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "device",
                 f"must be cpu or cuda, got {self.device!r}")
        _require(self.pp_virtual_stages == 1 or self.pp_schedule == "interleaved", "pp_virtual_stages",
                 f"only applies to --pp-schedule interleaved (got {self.pp_virtual_stages} with "
                 f"{self.pp_schedule!r})")

    @property
    def torch_dtype_name(self) -> str:
        return auto_dtype(self.device) if self.dtype == "auto" else self.dtype

    @property
    def kv_cache_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)

    @property
    def swap_space_bytes(self) -> int:
        return parse_size(self.swap_space)

    @property
    def stage_threads(self) -> int:
        if self.threads_per_stage:
            return self.threads_per_stage
        return max(1, (os.cpu_count() or 1) // (self.pipeline_parallel_size * self.tensor_parallel_size))

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(value: str | int) -> int:
    """``"512MiB"`` -> 536870912. Integers are bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    text = str(value).strip().lower()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(digits):].strip()
    try:
        number = float(digits)
    except ValueError:
        raise ValueError(f"cannot parse size {value!r}: use bytes or e.g. '512MiB', '2GiB'") from None
    if unit not in _UNITS or number < 0:
        raise ValueError(f"cannot parse size {value!r}: use bytes or e.g. '512MiB', '2GiB'")
    return int(number * _UNITS[unit])


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} {message}")
