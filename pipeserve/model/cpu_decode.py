"""A CPU stage's decoder layers for a decode step in one C call (pipeserve/kernels/decode_stage.c).

From Python, a decode layer is ten small kernel calls, each a ctypes call, a
tensor allocation and, for the matmuls and attention, an OpenMP fork/join: on
SmolLM2-135M with two threads that was about 6 of a token's 16 ms. The C
function runs all of a stage's layers in one thread team, with the same kernels
in the same order (benchmarks/README.md, "Fused decode stage").

It applies to float32 and bfloat16 CPU stages whose linear layers keep quantized
weights (float32 is what ``--dtype auto`` gives on CPUs without native bfloat16),
each in one to three parts of different types, and to bfloat16 stages whose linear layers
are plain bfloat16 weights (a safetensors checkpoint, ``--quantization auto``), for steps
of up to ``packed_linear.GEMV_MAX_ROWS`` decodes multiplied by bf16_gemv.c as
``layers.Linear`` multiplies them (a Q4_K_M GGUF has Q6_K attn_v beside
Q4_K q and k in some layers: each part is multiplied in its own layout),
with the C attention backend and a KV cache in the stage's dtype or in 8 bits
(``--kv-cache-dtype int8 | fp8``: the new rows quantized in C as ``kv_quant`` does), Llama-shaped
layers (SwiGLU, plain RMSNorm; a q/k/v bias, Qwen3's per-head q/k norm, a sliding
window and a soft cap are taken), no tensor parallelism, and steps of at most
``QuantKernels.fused_max_rows`` decodes (AVX2: 128, in one pass of the integer gemv, 48 with
q8 parts, ``PROMPT_INT8_MAX_ROWS``; VNNI:
``GEMV_PASSES_MAX_ROWS``, in passes of ``GEMV_MAX_ROWS`` rows as the Python layers multiply
them; bfloat16 where quant_gemm.c runs: fewer than ``GEMM_MIN_ROWS``; bfloat16 on AVX512-VNNI where
the 8-bit many-row kernel, quant_gemm_i8.c, takes every weight: up to ``GEMV_ONE_CALL_MAX_ROWS``,
more than ``GEMV_MAX_ROWS`` in one pass of that kernel, as ``QuantKernels.matmul`` gives them to it);
everything else runs the Python layers. With one
thread the result is bit for bit the Python path's; with more, only the order in
which the attention's partial softmaxes merge differs. ``PIPESERVE_FUSED_DECODE=0``
turns it off (side-by-side measurements).
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
from itertools import chain
from typing import TYPE_CHECKING

import torch

from pipeserve.model import packed_linear
from pipeserve.model.attention import AttentionMetadata, KVCache
from pipeserve.model.cpu_attention import CACHE_DTYPE_CODES
from pipeserve.model.kv_quant import is_quantized
from pipeserve.model.quant.cpu_kernels import (AMX_MIN_ROWS, AMX_OUT_PER_ROW, GEMM_MIN_ROWS, GEMV_ONE_CALL_MAX_ROWS,
                                               GEMV_PASSES_MAX_ROWS, PROMPT_INT8_MAX_ROWS, _kind, cpu_kernels)

if TYPE_CHECKING:
    from pipeserve.model.llama import LlamaModel

log = logging.getLogger(__name__)

_p, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("rmsnorm", "rope", "silu_mul", "act_bytes", "prepare", "rows",
                                        "plan_bytes", "plan", "items", "merge", "share", "m_act_bytes", "m_prepare",
                                        "m_rows", "d_rows", "a_act_bytes", "a_prepare", "a_rows")] + [
        ("a_min_rows", _i64), ("a_per_out", _i64)]


class _QWeight(ctypes.Structure):
    _fields_ = [("qs", _p), ("qh", _p), ("sc", _p), ("mn", _p), ("N", _i64), ("K", _i64), ("group", _i64),
                ("kind", _i32), ("zero", _i32)]


MAX_PARTS = 3   # decode_stage.c's: a linear layer's weights of different types (q, k, v)
QW_DENSE = -1   # decode_stage.c's kind of a plain bfloat16 weight


class _Dense:
    """A ``layers.Linear``'s plain bfloat16 weight as a part of the fused stage's layer."""

    kind = "dense"

    def __init__(self, linear) -> None:
        self.weight = linear.weight


class _QLinear(ctypes.Structure):
    _fields_ = [("part", _QWeight * MAX_PARTS), ("parts", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _QLinear), ("o", _QLinear),
                ("gate_up", _QLinear), ("down", _QLinear), ("qkv_bias", _p), ("q_norm", _p), ("k_norm", _p),
                ("k_cache", _p), ("v_cache", _p),
                ("window", _i64), ("softcap", _f32), ("pad", _i32)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("eps", _f32), ("scale", _f32), ("cos", _p), ("sin", _p), ("slots", _p),
                ("block_tables", _p), ("context_lens", _p), ("max_blocks", _i64), ("block_size", _i64),
                ("bf16", _i64), ("prof", _p), ("kv_dtype", _i64), ("positions", _p)]

PROF_CLASSES = ("gemm", "attention", "kv_write", "rows")   # decode_stage.c's PROF_* order


class FusedDecode:
    """Built by ``fused_decode(model)`` once the weights are loaded; binds the KV caches
    at the first call and again whenever they move."""

    def __init__(self, model: LlamaModel, run, kernels: _Kernels, weights: list) -> None:
        self.model, self._run, self._kernels = model, run, kernels
        self._weights = weights               # per layer: (qkv, o, gate_up, down), each its PackedWeights
        self._layers = None                   # the _Layer array, for the caches bound in _bound
        self._bound: tuple[int, ...] = ()     # the caches' data pointers the layers were bound to
        self._bound_tensors: list[torch.Tensor] = []   # and the tensors themselves
        cfg = model.cfg
        self._step = _Step(0, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, model.layers[0].input_layernorm.eps, cfg.attention_scale)
        self._step.bf16 = int(model.dtype == torch.bfloat16)
        self._step.kv_dtype = CACHE_DTYPE_CODES[model.dtype]   # the bound caches' (_bind)
        # As many decodes as the integer-activation gemv takes (AVX2: 128 in one call, but with q8
        # parts PROMPT_INT8_MAX_ROWS["q8"], beyond which the Python layers' q8 matmuls take the
        # tiles; elsewhere as the Python layers give it, GEMV_PASSES_MAX_ROWS in passes of
        # GEMV_MAX_ROWS), except that from GEMM_MIN_ROWS they give bfloat16 to the many-row kernel where there is
        # one (quant_gemm.c). Where the 8-bit many-row kernel takes every weight (kernels.m_rows:
        # bfloat16 on AVX512-VNNI, every kept layout), up to GEMV_ONE_CALL_MAX_ROWS: beyond
        # GEMV_MAX_ROWS rows it multiplies them in one pass here.
        quant = cpu_kernels()
        has_gemm = self._step.bf16 and quant.gemm_isa
        has_q8 = any(w.kind == "q8" for layer in weights for parts in layer for w in parts)
        has_dense = any(w.kind == "dense" for layer in weights for parts in layer for w in parts)
        self.max_rows = (packed_linear.GEMV_MAX_ROWS if has_dense
                         else GEMV_ONE_CALL_MAX_ROWS if kernels.m_rows
                         else GEMM_MIN_ROWS - 1 if has_gemm
                         else quant.fused_max_rows if not has_q8
                         else min(quant.fused_max_rows, PROMPT_INT8_MAX_ROWS["q8"]) if quant.isa == "avx2"
                         else GEMV_PASSES_MAX_ROWS)
        # --profile (``enable_profile``): nanoseconds per PROF_CLASSES, added to by each launch
        self.prof_ns = None

    def applies(self, h: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Every row a decode, at most ``max_rows`` of them, and a cache in the stage's dtype or
        an 8-bit one (``--kv-cache-dtype int8|fp8``)."""
        decodes = getattr(meta, "decodes", None)
        return (decodes is not None and not meta.prefills and h.shape[0] <= self.max_rows
                and h.dtype == self.model.dtype and _cache_taken(kv_caches[0][0].dtype, self.model.dtype))

    def __call__(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                 kv_caches: list[KVCache], positions: torch.Tensor | None = None) -> torch.Tensor:
        """h [n, hidden] in the stage's dtype, its input (every row a decode) -> its output.
        ``rope``: the rows' cos and sin [n, head_dim] (float32), or with ``positions`` (int64 [n])
        the rotary table (``RotaryEmbedding.table``: [positions, head_dim], past every position),
        whose rows the C code picks."""
        layers = self._bind(kv_caches)
        out = h.contiguous().clone()
        cos, sin = (t.contiguous() for t in rope)
        slots = meta.slot_mapping.contiguous()
        args = self.model.backend.decode_args(meta.decodes)
        s = self._step
        s.rows, s.cos, s.sin, s.slots = out.shape[0], cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        s.positions = None if positions is None else positions.contiguous().data_ptr()
        s.block_tables, s.context_lens = args.tables_ptr, args.lens_ptr
        s.max_blocks, s.block_size = args.max_blocks, args.block_size
        self.launch(layers, out)
        return out

    def enable_profile(self) -> None:
        self.prof_ns = (ctypes.c_double * len(PROF_CLASSES))()
        self._step.prof = ctypes.addressof(self.prof_ns)

    def take_profile(self) -> dict[str, float]:
        """Nanoseconds per class since the last take (``enable_profile`` first)."""
        out = dict(zip(PROF_CLASSES, self.prof_ns))
        ctypes.memset(self.prof_ns, 0, ctypes.sizeof(self.prof_ns))
        return out

    def launch(self, layers, out: torch.Tensor) -> None:
        """The C call (the one --profile times)."""
        rc = self._run(ctypes.byref(self._kernels), layers, len(self._weights), ctypes.byref(self._step),
                       out.data_ptr(), torch.get_num_threads())
        if rc == -1:
            raise MemoryError("fused decode stage: cannot allocate its scratch")
        if rc != 0:
            raise RuntimeError(f"fused decode stage: the attention plan failed (code {rc})")

    def _bind(self, kv_caches: list[KVCache]):
        # The same cache tensors as last time (a runner allocates them once): no pointer to read
        # again (60 data_ptr calls were ~35 us of a decode step, cold after the layers' weights).
        tensors = self._bound_tensors
        if (len(kv_caches) * 2 == len(tensors) and all(map(operator.is_, chain.from_iterable(kv_caches), tensors))
                and tensors[0].data_ptr() == self._bound[0]):
            return self._layers
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if key != self._bound:
            dtype = kv_caches[0][0].dtype if kv_caches else None
            if len(kv_caches) != len(self._weights) or not _cache_taken(dtype, self.model.dtype) or any(
                    t.dtype != dtype or not t.is_contiguous() for pair in kv_caches for t in pair):
                raise ValueError("fused decode stage: needs one contiguous (K, V) cache pair per layer, all in "
                                 "the stage's dtype or all in one 8-bit dtype")
            self._step.kv_dtype = CACHE_DTYPE_CODES[dtype]
            layers = (_Layer * len(self._weights))()
            for i, (layer, ws, (k_cache, v_cache)) in enumerate(zip(self.model.layers, self._weights, kv_caches)):
                attn = layer.self_attn
                bias = attn.qkv_proj.bias
                layers[i] = _Layer(layer.input_layernorm.weight.data_ptr(),
                                   layer.post_attention_layernorm.weight.data_ptr(),
                                   *(_qlinear(parts) for parts in ws), None if bias is None else bias.data_ptr(),
                                   *(None if norm is None else norm.weight.data_ptr()
                                     for norm in (attn.q_norm, attn.k_norm)),
                                   k_cache.data_ptr(), v_cache.data_ptr(),
                                   attn.backend_options.get("sliding_window") or 0,
                                   attn.backend_options.get("logit_softcap") or 0.0, 0)
            self._layers, self._bound = layers, key
        self._bound_tensors = list(chain.from_iterable(kv_caches))
        return self._layers


