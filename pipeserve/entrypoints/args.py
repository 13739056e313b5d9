"""Engine flags on the command line, derived from ``EngineConfig`` so the two never drift."""

from __future__ import annotations

import argparse
import dataclasses

from pipeserve.config import EngineConfig

_HELP = {
    "adaptive_threads": "lower a stage's threads while other processes hold its cores, raise them again when "
                        "the cores are free (default on; --no-adaptive-threads keeps --threads-per-stage fixed)",
    "cpu_bind": "auto (each stage of a host on its own equal share of the CPUs, when each gets its "
                "threads; default) | none | CPU lists per stage of the host, '|' between them (e.g. 0-3|4-7)",
    "model": "HF directory, .gguf file, or built-in name (default: smollm2-135m-instruct)",
    "dtype": "auto (bfloat16 on CUDA and on CPUs with native bfloat16, else float32) | float32 | bfloat16 | float16",
    "kv_cache_memory": "KV cache budget per stage, e.g. 512MiB, 2GiB",
    "kv_cache_dtype": "auto (the model dtype; default) | int8 | fp8 (e4m3): 8-bit K/V rows with one float32 "
                      "scale per token and kv head, about twice the blocks in the same --kv-cache-memory",
    "swap_space": "host memory pool for preemption by swap, e.g. 1GiB",
    "chat_template": "chat template to use instead of the model's own (vLLM's flag): the path of a Jinja "
                     "file, or the template itself; for a model that ships none, or a broken one",
    "pipeline_parallel_size": "number of pipeline stages (processes)",
    "tensor_parallel_size": "ranks (processes) per pipeline stage, each holding a slice of every layer: "
                            "heads, MLP width, vocabulary (default: 1)",
    "tp_all_reduce": "shm (through shared memory between a stage's ranks, one host; default) | gloo",
    "pp_partition": "balanced (by the model's shapes, LM head included) | uniform | auto (measured) | "
                    "layer counts per stage (e.g. 19,11)",
    "pp_schedule": "async | gpipe | interleaved",
    "pp_decode_ahead": "async: with fewer sequences than micro-batches (one request alone), send a decode "
                       "before its input token is sampled; the last stage hands that token to stage 0 "
                       "directly instead of through the driver (default on)",
    "pp_lm_head": "which stages run the LM head: last (the last stage, every step) | shared (the first "
                  "and the last stage, step by step, whichever has less work: the head is no longer "
                  "extra work for the last stage alone; stage 0 uses its embedding as the head when the "
                  "model ties them, else loads a copy) | auto (shared where the head is tied to the "
                  "embedding, PP > 1, one chunk a stage and one rank a stage; else last; default)",
    "scheduling_policy": "fcfs | priority | fair",
    "preemption_mode": "auto (swap on CPU stages all on this host when the --swap-space pool fits beside the "
                       "weights and the cache, else recompute) | recompute | swap",
    "stage_speeds": "relative stage speeds for auto partition, e.g. 1,0.5",
    "attention_backend": "auto (cpu on CPU when gcc is present, else torch) | torch | cpu (C decode kernel)",
    "quantization": "auto (GGUF kept in its own types, safetensors in --dtype) | none (dequantize to "
                    "--dtype) | int8 | int4 (weight-only, group-wise, at load)",
    "prepack_weights": "bfloat16 CPU linear layers keep a second copy of their weight, packed once for the GEMM kernels (about 1.03-1.07x faster stages, twice the dense weight bytes; default: off)",
    "trace_file": "write a Chrome trace (Perfetto) of the stage timelines here",
    "profile": "time every class of work on each stage (GEMM, attention, elementwise, sampling) and the "
               "driver's phases; reported by LLM.stats()['profile'] and `bench throughput --profile`",
    "rendezvous_timeout": "seconds for the stages to join, and for a loading stage to show progress (its "
                          "CPU time or bytes read move): a load that keeps moving is waited for however "
                          "long it takes (default: 60)",
    "stage_timeout": "seconds without a result, while work is in flight, before the stages are pinged: one "
                     "that does not answer, or whose step has run this long without using the CPU, has "
                     "failed; one busy with a long step is waited for (default: 60)",
    "max_stage_restarts": "times the pipeline is relaunched after a stage dies or stalls, replaying every "
                          "request, within --stage-restart-window (0: each request ends with an error "
                          "instead; default: 3)",
    "stage_restart_window": "seconds over which --max-stage-restarts counts: one more failure inside it ends "
                            "every request (a crash loop), older restarts no longer count, so a long-lived "
                            "server survives failures spread over its life (0: the engine's lifetime; "
                            "default: 600)",
    "stage_rejoin_timeout": "seconds to wait for a replacement `pipeserve worker` of a failed remote stage "
                            "(default: 300)",
}
_HELP["cluster_key"] = ("shared secret of the pipeline's hosts (prefer $PIPESERVE_CLUSTER_KEY: a flag shows in ps); "
                       "required with --nnodes > 1")
_SHORT = {"pipeline_parallel_size": ["-pp"], "tensor_parallel_size": ["-tp"]}


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """Add one flag per ``EngineConfig`` field, except those in ``skip``
    (a command whose own flag has the same name, e.g. a sampling ``--seed``)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *_SHORT.get(f.name, [])]
        default = f.default
        if isinstance(default, bool):
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=_HELP.get(f.name))
            continue
        group.add_argument(*flags, dest=f.name, type=_parser_for(f.name, default), default=default,
                           help=_HELP.get(f.name, f"(default: {default})"))


def _parser_for(name: str, default):
    if name in ("kv_cache_memory", "swap_space"):
        return str
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    if default is None and name in ("max_model_len", "num_gpu_blocks_override", "threads_per_stage",
                                    "pp_max_inflight", "pp_micro_batches"):
        return int
    return str


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if hasattr(args, f.name)}
    return EngineConfig(**values)
