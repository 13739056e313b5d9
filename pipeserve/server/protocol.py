"""Request bodies of the OpenAI API, validated at the edge, and their SamplingParams.

Known OpenAI fields, and vLLM's extra ones, that pipeserve cannot honour are
refused with a 400 that names them (``prompt_logprobs``, ``allowed_token_ids``,
...); unknown fields are ignored (with a log line), as vLLM does, so that
clients which send a few extra keys keep working.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from pipeserve.chat_options import check_chat_options
from pipeserve.sampling_params import SamplingParams
from pipeserve.server.errors import APIError
from pipeserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20

# vLLM request fields that pipeserve cannot honour: refused by name when set (to anything but
# their off value), since ignoring them would answer something other than what was asked.
_UNSUPPORTED_VLLM_FIELDS = {
    "prompt_logprobs": "prompt logprobs are not computed by pipeserve",
    "allowed_token_ids": "allowed_token_ids is not supported by pipeserve; a structured output "
                         "(guided_choice, guided_regex) constrains the output instead",
    "bad_words": "bad_words is not supported by pipeserve",
    "use_beam_search": "beam search is not supported by pipeserve",
    "logits_processors": "logits_processors are not supported by pipeserve",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False     # vLLM's: usage so far in every chunk too


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints, including vLLM's extra sampling knobs."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extra fields, named as vLLM names them.
    priority: StrictInt = 0
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = None   # vLLM's: keep the prompt's last k tokens (-1: what fits)

    def check_common(self) -> None:
        for name, why in _UNSUPPORTED_VLLM_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if not (value is None or value is False or (isinstance(value, (list, dict)) and not value)):
                raise APIError(400, why, param=name)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise APIError(400, f"truncate_prompt_tokens must be -1 (keep what fits the context) or at least 1, "
                           f"got {self.truncate_prompt_tokens}", param="truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.model_extra:
            logger.info("ignoring unknown request fields: %s", ", ".join(sorted(self.model_extra)))

    def token_biases(self) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` (token ids as JSON object keys) with integer keys; 400 naming
        it when a key is no token id."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, value in self.logit_bias.items():
            try:
                biases[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        return biases

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` ids (-1: the last ``max_model_len - 1``,
        room for one generated token), as vLLM truncates; all of them when unset."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        keep = max_model_len - 1 if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk with output carries the usage so far (vLLM: with ``include_usage`` only)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint, compiled once to check it (400 naming a bad one)."""
        from pipeserve.server.structured import structured_outputs_of
        return structured_outputs_of(self)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises ``APIError(400)`` naming the parameter when a value is out of range."""
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                stop=self.stop, stop_token_ids=self.stop_token_ids, max_tokens=max_tokens,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured,
                logit_bias=self.token_biases())
        except ValueError as exc:
            raise APIError(400, str(exc), param=_param_of(str(exc))) from None


class CompletionRequest(_SamplingFields):
    prompt: Any = None
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise APIError(400, "suffix is not supported by pipeserve", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of ({self.best_of}) different from n ({self.n}) is not supported; "
                           "leave best_of unset", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                           param="logprobs")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo together with logprobs needs prompt logprobs, which pipeserve "
                           "does not compute; drop one of them", param="echo")

    def prompts(self) -> list[str | list[int]]:
        return normalize_prompts(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: role, plain-text content, and an
        assistant's ``tool_calls`` or a tool answer's ``tool_call_id`` when present."""
        message: dict[str, Any] = {"role": self.role, "content": _text_content(self.content)}
        if self.name:
            message["name"] = self.name
        for key in ("tool_calls", "tool_call_id"):
            if (self.model_extra or {}).get(key) is not None:
                message[key] = self.model_extra[key]
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    # vLLM's rendering options: the template's own variables, and going on with a final
    # assistant message (a prefill) instead of opening a new turn.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_common()
        self.check_rendering()
        if self.functions:
            raise APIError(400, "the deprecated functions field is not supported; send tools", param="functions")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                               param="top_logprobs")

    def check_rendering(self) -> None:
        try:
            check_chat_options(self.template_messages(), self.add_generation_prompt, self.continue_final_message,
                               self.chat_template_kwargs)
        except ValueError as exc:
            param = next((p for p in ("chat_template_kwargs", "continue_final_message") if p in str(exc)), None)
            raise APIError(400, str(exc), param=param) from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]


def parse_request(model: type[CompletionRequest] | type[ChatCompletionRequest], body: Any):
    """Validate a decoded JSON body; every failure is a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"invalid value for {param}: {first['msg']}", param=param) from None
    request.check()
    return request


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """``str | list[str] | list[int] | list[list[int]]`` -> a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise APIError(400, "prompt must be a non-empty string, a list of strings, a list of token ids "
                   "or a list of lists of token ids", param="prompt")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, *,
                       prompt_field: str = "prompt") -> int:
    """Refuse prompt + max_tokens over the context (as vLLM does); default to what is left."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, but the "
                       f"prompt has {prompt_len} tokens. Please reduce the length of the prompt.",
                       param=prompt_field, code="context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if prompt_len + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                       f"{requested} in the completion). Please reduce the length of the prompt or "
                       "max_tokens.", param="max_tokens", code="context_length_exceeded")
    return requested


def _text_content(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"message content parts of type {part.get('type')!r} are not supported; "
                           "only text parts are", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _param_of(message: str) -> str | None:
    """``"SamplingParams.top_p must be ..."`` -> ``"top_p"``."""
    head = message.split(" ", 1)[0]
    return head.split(".", 1)[1] if head.startswith("SamplingParams.") else None
