"""Where a run's time goes: exclusive timers around the real calls, per class of work.

``--profile`` (``EngineConfig.profile``) makes every stage account each
forward's wall time into the classes below, and the driver its own step
phases (wall and thread CPU time). Nothing is installed without it: the
timers are wrappers put on the model's and the engine's objects at start-up
(``pipeserve/worker/profiler.py``, ``LLMEngine``), so profiling off runs the
same code as before.

Time is *exclusive*: a timed call's own time is its elapsed time minus that of
the timed calls inside it (``Accounts.timed``), so the classes of one stage add
up to the time its runner spent in ``execute`` (its busy time), with nothing
counted twice. Each class also carries the FLOPs and bytes its calls needed;
against a calibrated GEMM peak and memory bandwidth those give a roofline
time, the least time the work could take (``breakdown``).

Plain Python (no torch): the stage ships a ``StageProfile`` to the driver.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A stage's classes, in report order, and what each holds.
STAGE_CLASSES = {
    "prefill_gemm": "linear layers' rows of prompt tokens (qkv, o, gate_up, down)",
    "decode_gemm": "linear layers' rows of decode tokens",
    "prefill_attention": "attention of prompt tokens over their context",
    "decode_attention": "attention of decode tokens over their KV blocks",
    "kv_write": "writing the step's new K/V into the paged cache",
    "elementwise": "RMSNorm (+ residual add), RoPE, SiLU-mul and the glue around them",
    "logits": "final norm and LM head of the sampled rows",
    "sampling": "the sampler (penalties, filters, the draw, logprobs)",
    "stage_other": "the runner's own Python: step metadata, embedding, layer loop",
}
# The driver's phases (engine thread).
DRIVER_CLASSES = {
    "schedule": "Scheduler.schedule: admission, KV blocks, preemption",
    "build_step": "turning a schedule into a StepInput",
    "submit": "handing the step to the executor (PP > 1: encode and queue it)",
    "wait": "waiting for a result (PP > 1: the engine thread polls the result queue)",
    "process": "results back: scheduler bookkeeping, detokenization, stop checks, outputs",
    "driver_other": "the rest of LLMEngine.step and the caller's loop",
}
# Where one linear layer's self time goes: split by the step's prompt/decode rows.
GEMM = "gemm"


@dataclass
class StageProfile:
    """One stage's cumulative figures (it ships the latest to the driver)."""

    stage: int
    threads: int                                   # torch threads of the stage
    ns: dict = field(default_factory=dict)         # class -> exclusive wall ns
    flops: dict = field(default_factory=dict)      # class -> FLOPs
    bytes: dict = field(default_factory=dict)      # class -> bytes moved (lower bound)
    steps: int = 0                                 # forwards (chunks) run
    busy_ns: int = 0                               # wall ns inside the runner's execute
    prefill_tokens: int = 0
    decode_tokens: int = 0


class Accounts:
    """Exclusive-time accounts: ``timed(fn, account)`` wraps ``fn`` so that its
    self time (elapsed minus timed callees) goes to ``account(self_ns, args, out)``.

    With ``cpu`` the thread's CPU time is accounted the same way, into ``cpu_ns``.
    A call that raises is not accounted (its step failed), but leaves the
    callee times of the calls around it right.
    Single-threaded by design: a stage's forward and the engine loop each run
    on one thread.
    """

    def __init__(self, classes: dict[str, str], cpu: bool = False) -> None:
        self.ns = dict.fromkeys(classes, 0)
        self.cpu_ns = dict.fromkeys(classes, 0)
        self.flops = dict.fromkeys(classes, 0)
        self.bytes = dict.fromkeys(classes, 0)
        self.cpu = cpu
        self._inner = 0          # wall ns of timed callees of the call now running
        self._inner_cpu = 0

    def timed(self, fn: Callable, account: Callable[[int, tuple, Any], None] | str) -> Callable:
        """``account``: a class name (the self time goes there, CPU time too with ``cpu``)
        or a function of (self ns, args, result) that splits it."""
        cpu_name = account if isinstance(account, str) and self.cpu else None
        if isinstance(account, str):
            account = self._to_class(account)
        wall = time.perf_counter_ns
        cpu = time.thread_time_ns if self.cpu else None

        def call(*args, **kwargs):
            outer, outer_cpu = self._inner, self._inner_cpu
            self._inner = self._inner_cpu = 0
            c0 = cpu() if cpu is not None else 0
            t0 = wall()
            try:
                out = fn(*args, **kwargs)
            finally:
                dt = wall() - t0
                dc = cpu() - c0 if cpu is not None else 0
                inner, inner_cpu = self._inner, self._inner_cpu
                self._inner, self._inner_cpu = outer + dt, outer_cpu + dc
            account(dt - inner, args, out)
            if cpu_name is not None:
                self.cpu_ns[cpu_name] += dc - inner_cpu
            return out

        call.__wrapped__ = fn      # type: ignore[attr-defined]
        return call

    def _to_class(self, name: str) -> Callable[[int, tuple, Any], None]:
        def account(self_ns: int, args: tuple, out: Any) -> None:
            self.ns[name] += self_ns
        return account

    def add(self, name: str, flops: float = 0, nbytes: float = 0) -> None:
        self.flops[name] += flops
        self.bytes[name] += nbytes