def _cache_taken(cache: torch.dtype | None, model: torch.dtype) -> bool:
    """A cache the fused stage writes and reads: the stage's dtype, or 8-bit rows."""
    return cache == model or (cache is not None and is_quantized(cache))


def _qlinear(parts) -> _QLinear:
    linear = _QLinear()
    for i, w in enumerate(parts):
        linear.part[i] = _qweight(w)
    linear.parts = len(parts)
    return linear


def _qweight(w) -> _QWeight:
    if isinstance(w, _Dense):
        n, k = w.weight.shape
        return _QWeight(w.weight.data_ptr(), None, None, None, n, k, 0, QW_DENSE, 0)
    return _QWeight(w.qs.data_ptr(), None if w.qh is None else w.qh.data_ptr(), w.scale.data_ptr(),
                    None if w.minv is None else w.minv.data_ptr(), w.out_features, w.in_features, w.group,
                    _kind(w), w.zero)


def fused_decode(model: LlamaModel) -> FusedDecode | None:
    """The fused decode path for this stage, or None (logged once, with the reason)."""
    from pipeserve.kernels.build import KernelBuildError
    why = _why_not(model)
    if why is None:
        try:
            built = _build(model)
        except KernelBuildError as exc:
            built = f"a kernel is unavailable ({exc})"
        if isinstance(built, FusedDecode):
            log.info("decode: fused C stage for layers [%d, %d)", model.start_layer, model.end_layer)
            return built
        why = built
    log.info("decode: Python layers (the fused C stage does not apply: %s)", why)
    return None


