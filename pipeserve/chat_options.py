"""vLLM's rules for rendering a chat through a model's template (``continue_final_message``,
``add_generation_prompt``, ``chat_template_kwargs``), checked before the template runs: the
tokenizer, the server's request validation and ``LLM.chat`` share them. Torch-free, so the
server's edge imports it cheaply."""

from __future__ import annotations

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
