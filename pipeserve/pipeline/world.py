"""One generation of the pipeline: launch the local stages, meet the remote ones, connect.

``StageWorld.open`` listens on the driver's address, starts the stages of
node 0 and waits until every stage has joined and loaded its layers
(``pipeline/joining.py``). ``close`` ends the generation. Recovery opens a new generation
rather than patching the old one: a fresh listener and fresh connections, so
nothing of the failed one (half-open sockets, queued messages) can leak into it.
(The TCP transport could replace one rank: a new HELLO replaces its connection.)
"""

from __future__ import annotations

import logging
from typing import Any

from pipeserve.comm.tcp import TcpTransport
from pipeserve.config import EngineConfig
from pipeserve.pipeline.joining import open_stages
from pipeserve.pipeline.launcher import stop_processes
from pipeserve.pipeline.spec import PipelineSpec

logger = logging.getLogger(__name__)


class StageWorld:
    def __init__(self, port: int, procs: dict[int, Any], transport: TcpTransport,
                 weight_bytes: dict[int, int] | None = None) -> None:
        self.port = port
        self.weight_bytes = weight_bytes or {}   # rank -> resident weight bytes (from READY)
        self.procs = procs              # stage -> local process (.pid, .is_alive(), .exitcode)
        self.transport = transport

    @classmethod
    def open(cls, config: EngineConfig, spec: PipelineSpec, join_timeout: float) -> "StageWorld":
        """Launch and connect every stage; remote ones get ``join_timeout`` seconds to join."""
        transport, procs, port, weight_bytes = open_stages(config, spec, join_timeout)
        return cls(port, procs, transport, weight_bytes)

    @property
    def pids(self) -> dict[int, int]:
        return {stage: proc.pid for stage, proc in self.procs.items()}

    def local(self, stage: int) -> bool:
        return stage in self.procs

    def stop(self, grace: float) -> None:
        """Wait ``grace`` seconds for the local stages to exit, then kill what is left."""
        stop_processes(list(self.procs.values()), grace=grace)
        self.transport.close()