def _why_not(model: LlamaModel) -> str | None:
    from pipeserve.model.cpu_attention import CpuPagedAttention
    from pipeserve.model.layers import SwiGLU
    from pipeserve.model.quant.modules import QuantLinear
    cfg = model.cfg
    if os.environ.get("PIPESERVE_FUSED_DECODE", "1") == "0":
        return "PIPESERVE_FUSED_DECODE=0"
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return f"it runs float32 or bfloat16 on CPU, this stage is {model.dtype} on {model.device}"
    if model.tp is not None:
        return "tensor parallelism"
    if not isinstance(model.backend, CpuPagedAttention):
        return "the attention backend is not the C one"
    if not model.layers:
        return "the stage has no layers"
    if cfg.sandwich_norms or cfg.norm_unit_offset or cfg.rope_local_theta:
        return "this family's layers (Gemma norms or local RoPE)"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, SwiGLU) or mlp.act != "silu" or mlp.ops is None or layer.input_layernorm.ops is None:
            return "a layer without SwiGLU or the fused elementwise kernels"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if isinstance(linear, QuantLinear) and len(linear.parts) <= MAX_PARTS:
                continue
            why = _dense_why_not(model, linear)
            if why is not None:
                return why
        if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return "a bias outside q/k/v"
    return None


