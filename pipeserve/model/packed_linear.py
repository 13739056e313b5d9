"""bfloat16 CPU linear layers with the weight packed once, not on every call.

``F.linear`` on a bfloat16 CPU weight hands oneDNN the plain [out, in] matrix,
which it reorders into its blocked layout on every call (a read and a write of
the whole weight per call). Two ways to pack once, measured side by side
(benchmarks/README.md, "Prefill GEMMs"):

- ``bf16_gemm.c`` (pipeserve/kernels): our vdpbf16ps kernel over weight panels
  laid out at the first call; 1.05-1.07x oneDNN-packed at prefill rows and
  1.25-1.6x at 1-32 rows with the weights coming from memory. Differs from
  ``F.linear`` by float32 summation order only. Taken for bias-free layers
  whose input width is a multiple of 32, on AVX512_BF16 CPUs.
- oneDNN with a packed weight (what torch inductor's freezing does:
  ``mkldnn._reorder_linear_weight``, then ``mkldnn._linear_pointwise``): the
  same kernel as ``F.linear`` without the reorder, bit-identical results (the
  bias added in float32 before rounding, as ``F.linear`` does for contiguous
  input). Taken for the other layers, everywhere when the C kernel cannot
  be built or the CPU lacks AVX512_BF16 (logged once), and on CPUs with AMX-BF16,
  whose tiles oneDNN multiplies with: there 1,100-1,600 GFLOP/s a core at SmolLM2's
  prefill shapes against bf16_gemm.c's 110-115 (benchmarks/prefill_gemm.py, thirty-fifth
  session).

Without packing, a bfloat16 CPU layer's decode rows (up to ``GEMV_MAX_ROWS`` rows of
x) go to ``bf16_gemv.c``, which reads the plain weight once per call where ``F.linear``
has oneDNN reorder it every time: 1.5-2.2x ``F.linear`` at one row, 1.4-2.2x at eight
(benchmarks/README.md, thirty-fourth session), no second copy; on AVX-512 CPUs.

``F.linear`` stays for every other dtype (float32 is untouched) and device, and
when neither packing nor the gemv is possible (logged once). The packed copy is made on a
layer's first bfloat16 forward and remade when the weight is replaced or changed
in place (its storage or version counter moves; an inference-mode weight has no
version counter, so only a new storage is seen). It is a second copy: the plain
weight stays the parameter that loaders, tensor-parallel slicing and
``weight_bytes`` read, and ``weight_bytes`` counts the packed copy too.
Off by default (``--prepack-weights``): it doubles a dense bfloat16 stage's
weight bytes for a few per cent of speed (benchmarks/README.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pipeserve.config import cpu_has_amx_bf16
from pipeserve.kernels.build import kernel_cache

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this torch has oneDNN's packed-linear ops and this CPU runs its bfloat16 path
    (AVX512BW/VL/DQ or AVX_NE_CONVERT; an AVX2-only CPU does not); logged once when not."""
    ok = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
          and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if not ok:
        log.info("bfloat16 linear layers: no oneDNN packed-linear ops in this torch")
        return False
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        log.info("bfloat16 linear layers: this CPU has no oneDNN bfloat16 path (needs AVX512BW/VL/DQ or "
                 "AVX_NE_CONVERT); F.linear")
        return False
    return True


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bfloat16 activations and weight on the CPU, outside autograd."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and weight.device.type == "cpu" and not x.requires_grad and not weight.requires_grad)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-blocked copy of ``weight`` [out, in] (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed^T + bias -> [..., out]; equals ``F.linear`` on the plain weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _load(name: str, needs: str):
    """``kernels/<name>.c`` loaded, and the ISA its build reports (``pipeserve_<name>_isa``);
    ``KernelBuildError`` when it does not build, or built for a CPU without ``needs``."""
    from pipeserve.kernels.build import KernelBuildError, load_kernel
    lib = load_kernel(name)
    isa = getattr(lib, f"pipeserve_{name}_isa")
    isa.restype = ctypes.c_char_p
    built = isa().decode()
    if built == "none":
        raise KernelBuildError(f"{name}.c: this CPU has no {needs}")
    return lib, built


