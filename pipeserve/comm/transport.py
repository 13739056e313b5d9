"""Point-to-point messages between pipeline ranks: a small pickled object plus,
optionally, one activation tensor.

Rank 0 is the driver, ranks 1..P are the stages. Every message is three sends
on fixed tags, so that messages from different sources never interleave:

1. a fixed-size frame of ``FRAME_BYTES``: an int64 header ``[kind, payload
   bytes, dtype code, ndim, d0..d3]`` followed by the pickled payload when it
   fits (the common case: one send per message plus the tensor). It is
   received from *any* source (a stage may get work from the driver, from the
   previous stage, or round the ring from the last one);
2. the pickled payload (uint8) from that source, only when it did not fit;
3. the tensor, if the header announces one, from that source.

Headers and payloads always go through a gloo group (CPU). Tensors go through
the same gloo group on CPU, or a NCCL group between GPU stages (NCCL has no
any-source receive, which is why the header never travels on it).

Each call blocks: the runtime calls ``send`` from one sender thread and
``recv`` from one receiving thread per process, so a stage computes while its
last output is still on the wire. No call here takes a timeout: a gloo receive
that timed out cannot be waited on again, so liveness is the driver's
watchdog's job (process exit codes, and a per-step deadline).
"""

from __future__ import annotations

import datetime
import pickle
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

HEADER_LEN = 8
HEADER_BYTES = HEADER_LEN * 8
FRAME_BYTES = 4096
MAX_DIMS = HEADER_LEN - 4
TAG_HEADER, TAG_PAYLOAD, TAG_TENSOR = 11, 12, 13
# Idle stages block in a receive for as long as nobody sends: gloo's own
# deadline must not end them. The driver's watchdog bounds every real wait.
NO_DEADLINE = datetime.timedelta(days=30)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8)


class Kind(IntEnum):
    STEP = 1       # driver/stage -> stage: a micro-batch (StepEnvelope) + activations
    RESULT = 2     # last stage -> driver: (StepOutput, intervals)
    STOP = 3       # driver -> stage: finish and exit
    BYE = 4        # stage -> driver: exiting (unblocks the driver's receiver)
    PING = 5       # driver -> stage: answer with PONG (clock offset, liveness)
    PONG = 6       # stage -> driver: the stage's time.time()
    FLUSH = 7      # driver -> stage: send your unsent intervals now
    TIMELINE = 8   # stage -> driver: intervals
    ERROR = 9      # stage -> driver: a runner raised (traceback text)


@dataclass
class Message:
    src: int
    kind: Kind
    obj: Any
    tensor: torch.Tensor | None
    arrived: float      # time.time() when the header arrived (end of the idle wait)


class Transport(ABC):
    rank: int
    world_size: int

    @abstractmethod
    def send(self, dst: int, kind: Kind, obj: Any = None, tensor: torch.Tensor | None = None) -> None: ...

    @abstractmethod
    def recv(self) -> Message: ...


def gloo_group(store: dist.Store, rank: int, world_size: int, local_addr: str) -> ProcessGroupGloo:
    """A gloo group bound to ``local_addr``: the address this host uses to reach
    the master, so that it works inside network namespaces without hostnames."""
    opts = ProcessGroupGloo._Options()
    opts._timeout = NO_DEADLINE
    opts._devices = [ProcessGroupGloo.create_device(hostname=local_addr)]
    return ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, opts)


def nccl_group(store: dist.Store, rank: int, world_size: int):
    """NCCL group for activations between GPU stages (not testable on CPU-only hosts)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = NO_DEADLINE
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, opts)


class TorchTransport(Transport):
    """torch.distributed point-to-point: gloo for control (and CPU tensors), NCCL for GPU tensors."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, local_addr: str,
                 device: torch.device | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")
        self.control = gloo_group(store, rank, world_size, local_addr)
        self.tensors = nccl_group(store, rank, world_size) if self.device.type == "cuda" else self.control

    def send(self, dst: int, kind: Kind, obj: Any = None, tensor: torch.Tensor | None = None) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0], header[1], header[2] = int(kind), len(payload), -1
        if tensor is not None:
            if tensor.dim() > MAX_DIMS:
                raise ValueError(f"tensors of up to {MAX_DIMS} dims travel; got shape {tuple(tensor.shape)}")
            header[2], header[3] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[4:4 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:HEADER_BYTES] = header.view(torch.uint8)
        inline = len(payload) <= FRAME_BYTES - HEADER_BYTES
        if inline:
            frame[HEADER_BYTES:HEADER_BYTES + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.control.send([frame], dst, TAG_HEADER).wait()
        if not inline:
            self.control.send([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], dst, TAG_PAYLOAD).wait()
        if tensor is not None:
            self.tensors.send([tensor.contiguous()], dst, TAG_TENSOR).wait()

    def recv(self) -> Message:
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        work = self.control.recv_anysource([frame], TAG_HEADER)
        work.wait()
        arrived = time.time()
        src = work._source_rank()
        header = frame[:HEADER_BYTES].view(torch.int64)
        kind, size, dtype_code, ndim = (int(x) for x in header[:4])
        if size <= FRAME_BYTES - HEADER_BYTES:
            payload = frame[HEADER_BYTES:HEADER_BYTES + size]
        else:
            payload = torch.empty(size, dtype=torch.uint8)
            self.control.recv([payload], src, TAG_PAYLOAD).wait()
        obj = pickle.loads(payload.numpy().tobytes())
        tensor = None
        if dtype_code >= 0:
            shape = [int(x) for x in header[4:4 + ndim]]
            tensor = torch.empty(shape, dtype=_DTYPES[dtype_code], device=self._tensor_device())
            self.tensors.recv([tensor], src, TAG_TENSOR).wait()
        return Message(src, Kind(kind), obj, tensor, arrived)

    def _tensor_device(self) -> torch.device:
        return self.device if self.tensors is not self.control else torch.device("cpu")