@dataclass(frozen=True)
class Roofline:
    """Peak rates a class's FLOPs and bytes are held against (per stage: the
    machine's figures times the stage's share of the cores)."""

    gemm_flops: float          # FLOP/s, GEMM peak of the whole machine in the activations' dtype
    mem_bandwidth: float       # bytes/s of the whole machine
    cores: int
    source: str                # where the figures came from

    def for_threads(self, threads: int) -> tuple[float, float]:
        share = min(1.0, threads / max(1, self.cores))
        return self.gemm_flops * share, self.mem_bandwidth * share


def subtract(after: StageProfile, before: StageProfile | None) -> StageProfile:
    """``after`` minus ``before``: the figures of the run between two snapshots."""
    if before is None:
        return after
    diff = lambda a, b: {k: a.get(k, 0) - b.get(k, 0) for k in a}   # noqa: E731
    return StageProfile(after.stage, after.threads, diff(after.ns, before.ns), diff(after.flops, before.flops),
                        diff(after.bytes, before.bytes), after.steps - before.steps,
                        after.busy_ns - before.busy_ns, after.prefill_tokens - before.prefill_tokens,
                        after.decode_tokens - before.decode_tokens)


def breakdown(profile: StageProfile, roofline: Roofline | None) -> dict:
    """A stage's classes as a JSON-able dict: ms, share of its busy time, achieved
    rates and, with ``roofline``, the least time each class could take
    (max(FLOPs / GEMM peak, bytes / bandwidth)) and measured / that."""
    busy = profile.busy_ns
    peak, bandwidth = roofline.for_threads(profile.threads) if roofline else (None, None)
    rows = []
    for name in STAGE_CLASSES:
        ns = profile.ns.get(name, 0)
        flops, nbytes = profile.flops.get(name, 0), profile.bytes.get(name, 0)
        row = {"class": name, "ms": ns / 1e6, "share": ns / busy if busy else 0.0,
               "gflops": flops / 1e9, "gbytes": nbytes / 1e9,
               "gflop_per_s": flops / ns if ns else None, "gbyte_per_s": nbytes / ns if ns else None}
        if peak and (flops or nbytes):
            least = max(flops / peak, nbytes / bandwidth)
            row["roofline_ms"] = least * 1e3
            row["of_roofline"] = least / (ns / 1e9) if ns else None
            row["bound"] = "compute" if flops / peak >= nbytes / bandwidth else "memory"
        rows.append(row)
    classes_ns = sum(profile.ns.get(n, 0) for n in STAGE_CLASSES)
    return {"stage": profile.stage, "threads": profile.threads, "steps": profile.steps,
            "busy_ms": busy / 1e6, "classes_ms": classes_ns / 1e6,
            "prefill_tokens": profile.prefill_tokens, "decode_tokens": profile.decode_tokens,
            "classes": rows}


def format_breakdown(stages: list[dict], driver: dict | None, roofline: Roofline | None) -> str:
    """The breakdown as a plain-text table (the bench prints it; the README copies it)."""
    lines = []
    if roofline:
        lines.append(f"roofline: GEMM peak {roofline.gemm_flops / 1e9:.0f} GFLOP/s, memory "
                     f"{roofline.mem_bandwidth / 1e9:.1f} GB/s over {roofline.cores} cores ({roofline.source}); "
                     "a stage gets its threads' share")
    for st in stages:
        lines.append(f"stage {st['stage']} ({st['threads']} threads, {st['steps']} forwards, "
                     f"{st['prefill_tokens']} prompt + {st['decode_tokens']} decode tokens): busy "
                     f"{st['busy_ms']:.0f} ms, classes sum {st['classes_ms']:.0f} ms")
        lines.append(f"  {'class':<18}{'ms':>9}{'share':>7}{'GFLOP/s':>9}{'GB/s':>7}{'roofline ms':>12}"
                     f"{'of roof':>8}")
        for row in st["classes"]:
            rate = "-" if row["gflop_per_s"] is None or not row["gflops"] else f"{row['gflop_per_s']:.0f}"
            bw = "-" if row["gbyte_per_s"] is None or not row["gbytes"] else f"{row['gbyte_per_s']:.1f}"
            roof = f"{row['roofline_ms']:.0f}" if "roofline_ms" in row else "-"
            eff = f"{row['of_roofline']:.0%}" if row.get("of_roofline") is not None else "-"
            lines.append(f"  {row['class']:<18}{row['ms']:>9.0f}{row['share']:>7.1%}{rate:>9}{bw:>7}"
                         f"{roof:>12}{eff:>8}")
        for name in ("recv_ms", "send_ms", "wait_ms"):
            if name in st:
                share = st[name] / st["busy_ms"] if st["busy_ms"] else 0.0
                lines.append(f"  {'comm ' + name[:-3]:<18}{st[name]:>9.0f}{share:>7.1%}   (outside busy time)")
    if driver:
        lines.append(f"driver (engine thread; {driver['steps']} steps): wall {driver['wall_ms']:.0f} ms, "
                     f"CPU {driver['cpu_ms']:.0f} ms = {driver['cpu_ms_per_step']:.2f} ms/step")
        for row in driver["phases"]:
            lines.append(f"  {row['phase']:<18}{row['cpu_ms']:>9.0f} ms CPU{row['wall_ms']:>9.0f} ms wall")
        if driver.get("process_cpu_ms") is not None:
            lines.append(f"  driver process, all threads: {driver['process_cpu_ms']:.0f} ms CPU = "
                         f"{driver['process_cpu_ms'] / max(1, driver['steps']):.2f} ms/step")
    return "\n".join(lines)
