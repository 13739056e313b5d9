"""Point-to-point messages between pipeline ranks: one typed object plus,
optionally, one activation tensor.

Rank 0 is the driver, ranks 1..P are the stages. ``send`` goes to one rank;
``recv`` takes the next message from *any* rank (a stage may get work from
the driver, from the previous stage, or round the ring from the last one).
What each ``Kind`` carries is declared in ``pipeserve/comm/messages.py``; the
implementation is ``pipeserve/comm/tcp.py``.

The runtime calls ``send`` from the thread that has the message when nothing
is queued before it and the message is small (saving a thread wake-up per
hop), else from sender threads, so a stage computes while its last large
output is still on the wire. It calls ``recv`` only while a generation joins;
after that the TCP transport hands each message to its owner's function on
the thread that read it (``TcpTransport.set_receiver``), for the same reason.
Liveness is the driver's watchdog's job (process exit codes, a per-step
deadline); a closed connection shows up as a ``LOST`` message from that rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch


class Kind(IntEnum):
    STEP = 1       # driver -> stage 0 (or a stage to itself): a micro-batch (StepEnvelope) + activations
    RESULT = 2     # last stage -> driver: (StepOutput, intervals)
    STOP = 3       # driver -> stage: finish and exit
    BYE = 4        # stage -> driver: exiting (unblocks the driver's receiver)
    PING = 5       # driver -> stage: answer with PONG (clock offset, liveness)
    PONG = 6       # stage -> driver: Pong (its clock; how long its step has computed, on how much CPU)
    FLUSH = 7      # driver -> stage: send your unsent intervals now
    TIMELINE = 8   # stage -> driver: intervals
    ERROR = 9      # stage -> driver: a runner raised (step id, stage, traceback text)
    HELLO = 10     # first frame on every connection: who is calling (Hello)
    SPEC = 11      # driver -> stage: the pipeline spec (SpecWire)
    READY = 12     # stage -> driver: layers loaded
    FAILED = 13    # stage -> driver: could not load (traceback text)
    PEERS = 14     # driver -> stage: where the other stages listen (list[Peer])
    NODE = 15      # worker node <-> driver: how many stages, which are mine (NodeInfo)
    LINK_DOWN = 16  # stage -> driver: sending to another stage failed (its rank, reason)
    RESET = 17     # driver -> stage: drop your state, close your links and join again
    LOST = 18      # never sent: the local transport's note that the connection to ``src`` closed
    PROFILE = 19   # stage -> driver: its cumulative --profile figures (StageProfile), before a TIMELINE
    TOKENS = 20    # last stage -> stage 0: a step's sampled tokens (step id, [(seq id, token id)])
    PLAN = 21      # driver -> stage >= 1: a step it will run (StepInput), sent when stage 0 gets it
    HOP = 22       # stage -> next stage: a planned step's activations (Hop: step id, chunk, intervals)
    LOADING = 23   # stage -> driver: still loading its layers (Loading: time, CPU and bytes read so far)


@dataclass
class Message:
    src: int
    kind: Kind
    obj: Any
    tensor: torch.Tensor | None
    arrived: float      # time.time() when it started to arrive (not before the recv call began)


class Transport(ABC):
    rank: int
    world_size: int

    @abstractmethod
    def send(self, dst: int, kind: Kind, obj: Any = None, tensor: torch.Tensor | None = None) -> None:
        """Raises ``ConnectionError`` when ``dst`` cannot be reached."""

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Message:
        """The next message from any rank; raises ``TimeoutError`` after ``timeout`` seconds."""
