"""bfloat16 CPU linear layers through oneDNN with the weight packed once.

``F.linear`` on a bfloat16 CPU weight hands oneDNN the plain [out, in] matrix,
which it reorders into its blocked layout on every call. Packing once (what
torch inductor's freezing pass does: ``mkldnn._reorder_linear_weight``, then
``mkldnn._linear_pointwise`` per call) skips that reorder: the same oneDNN
kernel and bit-identical results (the bias is added in float32 before rounding,
as F.linear does for contiguous input; F.linear on non-contiguous N-D input with
a bias rounds first, so there the results may differ by one bf16 step), measured 1.04-1.15x at prefill rows and
1.2-2x at 1-64 rows (benchmarks/README.md, "Prefill GEMMs").

The packed copy is made on a layer's first bfloat16 forward and remade when the
weight is replaced or changed in place (its storage or version counter moves;
an inference-mode weight has no version counter, so only a new storage is seen).
It is a second copy: the plain weight stays the parameter that loaders,
tensor-parallel slicing and ``weight_bytes`` read.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this torch has oneDNN and the packed-linear ops (logged once when not)."""
    ok = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
          and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if not ok:
        log.info("bfloat16 linear layers: F.linear (this torch has no oneDNN packed-linear ops)")
    return ok


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


def _version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:   # inference tensors do not track versions
        return None


class PackedWeight:
    """One layer's packed copy, remade when its weight changes; None where it cannot be made."""

    __slots__ = ("packed", "key", "failed")

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.key: tuple | None = None
        self.failed = False

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        if self.failed or not available():
            return None
        key = (weight.data_ptr(), _version(weight), tuple(weight.shape))
        if key != self.key:
            try:
                self.packed = pack(weight)
            except RuntimeError as exc:   # e.g. a oneDNN without bfloat16 support for this CPU
                self.failed = True
                _warn_once(weight, exc)
                return None
            self.key = key
        return self.packed


_warned: list[str] = []   # the first packing failure of the process is logged, not every layer's


def _warn_once(weight: torch.Tensor, exc: Exception) -> None:
    if _warned:
        return
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    _warned.append(reason)
    log.warning("bfloat16 linear layers: F.linear (packing a %s weight for oneDNN failed: %s)",
                tuple(weight.shape), reason)
