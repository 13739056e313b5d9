"""vLLM's rules for rendering a chat through a model's template (``continue_final_message``,
``add_generation_prompt``, ``chat_template_kwargs``), checked before the template runs: the
tokenizer, the server's request validation and ``LLM.chat`` share them. Torch-free, so the
server's edge imports it cheaply."""

from __future__ import annotations

import os
from typing import Any

# What apply_chat_template sets itself: a template variable of the same name cannot be passed.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                       "continue_final_message", "tokenize", "return_dict", "chat_template",
                                       "padding", "truncation", "max_length", "return_tensors"})


def check_chat_options(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                       chat_template_kwargs: dict[str, Any] | None) -> None:
    """vLLM's rules for rendering a chat; ValueError naming the option otherwise."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                         "goes on with the last message, the second opens a new assistant turn")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the last message to be the assistant's (the text to "
                         "go on from)")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise ValueError("chat_template_kwargs must be an object of template variables")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: pass them as the request's "
                             "own fields")


def resolve_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is a template (it holds
    ``{``); checked to parse as Jinja, so a bad one is refused at start-up, not at the first
    chat. ValueError naming the flag otherwise."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value!r}: cannot read it: {exc}") from None
    elif "{" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a template (a Jinja template "
                         "holds {{ }} or {% %})")
    import jinja2   # transformers' dependency; only where a template is given

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text
