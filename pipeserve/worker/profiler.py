"""``--profile`` on a stage: timers on its model's real calls, per class of work.

``StageProfiler.instrument(runner)`` replaces, on that runner's objects only,
the methods that do each class of work with timed wrappers
(``metrics.profile.Accounts``): the linear layers (GEMM, split between prompt
and decode rows by the step's row counts), the attention backend's prefill
and decode halves and its cache write, the norms, the attention and MLP
modules' own elementwise work (RoPE, SiLU-mul), the LM head and the sampler,
and ``execute`` itself (what is left is the runner's own Python). A fused decode
stage (``model/cpu_decode.py``, one C call for all the layers) is timed as a
whole and split by the clock its C code keeps per class when asked. Without
``--profile`` nothing is replaced. Each wrapper costs about a microsecond; a
step of a 30-layer model makes ~400 such calls.

FLOPs and bytes are counted from shapes (dense matmul FLOPs 2·m·n·k; bytes
read and written once, weights at their stored size): the least work the
class must do, for its roofline.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from pipeserve.metrics.profile import STAGE_CLASSES, Accounts, StageProfile
from pipeserve.worker.step import StepInput


class StageProfiler:
    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.acc = Accounts(STAGE_CLASSES)
        self.steps = self.busy_ns = self.prefill_tokens = self.decode_tokens = 0
        # The step being run: its prompt / decode rows and attention work.
        self._prefill_rows = self._decode_rows = 0
        self._decode_keys = 0          # sum of the decodes' context lengths
        self._prefill_pairs = 0        # (query, key) pairs the prompt rows attend
        self._prefill_keys = 0         # keys the prompt chunks read (their context lengths)

    def snapshot(self) -> StageProfile:
        a = self.acc
        return StageProfile(self.stage, torch.get_num_threads(), dict(a.ns), dict(a.flops), dict(a.bytes),
                            self.steps, self.busy_ns, self.prefill_tokens, self.decode_tokens)

    # -- instrumenting -------------------------------------------------------
    def instrument(self, runner: Any) -> None:
        """Wrap ``runner``'s model, backend and sampler (a ``ModelRunner``)."""
        model = runner.model
        cfg, elem = model.cfg, torch.tensor([], dtype=runner.dtype).element_size()
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, *_linears(mlp)):
                linear.forward = self.acc.timed(linear.forward, self._gemm_account(linear, elem))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.add_norm = self.acc.timed(norm.add_norm, self._norm_account(elem))
            rope_bytes = 2 * (cfg.q_size + cfg.kv_size) * elem      # q and k read and written, per row
            attn.forward = self.acc.timed(attn.forward, self._rows_account(rope_bytes))
            if hasattr(mlp, "intermediate_size"):
                mlp.forward = self.acc.timed(mlp.forward, self._rows_account(3 * mlp.intermediate_size * elem))
        self._instrument_backend(model.backend, cfg, elem)
        model.on_fused_decode = self._fused_instrumenter(model, cfg, elem)
        if model.is_last:
            model.compute_logits = self.acc.timed(model.compute_logits, self._logits_account(model, elem))
        if runner.sampler is not None:
            runner.sampler.sample = self.acc.timed(runner.sampler.sample, "sampling")
        runner.execute = self._busy(self.acc.timed(runner.execute, self._execute_account()))

    def _instrument_backend(self, backend: Any, cfg: Any, elem: int) -> None:
        if getattr(backend, "_profiled", False):   # one backend serves every layer (and chunk)
            return
        backend._profiled = True
        row_bytes, flops_per_pair = _attention_costs(cfg, elem)

        into = [False]    # inside attend_decodes_into: its own account counts the work, once

        def decode(self_ns: int, args: tuple, out: Any) -> None:
            self.acc.ns["decode_attention"] += self_ns
            if not into[0]:
                self.acc.add("decode_attention", flops_per_pair * self._decode_keys, row_bytes * self._decode_keys)

        def decode_into(self_ns: int, args: tuple, out: Any) -> None:
            self.acc.ns["decode_attention"] += self_ns
            self.acc.add("decode_attention", flops_per_pair * self._decode_keys, row_bytes * self._decode_keys)

        def prefill(self_ns: int, args: tuple, out: Any) -> None:
            self.acc.ns["prefill_attention"] += self_ns
            self.acc.add("prefill_attention", flops_per_pair * self._prefill_pairs,
                         row_bytes * self._prefill_keys)

        def write(self_ns: int, args: tuple, out: Any) -> None:
            self.acc.ns["kv_write"] += self_ns
            self.acc.add("kv_write", 0, 2 * row_bytes * args[0].shape[0])   # read k/v, write the cache

        backend.attend_decodes = self.acc.timed(backend.attend_decodes, decode)
        timed_into = self.acc.timed(backend.attend_decodes_into, decode_into)

        def attend_decodes_into(*args, **kwargs):
            into[0] = True
            try:
                return timed_into(*args, **kwargs)
            finally:
                into[0] = False

        backend.attend_decodes_into = attend_decodes_into
        backend.attend_prefills = self.acc.timed(backend.attend_prefills, prefill)
        backend.forward = self.acc.timed(backend.forward, write)

    def _fused_instrumenter(self, model: nn.Module, cfg: Any, elem: int):
        """For the fused decode stage (one C call for all of a step's layers, made at the
        first forward): the call is timed, and the C code's own per-class clock splits it."""
        linears = [lin for layer in model.layers
                   for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *_linears(layer.mlp))]
        shapes = [_in_out(lin) for lin in linears]
        weight_bytes = sum(_weight_bytes(lin) for lin in linears)
        nk, k_plus_n = sum(n * k for k, n in shapes), sum(k + n for k, n in shapes)
        layers = len(model.layers)
        row_bytes, flops_per_pair = _attention_costs(cfg, elem)
        rows_bytes = (2 * 4 * cfg.hidden_size + 2 * (cfg.q_size + cfg.kv_size)
                      + 3 * cfg.intermediate_size) * elem                   # norms, RoPE, SiLU-mul per row

        def account(self_ns: int, args: tuple, out: Any) -> None:
            parts = fused.take_profile()
            rows, acc = args[1].shape[0], self.acc
            acc.ns["decode_gemm"] += round(parts["gemm"])
            acc.ns["decode_attention"] += round(parts["attention"])
            acc.ns["kv_write"] += round(parts["kv_write"])
            acc.ns["elementwise"] += max(0, self_ns - round(parts["gemm"] + parts["attention"] + parts["kv_write"]))
            acc.add("decode_gemm", 2 * rows * nk, weight_bytes + rows * k_plus_n * elem)
            acc.add("decode_attention", layers * flops_per_pair * self._decode_keys,
                    layers * row_bytes * self._decode_keys)
            acc.add("kv_write", 0, layers * 2 * row_bytes * rows)
            acc.add("elementwise", 0, layers * rows * rows_bytes)

        def instrument(made: Any) -> None:
            nonlocal fused
            fused = made
            fused.enable_profile()
            fused.launch = self.acc.timed(fused.launch, account)

        fused = None
        return instrument

    # -- accounts ---------------------------------------------------------------
    def _gemm_account(self, linear: nn.Module, elem: int):
        k, n = _in_out(linear)
        weight_bytes = _weight_bytes(linear)

        def account(self_ns: int, args: tuple, out: Any) -> None:
            rows = args[0].shape[0]
            p, d = self._prefill_rows, self._decode_rows
            share = p / (p + d) if p + d else 0.0   # a mixed step's matmul, split by its rows
            flops, nbytes = 2 * rows * n * k, weight_bytes + rows * (k + n) * elem
            acc = self.acc
            acc.ns["prefill_gemm"] += round(self_ns * share)
            acc.ns["decode_gemm"] += self_ns - round(self_ns * share)
            acc.add("prefill_gemm", flops * share, nbytes * share)
            acc.add("decode_gemm", flops * (1 - share), nbytes * (1 - share))
        return account

    def _norm_account(self, elem: int):
        def account(self_ns: int, args: tuple, out: Any) -> None:
            x = args[0]
            tensors = 2 if len(args) < 2 or args[1] is None else 4    # x (+ residual) in, out (+ sum) out
            self.acc.ns["elementwise"] += self_ns
            self.acc.add("elementwise", 0, tensors * x.numel() * elem)
        return account

    def _rows_account(self, bytes_per_row: int):
        def account(self_ns: int, args: tuple, out: Any) -> None:
            rows = out.shape[0]
            self.acc.ns["elementwise"] += self_ns
            self.acc.add("elementwise", 0, rows * bytes_per_row)
        return account

    def _logits_account(self, model: nn.Module, elem: int):
        k, n = _in_out(model.lm_head)
        weight_bytes = _weight_bytes(model.lm_head)

        def account(self_ns: int, args: tuple, out: Any) -> None:
            rows = args[0].shape[0]
            self.acc.ns["logits"] += self_ns
            self.acc.add("logits", 2 * rows * n * k, weight_bytes + rows * (k * elem + n * 4))
        return account

    def _execute_account(self):
        def account(self_ns: int, args: tuple, out: Any) -> None:
            self.acc.ns["stage_other"] += self_ns
        return account

    def _busy(self, execute, forward: bool = True):
        """``execute`` that first reads its step's shape (``forward``: a forward through the
        stage's layers, not a head alone), and adds its wall time to busy time."""
        def call(step: StepInput, *args: Any, **kwargs: Any):
            if forward:
                self._start_step(step)
            t0 = time.perf_counter_ns()
            try:
                return execute(step, *args, **kwargs)
            finally:
                self.busy_ns += time.perf_counter_ns() - t0

        call.__wrapped__ = execute      # type: ignore[attr-defined]
        return call

    def instrument_head(self, head: Any) -> None:
        """Stage 0's runner of the heads it shares (``pipeline/lm_head.py``): its wall time is busy
        time; the head and the sampler it calls are timed through the stage's own runner."""
        head.execute = self._busy(self.acc.timed(head.execute, self._execute_account()), forward=False)

    def _start_step(self, step: StepInput) -> None:
        """Before each forward: its rows and attention work, for the accounts."""
        prefill = decode = decode_keys = pairs = prefill_keys = 0
        for s in step.seqs:
            q = len(s.token_ids)
            ctx = s.start_pos + q
            if q == 1:
                decode += 1
                decode_keys += ctx
            else:
                prefill += q
                pairs += q * (ctx - q) + q * (q + 1) // 2
                prefill_keys += ctx
        self._prefill_rows, self._decode_rows = prefill, decode
        self._decode_keys, self._prefill_pairs, self._prefill_keys = decode_keys, pairs, prefill_keys
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.steps += 1


def _linears(mlp: nn.Module) -> list[nn.Module]:
    """The dense MLP's matmuls (a mixture-of-experts block is timed as a whole, as GEMM)."""
    names = ("gate_up_proj", "down_proj")
    if all(hasattr(mlp, n) for n in names):
        return [getattr(mlp, n) for n in names]
    return [mlp]


def _weight_bytes(module: nn.Module) -> int:
    """Bytes a matmul reads of its weight: parameters and buffers (kept codes, scales) as stored."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _attention_costs(cfg: Any, elem: int) -> tuple[int, int]:
    """(bytes of one token's K and V, FLOPs of one query-key pair: q.k and p.v)."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * elem, 4 * cfg.num_heads * cfg.head_dim


def _in_out(linear: nn.Module) -> tuple[int, int]:
    """(in features k, out features n) of a dense or kept-quantized linear layer."""
    if hasattr(linear, "in_features"):
        return linear.in_features, linear.out_features
    weight = getattr(linear, "weight", None)
    if weight is not None and weight.dim() == 2:
        return weight.shape[1], weight.shape[0]
    return 0, 0
