"""PP = 1: the one stage runs in the driver process, with no process hop."""

from __future__ import annotations

from collections import deque

import torch

from pipeserve.worker.executor import Executor
from pipeserve.worker.model_runner import ModelRunner
from pipeserve.worker.step import StepInput, StepOutput


class LocalExecutor(Executor):
    """Runs each step synchronously in ``submit``; ``wait`` hands the results back."""

    max_inflight = 1

    def __init__(self, runner: ModelRunner, num_threads: int | None = None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.runner = runner
        self._done: deque[StepOutput] = deque()

    def submit(self, step: StepInput) -> None:
        output = self.runner.execute(step)
        assert isinstance(output, StepOutput), "a single stage is also the last stage"
        self._done.append(output)

    def wait(self, timeout: float | None = None) -> list[StepOutput]:
        done = list(self._done)
        self._done.clear()
        return done

    def profiles(self) -> list:
        profiler = getattr(self.runner, "profiler", None)
        return [] if profiler is None else [profiler.snapshot()]

    def weight_bytes(self) -> list[int]:
        return [self.runner.weight_bytes]

    @property
    def num_inflight(self) -> int:
        return len(self._done)