def _dense_why_not(model: LlamaModel, linear) -> str | None:
    """Why the fused stage cannot take this linear layer as a plain bfloat16 weight, or None."""
    from pipeserve.model.layers import Linear
    if not isinstance(linear, Linear):
        return f"a linear layer whose weights are not 1 to {MAX_PARTS} quantized parts or one plain weight"
    if model.dtype != torch.bfloat16 or linear.weight.dtype != torch.bfloat16:
        return "plain weights in a float32 stage (its layers keep F.linear)"
    if linear.prepack:
        return "--prepack-weights (its layers multiply the packed copies)"
    if not linear.weight.is_contiguous() or packed_linear.gemv_kernel() is None:
        return "plain bfloat16 weights without bf16_gemv.c (no AVX-512, or it does not build)"
    return None


def _build(model: LlamaModel) -> FusedDecode | str:
    """The fused stage, or why not (a weight layout without integer activations here)."""
    from pipeserve.kernels.build import load_kernel
    quant, attention, elementwise = (load_kernel(name) for name in ("quant_matmul", "paged_attention",
                                                                    "elementwise"))
    addr = lambda lib, name: ctypes.cast(getattr(lib, name), _p).value   # noqa: E731
    suffix = "bf16" if model.dtype == torch.bfloat16 else "f32"
    kernels = _Kernels(addr(elementwise, f"pipeserve_rmsnorm_{suffix}"), addr(elementwise, f"pipeserve_rope_{suffix}"),
                       addr(elementwise, f"pipeserve_silu_mul_{suffix}"), addr(quant, "pipeserve_quant_act_bytes"),
                       addr(quant, "pipeserve_quant_prepare"), addr(quant, "pipeserve_quant_rows"),
                       addr(attention, "pipeserve_decode_plan_bytes"), addr(attention, "pipeserve_decode_plan"),
                       addr(attention, "pipeserve_decode_items"), addr(attention, "pipeserve_decode_merge"),
                       addr(attention, "pipeserve_decode_share"))
    act_bytes = quant.pipeserve_quant_act_bytes
    act_bytes.argtypes, act_bytes.restype = [ctypes.c_int, _i64, _i64, _i64], _i64
    weights = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        ws = tuple(tuple(linear.parts) if hasattr(linear, "parts") else (_Dense(linear),)
                   for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
        for w in (part for parts in ws for part in parts if not isinstance(part, _Dense)):
            if act_bytes(_kind(w), w.in_features, w.group, 1) <= 0:
                return (f"no integer-activation decode kernel on this CPU for {w.source} "
                        f"(group {w.group}, in_features {w.in_features})")
        weights.append(ws)
    # bfloat16 stages whose every weight the 8-bit many-row kernel takes: it multiplies the steps of
    # more than GEMV_MAX_ROWS decodes, as the Python layers' QuantKernels.matmul does
    quant_kernels = cpu_kernels()
    if any(isinstance(w, _Dense) for ws in weights for parts in ws for w in parts):
        kernels.d_rows = addr(load_kernel("bf16_gemv"), "pipeserve_bf16_gemv_rows")
    elif model.dtype == torch.bfloat16 and all(quant_kernels.gemm_i8_takes(w) for ws in weights for parts in ws
                                               for w in parts):
        i8 = load_kernel("quant_gemm_i8")
        kernels.m_act_bytes, kernels.m_prepare, kernels.m_rows = (
            addr(i8, name) for name in ("pipeserve_quant_i8m_act_bytes", "pipeserve_quant_i8m_prepare",
                                        "pipeserve_quant_i8m_rows"))
        if quant_kernels.gemm_amx_isa:   # AMX CPUs: from amx_from's rows, as QuantKernels.matmul
            amx = load_kernel("quant_gemm")
            kernels.a_act_bytes, kernels.a_prepare, kernels.a_rows = (
                addr(amx, name) for name in ("pipeserve_quant_amxm_act_bytes", "pipeserve_quant_amxm_prepare",
                                             "pipeserve_quant_amxm_rows"))
            kernels.a_min_rows, kernels.a_per_out = AMX_MIN_ROWS, AMX_OUT_PER_ROW
    run = load_kernel("decode_stage").pipeserve_decode_stage
    run.argtypes, run.restype = [_p, _p, _i64, _p, _p, ctypes.c_int], ctypes.c_int
    return FusedDecode(model, run, kernels, weights)
