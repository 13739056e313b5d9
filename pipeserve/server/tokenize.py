"""``POST /tokenize`` and ``POST /detokenize``, as vLLM's server has them: a prompt, or chat
messages through the model's chat template, to the token ids the completions and chat routes
would feed the model (a client counts tokens or checks a template with it), and ids back to
text. The tokenizer only: no engine call, so they answer while the pipeline restarts too."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pipeserve.server.chat import render_messages
from pipeserve.server.errors import APIError
from pipeserve.server.protocol import ChatCompletionRequest, parse_request
from pipeserve.server.serving import ServerState
from pipeserve.structured.chat_tools import ChatTools, ToolsError


class TokenizeRequest(BaseModel):
    """vLLM's two forms in one body: ``prompt`` (a completion's text) or ``messages`` (a chat)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None      # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: StrictBool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either prompt (text) or messages (a chat), not both or neither",
                           param="prompt")
        if self.prompt is None and self.add_special_tokens:
            raise APIError(400, "add_special_tokens applies to a prompt; the chat template writes the special "
                           "tokens of messages itself", param="add_special_tokens")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt] = Field(default_factory=list)

    def check(self) -> None:
        pass


def tokenize(state: ServerState, raw: Any) -> dict:
    body = parse_request(TokenizeRequest, raw)
    state.check_model(body.model)
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=add)
    else:
        chat = parse_request(ChatCompletionRequest, {
            "messages": body.messages, "tools": body.tools, "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "chat_template_kwargs": body.chat_template_kwargs})
        try:
            tools = ChatTools.of(chat.tools, None, state.tokenizer.chat_template)
        except ToolsError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        ids = render_messages(state, chat, tools)
    ids = [int(i) for i in ids]
    strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(state: ServerState, raw: Any) -> dict:
    body = parse_request(DetokenizeRequest, raw)
    state.check_model(body.model)
    vocab = state.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is out of range for a vocabulary of {vocab}", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}
