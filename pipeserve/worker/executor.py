"""The interface between the engine (driver) and whatever runs the model.

The engine forms micro-batches (``StepInput``) and submits them; an executor
runs them through one in-process stage (PP = 1) or P stage processes, and
hands back ``StepOutput``s as they finish. Up to ``max_inflight`` steps may be
in flight at once; each holds a disjoint set of sequences, except a prompt's
consecutive chunks and, where ``decodes_ahead``, a decode sent before the token
it takes in is sampled (``StepInput.tokens_from``: the executor's last stage
hands that token to its first; the engine's "decode ahead").
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pipeserve.worker.step import StepInput, StepOutput


class ExecutorError(RuntimeError):
    """A stage died, stopped answering or failed; in-flight steps are lost. ``step_id``: the
    step a stage's runner raised on (a live stage's exception), None for a death or a stall."""

    def __init__(self, message: str, step_id: int | None = None) -> None:
        super().__init__(message)
        self.step_id = step_id


class Executor(ABC):
    max_inflight: int = 1
    decodes_ahead: bool = False      # runs steps with ``tokens_from`` (pipeline/stage_worker.py)

    @abstractmethod
    def submit(self, step: StepInput) -> None:
        """Start ``step``; returns without waiting for it."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> list[StepOutput]:
        """Block until at least one submitted step finishes (or ``timeout``
        passes: then ``[]``). Returns finished steps in completion order.
        Raises ``ExecutorError`` when a stage is dead or silent."""

    @property
    @abstractmethod
    def num_inflight(self) -> int: ...

    @property
    def healthy(self) -> bool:
        return True

    @property
    def stage_pids(self) -> dict[int, int]:
        """``{stage: pid}`` of the stage processes this host runs ({} in-process)."""
        return {}

    def recover(self) -> None:
        """Replace failed stages so that ``submit`` works again; every step in flight is
        lost and every KV cache starts empty. Raises ``ExecutorError`` if it cannot."""
        raise ExecutorError(f"{type(self).__name__} cannot replace a failed stage")

    def stats(self) -> dict:
        """Per-stage timeline figures (busy fraction, bubble ratio, ...)."""
        return {}

    def profiles(self) -> list:
        """Each stage's cumulative ``metrics.profile.StageProfile`` (``--profile``; [] without it)."""
        return []

    def weight_bytes(self) -> list[int]:
        """Resident weight bytes of each stage (stage order)."""
        return []

    def shutdown(self) -> None:
        """Stop every stage; leaves no process behind. Idempotent."""
