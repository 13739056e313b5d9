"""Tools in a chat: the prompt they go into, the constraint that forces a call, and the answer
turned into ``tool_calls`` (whole, or as stream deltas the openai client assembles). Used by
``/v1/chat/completions`` and ``LLM.chat(..., tools=...)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeserve.structured import tools as T
from pipeserve.structured.params import StructuredOutputsParams


class ToolsError(ValueError):
    """A malformed ``tools`` or ``tool_choice``; ``param`` names which."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ChatTools:
    functions: list[dict]
    mode: str                      # "none" | "auto" | "required" | a function name
    fmt: str                       # one of tools.FORMATS

    @classmethod
    def of(cls, tools: Any, tool_choice: Any, chat_template: str | None) -> "ChatTools":
        """``ToolsError`` naming ``tools`` or ``tool_choice`` when either is malformed."""
        try:
            functions = T.check_tools(tools) if tools else []
        except ValueError as exc:
            raise ToolsError(str(exc), "tools") from None
        try:
            mode = T.choice_mode(tool_choice, functions) if functions else "none"
        except ValueError as exc:
            raise ToolsError(str(exc), "tool_choice") from None
        return cls(functions, mode, T.template_format(chat_template))

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.mode not in ("none", "auto")

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """Messages for the chat template: earlier calls in the model's format where the template
        cannot render ``tool_calls``, and SmolLM2's tool prompt in the system message."""
        if self.fmt != "smollm2":
            return [_with_dict_arguments(m) for m in messages]
        out = []
        for m in messages:
            if m.get("tool_calls"):
                text = T.calls_as_text(m["tool_calls"], self.fmt)
                m = {**{k: v for k, v in m.items() if k != "tool_calls"},
                     "content": ((m.get("content") or "") + text)}
            out.append(m)
        if self.active:
            prompt = T.smollm2_system_prompt(self.functions)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def template_tools(self) -> list[dict] | None:
        """``tools`` for templates that render them (Llama 3.1, Qwen 2.5, Hermes)."""
        if not self.active or self.fmt == "smollm2":
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def structured(self) -> StructuredOutputsParams | None:
        """``required`` / a named function: the grammar that makes the answer a call."""
        if not self.forced:
            return None
        return StructuredOutputsParams(grammar=T.forced_call_grammar(self.functions, self.mode, self.fmt))

    def message(self, text: str) -> tuple[dict, bool]:
        """(the assistant message for ``text``, whether it holds tool calls)."""
        content, calls = T.parse_tool_calls(text) if self.active else (text, [])
        if not calls:
            return {"role": "assistant", "content": text}, False
        return {"role": "assistant", "content": content,
                "tool_calls": [c.as_openai() for c in calls]}, True


@dataclass
class ToolStream:
    """Per choice: content streams as usual until it may be a tool call; then the text is held
    and, at the end, sent as ``tool_calls`` deltas (or as content if it held no call)."""

    tools: ChatTools
    _held: dict[int, str] = field(default_factory=dict)
    _released: set[int] = field(default_factory=set)

    def deltas(self, index: int, text: str, finished: bool) -> tuple[list[dict], bool]:
        """(delta objects to send for this choice, whether they carry tool calls)."""
        if index in self._released:
            return ([{"content": text}] if text else []), False
        held = self._held.get(index, "") + text
        self._held[index] = held
        if not self.tools.forced and not T.may_become_tool_call(held):
            self._released.add(index)
            return [{"content": held}], False
        if not finished:
            return [], False
        message, has_calls = self.tools.message(held)
        if not has_calls:
            return [{"content": held}], False
        out = [{"content": message["content"]}] if message["content"] else []
        return out + [{"tool_calls": [c | {"index": i}]} for i, c in enumerate(message["tool_calls"])], True


def _with_dict_arguments(message: dict) -> dict:
    """HF templates (Llama 3.1, Qwen 2.5) expect each call's arguments as a dict, not JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": T.arguments_value(c["function"].get("arguments"))}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}
