"""What each message kind carries, and frames: how a message looks on a socket.

A frame is a 16-byte prefix ``MAGIC | header length (u32) | tensor bytes (u64)``
(big-endian), a UTF-8 JSON header ``{"kind": k, "obj": ..., "tensor": null |
{"dtype": d, "shape": [...]}}`` and the tensor's raw bytes. ``obj`` is decoded
against the type ``PAYLOADS`` declares for its kind (``worker/step_wire.py``;
a dataclass is the array of its fields):
nothing on the wire names a type or a function, and nothing is unpickled.

This module declares the kinds the transport itself speaks (hello, peers,
pings, errors, timelines); the pipeline declares the types of its own kinds
(a step, its result, a stage's spec) with ``register_payloads`` when
``pipeline/spec.py`` is imported, so ``comm`` does not import ``pipeline``.
A kind nobody declared is refused on both ends.

The frames sent every token or step (a HOP to the next stage, the TOKENS back to stage 0, a
RESULT to the driver) may carry a packed header instead: a first byte ``COMPACT_MARK`` (a JSON
header starts with ``{``), the kind, the tensor's dtype code and dims, then the bytes the kind's
``register_compact`` codec writes (the pipeline's, in ``pipeline/spec.py``). JSON cost ~0.05-0.16
ms of Python a frame on each end with cold caches, which is how a stage runs right after its
compute; packed, about half (benchmarks/cold_step_ops.py). The header's size limit bounds what a
packed payload can hold as it bounds a JSON one.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeserve.comm.transport import Kind
from pipeserve.metrics.timeline import Interval
from pipeserve.worker.step_wire import WireError, dumps, from_wire

FRAME_MAGIC = b"PSF1"
PREFIX = struct.Struct("!4sIQ")
MAX_HEADER_BYTES = 64 << 20
MAX_TENSOR_BYTES = 64 << 30
MAX_DIMS = 8
_DECODER = json.JSONDecoder()
DTYPES = {str(d).removeprefix("torch."): d for d in
          (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)}
COMPACT_MARK = 1
_COMPACT_FIRST = bytes([COMPACT_MARK])
_COMPACT = struct.Struct("!BBBB")     # mark, kind, dtype code (NO_TENSOR: none), dims; then u64 each dim
_NO_TENSOR = 255
_DTYPE_LIST = list(DTYPES.values())
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPE_LIST)}
_DIMS = [struct.Struct(f"!{n}Q") for n in range(MAX_DIMS + 1)]
_KINDS = {int(kind): kind for kind in Kind}     # a lookup, not the enum's call: this runs cold


@dataclass
class Hello:
    rank: int
    pid: int
    host: str = ""      # where this rank accepts connections from other stages ("" for none)
    port: int = 0


@dataclass
class Peer:
    rank: int
    host: str
    port: int


@dataclass
class Pong:
    """A stage's answer to a PING, sent by the thread that read the PING, so that a stage in the
    middle of a long step answers too. ``stage_time``: its clock (``time.time()``) when the PING
    arrived. ``computing_s``: how long its current message (a step) has been running, 0 when
    idle; ``computing_cpu_s``: the process's CPU seconds over that time (a step that has run
    long without using any is frozen, not slow); ``sending_s``: how long its current outgoing
    transfer has been on the wire, 0 when none is."""
    stage_time: float
    computing_s: float = 0.0
    computing_cpu_s: float = 0.0
    sending_s: float = 0.0


@dataclass
class Loading:
    """A stage's heartbeat while it loads its layers (between SPEC and READY): seconds since it
    began, the process's CPU seconds and the bytes it has had read from storage
    (``/proc/self/io``'s read_bytes, 0 where there is none). The driver waits for a stage whose
    CPU time or bytes move, however long a large model takes to come off a slow disk."""
    elapsed_s: float
    cpu_s: float
    read_bytes: int


@dataclass
class NodeInfo:
    nnodes: int
    node_rank: int
    num_stages: int = 0   # 0 in the question; the driver's answer fills it in


PAYLOADS: dict[Kind, Any] = {
    Kind.STOP: type(None), Kind.BYE: list[Interval], Kind.PING: type(None), Kind.PONG: Pong,
    Kind.FLUSH: type(None), Kind.TIMELINE: list[Interval], Kind.ERROR: tuple[int, int, str], Kind.HELLO: Hello,
    Kind.READY: int, Kind.FAILED: str, Kind.PEERS: list[Peer], Kind.NODE: NodeInfo,
    Kind.LINK_DOWN: tuple[int, str], Kind.RESET: type(None), Kind.LOADING: Loading,
}


@dataclass(frozen=True)
class Compact:
    """A kind's payload as packed bytes: ``encode(obj)`` gives them, or None where this value goes
    as JSON (one the packed form cannot hold); ``decode(body)`` reads them back and raises
    ``ValueError`` or ``struct.error`` on bytes that do not hold one."""

    encode: Callable[[Any], bytes | None]
    decode: Callable[[bytes], Any]


COMPACT: dict[Kind, Compact] = {}


def register_compact(kind: Kind, encode: Callable[[Any], bytes | None], decode: Callable[[bytes], Any]) -> None:
    """Give a declared kind a packed header (``encode_frame`` uses it where ``encode`` gives bytes)."""
    if kind not in PAYLOADS:
        raise ValueError(f"{kind.name} carries nothing declared; declare it with register_payloads first")
    COMPACT[kind] = Compact(encode, decode)


def register_payloads(types: dict[Kind, Any]) -> None:
    """Declare what the given kinds carry (the pipeline's step, result and spec).

    Idempotent for the same types; a kind already declared with another type is a bug.
    """
    for kind, payload in types.items():
        known = PAYLOADS.setdefault(kind, payload)
        if known != payload:
            raise ValueError(f"{kind.name} already carries {known!r}, not {payload!r}")


def encode_frame(kind: Kind, obj: Any, tensor: torch.Tensor | None) -> tuple[bytes, memoryview | None]:
    """(prefix + header, tensor bytes): two buffers for one ``sendall`` each, no copy of the tensor."""
    if kind not in PAYLOADS:
        raise ValueError(f"{kind.name} messages are not sent")
    compact = COMPACT.get(kind)
    if compact is not None and (tensor is None or (tensor.dtype in _DTYPE_CODES and tensor.dim() <= MAX_DIMS)):
        body = compact.encode(obj)
        if body is not None:
            return _compact_frame(kind, body, tensor)
    meta, raw = None, None
    if tensor is not None:
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"tensors of up to {MAX_DIMS} dims travel; got shape {tuple(tensor.shape)}")
        meta = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        if meta["dtype"] not in DTYPES:
            raise ValueError(f"{tensor.dtype} tensors do not travel (only {sorted(DTYPES)})")
        raw = _bytes_of(tensor)
    header = dumps({"kind": int(kind), "obj": obj, "tensor": meta}).encode()
    nbytes = 0 if raw is None else raw.nbytes
    return PREFIX.pack(FRAME_MAGIC, len(header), nbytes) + header, raw


def _compact_frame(kind: Kind, body: bytes, tensor: torch.Tensor | None) -> tuple[bytes, memoryview | None]:
    if tensor is None:
        header = _COMPACT.pack(COMPACT_MARK, kind, _NO_TENSOR, 0) + body
        return PREFIX.pack(FRAME_MAGIC, len(header), 0) + header, None
    shape = tensor.shape
    raw = _bytes_of(tensor)
    header = (_COMPACT.pack(COMPACT_MARK, kind, _DTYPE_CODES[tensor.dtype], len(shape))
              + _DIMS[len(shape)].pack(*shape) + body)
    return PREFIX.pack(FRAME_MAGIC, len(header), raw.nbytes) + header, raw


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy where it is a contiguous CPU tensor: a view of its memory
    (valid while the caller holds the tensor), not five PyTorch calls and NumPy's view (~30 µs
    cold against ~90-100: benchmarks/cold_step_ops.py)."""
    if tensor.is_cpu and tensor.is_contiguous() and tensor.nbytes:
        return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")
    return memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    magic, header_len, tensor_len = PREFIX.unpack(prefix)
    if magic != FRAME_MAGIC:
        raise WireError("not a pipeserve frame")
    if header_len > MAX_HEADER_BYTES or tensor_len > MAX_TENSOR_BYTES:
        raise WireError(f"frame too large: header {header_len} B, tensor {tensor_len} B")
    return header_len, tensor_len


def decode_header(header: bytes, tensor_len: int) -> tuple[Kind, Any, torch.dtype | None, list[int]]:
    """(kind, payload, tensor dtype, tensor shape), validated against the declared types."""
    if header[:1] == _COMPACT_FIRST:
        return _decode_compact(header, tensor_len)
    try:
        text = header.decode()
        data, end = _DECODER.raw_decode(text)   # json.loads without its wrapper: ~20 us less, cold
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"frame header is not JSON: {exc}") from None
    if end != len(text):
        raise WireError("frame header has data after its JSON value")
    if not isinstance(data, dict) or set(data) != {"kind", "obj", "tensor"}:
        raise WireError("frame header must be an object with kind, obj and tensor")
    try:
        kind = Kind(data["kind"])
    except ValueError:
        raise WireError(f"unknown message kind {data['kind']!r}") from None
    if kind not in PAYLOADS:
        raise WireError(f"{kind.name} messages are not accepted from the wire")
    obj = from_wire(PAYLOADS[kind], data["obj"], kind.name)
    dtype, shape = _tensor_meta(data["tensor"], tensor_len)
    return kind, obj, dtype, shape


def _decode_compact(header: bytes, tensor_len: int) -> tuple[Kind, Any, torch.dtype | None, list[int]]:
    if len(header) < _COMPACT.size:
        raise WireError(f"packed frame header of {len(header)} bytes is too short")
    _, code, dtype_code, dims = _COMPACT.unpack_from(header)
    kind = _KINDS.get(code)
    compact = COMPACT.get(kind)
    if compact is None:
        raise WireError(f"message kind {code} has no packed form")
    end = _COMPACT.size + 8 * dims
    if dims > MAX_DIMS or len(header) < end:
        raise WireError(f"{kind.name} frame: bad tensor dims {dims}")
    shape = list(_DIMS[dims].unpack_from(header, _COMPACT.size))
    if dtype_code == _NO_TENSOR:
        if dims or tensor_len:
            raise WireError(f"{kind.name} frame: tensor bytes or dims without a tensor dtype")
        dtype = None
    elif dtype_code < len(_DTYPE_LIST):
        dtype = _DTYPE_LIST[dtype_code]
        if math.prod(shape) * dtype.itemsize != tensor_len:
            raise WireError(f"tensor {dtype}{shape} does not match its {tensor_len} bytes")
    else:
        raise WireError(f"{kind.name} frame: unknown tensor dtype code {dtype_code}")
    try:
        obj = compact.decode(header[end:])
    except (ValueError, struct.error) as exc:
        raise WireError(f"{kind.name} frame: bad packed payload ({exc})") from None
    return kind, obj, dtype, shape


def _tensor_meta(meta: Any, tensor_len: int) -> tuple[torch.dtype | None, list[int]]:
    if meta is None:
        if tensor_len:
            raise WireError("tensor bytes without a tensor description")
        return None, []
    if not isinstance(meta, dict) or set(meta) != {"dtype", "shape"} or meta["dtype"] not in DTYPES:
        raise WireError(f"bad tensor description {meta!r}")
    shape = from_wire(list[int], meta["shape"], "tensor.shape")
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise WireError(f"bad tensor shape {shape}")
    dtype = DTYPES[meta["dtype"]]
    if math.prod(shape) * dtype.itemsize != tensor_len:
        raise WireError(f"tensor {meta['dtype']}{shape} does not match its {tensor_len} bytes")
    return dtype, shape