class Bf16Gemm:
    """``pipeserve/kernels/bf16_gemm.c`` through ctypes; ``KernelBuildError`` when unusable here."""

    def __init__(self) -> None:
        lib, self.isa = _load("bf16_gemm", "AVX512_BF16")
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.pipeserve_bf16_pack.argtypes = [p, i64, i64, p]
        lib.pipeserve_bf16_gemm.argtypes = [p, i64, i64, p, i64, p, ctypes.c_int]
        self.lib = lib

    @staticmethod
    def takes(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return bias is None and weight.dim() == 2 and weight.shape[1] % 32 == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """Panels of 16 rows (see bf16_gemm.c): int32 pairs, ceil(out / 16) * 16 * in / 2 of them."""
        n, k = weight.shape
        w = weight.detach().contiguous()
        panels = torch.empty((n + 15) // 16 * 16 * k // 2, dtype=torch.int32)
        self._check(self.lib.pipeserve_bf16_pack(w.data_ptr(), n, k, panels.data_ptr()))
        return panels

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()                                    # [rows, in]
        out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        self._check(self.lib.pipeserve_bf16_gemm(panels.data_ptr(), n, k, x2.data_ptr(), x2.shape[0],
                                                 out.data_ptr(), torch.get_num_threads()))
        return out.view(*x.shape[:-1], n)

    @staticmethod
    def _check(rc: int) -> None:
        if rc == -1:
            raise MemoryError("bf16_gemm.c: cannot allocate its scratch")
        if rc != 0:
            raise RuntimeError(f"bf16_gemm.c returned {rc}")


@kernel_cache
def gemm_kernel() -> Bf16Gemm | None:
    """The C kernel, or None (why logged once: the layers then use oneDNN's packed weights)."""
    from pipeserve.kernels.build import KernelBuildError
    try:
        kernel = Bf16Gemm()
    except KernelBuildError as exc:
        log.warning("bfloat16 linear layers: oneDNN with packed weights (%s)", str(exc).splitlines()[0])
        return None
    log.info("bfloat16 linear layers: bf16_gemm.c (%s) with weights packed once", kernel.isa)
    return kernel


# Rows of x up to which a layer takes bf16_gemv.c (all the kernel takes): at 8 rows, weights from
# memory, 2.1-2.2x F.linear at one thread, 1.4-2.0x at two (benchmarks/bf16_gemv.py).
GEMV_MAX_ROWS = 8


class Bf16Gemv:
    """``pipeserve/kernels/bf16_gemv.c`` through ctypes; ``KernelBuildError`` when unusable here."""

    def __init__(self) -> None:
        lib, self.isa = _load("bf16_gemv", "AVX-512")
        lib.pipeserve_bf16_gemv_max_rows.restype = ctypes.c_int64
        self.max_rows = min(GEMV_MAX_ROWS, lib.pipeserve_bf16_gemv_max_rows())
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.pipeserve_bf16_gemv.argtypes = [p, i64, i64, p, i64, p, p, ctypes.c_int]
        self.fn = lib.pipeserve_bf16_gemv

    def takes(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """bfloat16 x of at most ``max_rows`` rows (``applies``) against a plain 2-D weight."""
        return (weight.dim() == 2 and weight.is_contiguous() and x.shape[-1] == weight.shape[1]
                and 0 < x.numel() <= self.max_rows * weight.shape[1]
                and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = weight.shape
        x2 = x.reshape(-1, k).contiguous()
        out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        rc = self.fn(weight.data_ptr(), n, k, x2.data_ptr(), x2.shape[0], None if bias is None else bias.data_ptr(),
                     out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"bf16_gemv.c returned {rc}")
        return out.view(*x.shape[:-1], n)


@kernel_cache
def gemv_kernel() -> Bf16Gemv | None:
    """The decode-row kernel, or None (why logged once: those rows then take ``F.linear``)."""
    from pipeserve.kernels.build import KernelBuildError
    try:
        kernel = Bf16Gemv()
    except KernelBuildError as exc:
        log.info("bfloat16 linear layers: F.linear for decode rows (%s)", str(exc).splitlines()[0])
        return None
    log.info("bfloat16 linear layers: bf16_gemv.c (%s) for up to %d rows", kernel.isa, kernel.max_rows)
    return kernel


def decode_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ weight^T + bias by ``bf16_gemv.c`` where it takes them (``applies`` first), else None."""
    kernel = gemv_kernel()
    if kernel is None or not kernel.takes(x, weight, bias):
        return None
    return kernel(x, weight, bias)


def _version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:   # inference tensors do not track versions
        return None


def _key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What a packed copy was made from: a new storage, version or shape means repack."""
    return (weight.data_ptr(), _version(weight), tuple(weight.shape), bias is None)


class PackedWeight:
    """One layer's packed copy, remade when its weight changes; ``forward`` is None where
    no packing applies (the layer then calls ``F.linear``)."""

    __slots__ = ("packed", "kind", "key", "failed")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.kind: str | None = None   # "gemm" (bf16_gemm.c) or "onednn"
        self.key: tuple | None = None
        self.failed = False

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if self.failed:
            return None
        key = _key(weight, bias)
        if key != self.key and not self._pack(weight, bias, key):
            return None
        if self.kind == "gemm":
            return gemm_kernel()(x, self.packed, weight.shape[0])
        return linear(x, self.packed, bias)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Pack now (at load, so the copy is in the start-up memory figures), not on the
        first forward; nothing for weights the packed paths do not take."""
        if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not weight.requires_grad
                and not self.failed):
            self._pack(weight, bias, _key(weight, bias))

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copy (0 before packing or where none applies)."""
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None, key: tuple) -> bool:
        kernel = gemm_kernel() if Bf16Gemm.takes(weight, bias) and not cpu_has_amx_bf16() else None
        try:
            if kernel is not None:
                self.packed, self.kind = kernel.pack(weight), "gemm"
            elif available():
                self.packed, self.kind = pack(weight), "onednn"
            else:
                self.failed = True
                return False
        except RuntimeError as exc:   # e.g. a oneDNN without bfloat16 support for this CPU
            self.failed = True
            _warn_once(weight, exc)
            return False
        self.key = key
        return True


_warned: list[str] = []   # the first packing failure of the process is logged, not every layer's


def _warn_once(weight: torch.Tensor, exc: Exception) -> None:
    if _warned:
        return
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    _warned.append(reason)
    log.warning("bfloat16 linear layers: F.linear (packing a %s weight failed: %s)", tuple(weight.shape), reason)
