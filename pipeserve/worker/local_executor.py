"""PP = 1: the one stage runs in the driver process, with no process hop."""

from __future__ import annotations

import traceback
from collections import deque

import torch

from pipeserve.worker.executor import Executor, ExecutorError
from pipeserve.worker.model_runner import ModelRunner
from pipeserve.worker.step import StepInput, StepOutput


class LocalExecutor(Executor):
    """Runs each step synchronously in ``submit``; ``wait`` hands the results back.

    A step whose run raises fails the executor as a stage's exception fails a pipeline
    (``ExecutorError`` naming the step), and ``recover`` takes it back into service: there is
    no process to replace, and the engine drops every block and replays every sequence, so the
    runner's cache starts over as a restarted stage's does. One request alone, or a transient
    error (memory), thus costs a pause, not the engine, at PP = 1 as at PP > 1."""

    max_inflight = 1

    def __init__(self, runner: ModelRunner, num_threads: int | None = None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.runner = runner
        self._done: deque[StepOutput] = deque()
        self._failure: str | None = None

    def submit(self, step: StepInput) -> None:
        if self._failure is not None:
            raise ExecutorError(self._failure)
        try:
            output = self.runner.execute(step)
        except Exception:
            self._done.clear()
            self._failure = f"the model raised while running step {step.step_id}:\n{traceback.format_exc()}"
            raise ExecutorError(self._failure, step_id=step.step_id) from None
        assert isinstance(output, StepOutput), "a single stage is also the last stage"
        self._done.append(output)

    def wait(self, timeout: float | None = None) -> list[StepOutput]:
        if self._failure is not None:
            raise ExecutorError(self._failure)
        done = list(self._done)
        self._done.clear()
        return done

    def recover(self) -> None:
        self._failure = None
        self._done.clear()

    @property
    def healthy(self) -> bool:
        return self._failure is None

    def profiles(self) -> list:
        profiler = getattr(self.runner, "profiler", None)
        return [] if profiler is None else [profiler.snapshot()]

    def weight_bytes(self) -> list[int]:
        return [self.runner.weight_bytes]

    @property
    def num_inflight(self) -> int:
        return len(self._done)
