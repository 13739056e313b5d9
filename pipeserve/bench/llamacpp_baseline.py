"""The llama.cpp baseline (llama-cpp-python, an optional extra) on the same requests.

llama-cpp-python's ``Llama`` holds one sequence, so requests run one after the
other: with ``--num-prompts 1`` this is the single-stream decode comparison.
Each request generates exactly its ``output_len`` tokens whatever it samples
(pipeserve's benchmark runs with ``ignore_eos``), from its prompt token ids, so
both engines see the same tokens in and count the same tokens out.
"""

from __future__ import annotations

import importlib
import time

from pipeserve.bench.datasets import BenchRequest
from pipeserve.bench.stats import RequestRecord

INSTALL = "pip install 'pipeserve[llamacpp]'   (or: pip install llama-cpp-python)"


def import_llama_cpp():
    """The ``llama_cpp`` module, or a ValueError that says how to install it."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise ValueError(f"--backend llamacpp needs llama-cpp-python, which is not installed ({exc}); "
                         f"install the optional extra with: {INSTALL}  -- it compiles llama.cpp, "
                         "which takes several minutes") from None


def load_llama(gguf_path: str, requests: list[BenchRequest], threads: int, seed: int = 0):
    """A ``llama_cpp.Llama`` on the CPU with a context long enough for the longest request."""
    llama_cpp = import_llama_cpp()
    longest = max(r.prompt_len + r.output_len for r in requests)
    return llama_cpp.Llama(model_path=gguf_path, n_ctx=max(512, longest + 8), n_batch=512,
                           n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, seed=seed,
                           verbose=False)


def run_request(llm, request: BenchRequest, temperature: float) -> RequestRecord:
    """Prefill the prompt, then sample until ``output_len`` tokens exist (EOS does not stop it)."""
    sampling = {"temp": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0} if temperature > 0 \
        else {"temp": 0.0}
    start = time.perf_counter()
    first = None
    produced = 0
    for _ in llm.generate(request.prompt_token_ids, repeat_penalty=1.0, reset=True, **sampling):
        produced += 1
        if first is None:
            first = time.perf_counter()
        if produced >= request.output_len:
            break
    end = time.perf_counter()
    return RequestRecord(prompt_len=request.prompt_len, output_len=produced,
                         ttft=(first or end) - start, e2el=end - start)


def run_llamacpp(llm, requests: list[BenchRequest], temperature: float = 0.0,
                 progress: bool = True) -> tuple[list[RequestRecord], float]:
    """All requests, one at a time; returns (records, wall seconds)."""
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="llama.cpp (one sequence)", unit="req")
    records: list[RequestRecord] = []
    start = time.perf_counter()
    for request in requests:
        records.append(run_request(llm, request, temperature))
        if bar is not None:
            bar.update(1)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return records, duration
