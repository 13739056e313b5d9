"""The offline API, shaped like vLLM's ``LLM``.

    from pipeserve import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", pipeline_parallel_size=2)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Every engine flag is a keyword argument, dashes turned into underscores
(``--max-num-seqs`` -> ``max_num_seqs``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from pipeserve.chat_options import resolve_chat_template
from pipeserve.config import DEFAULT_MODEL, EngineConfig
from pipeserve.engine.input_processor import PromptType
from pipeserve.engine.llm_engine import LLMEngine
from pipeserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pipeserve.sampling_params import SamplingParams
from pipeserve.structured.chat_tools import ChatTools


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    # -- generation --------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: Sequence[int] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt that can never be served (too long, too big for the KV cache)
        gets an output with ``finish_reason == "error"``; the others run on.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                self.engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0)
            except ValueError as exc:
                results[request_id] = _rejected(request_id, prompt, p, str(exc))
        self._run(results, len(order), use_tqdm)
        return [results[r] for r in order]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, add_generation_prompt: bool = True, use_tqdm: bool = False,
             tools: list[dict] | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        ``tools`` (OpenAI format) go into the prompt the way the template renders them
        (SmolLM2's template does not: they go into its function-calling system prompt);
        ``pipeserve.structured.tools.parse_tool_calls`` reads the calls out of the text.
        As in vLLM, ``continue_final_message=True`` (with ``add_generation_prompt=False``)
        goes on with a last assistant message instead of opening a new turn, and
        ``chat_template_kwargs`` are the template's own variables (Qwen3's
        ``enable_thinking``, for one), and ``chat_template`` (a Jinja template) renders these
        conversations instead of the engine's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        if chat_template is not None:
            chat_template = resolve_chat_template(chat_template)
        chat_tools = ChatTools.of(tools, None, chat_template or tokenizer.chat_template)
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
            chat_tools.template_messages(conv), add_generation_prompt=add_generation_prompt,
            tools=chat_tools.template_tools(), continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        bar = _progress(total - len(results)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(partial_outputs=False):   # only finished ones are kept
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()

    # -- the rest ----------------------------------------------------------
    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        """Scheduler, KV cache, prefix cache and per-stage pipeline figures."""
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def _rejected(request_id: str, prompt: PromptType, params: SamplingParams, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    ids = prompt if isinstance(prompt, list) else []
    outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
               for i in range(params.n)]
    now = time.time()
    return RequestOutput(request_id, text, ids, outputs, finished=True,
                         metrics=RequestMetrics(arrival_time=now, finished_time=now), error=message)


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="Processed prompts", unit="req")
