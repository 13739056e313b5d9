"""pipeserve: a pipeline-parallel LLM inference engine."""

__version__ = "0.1.0"

from pipeserve.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pipeserve.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so that plain-Python parts stay light.
    if name == "LLM":
        from pipeserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
