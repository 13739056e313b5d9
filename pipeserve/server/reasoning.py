"""``--reasoning-parser``: a thinking model's reasoning apart from its answer, as vLLM's parser
of the same name reports it (``message.reasoning_content`` beside ``message.content``; in a
stream, ``delta.reasoning_content`` chunks before the ``delta.content`` ones).

Both parsers read think tags (``<think>`` … ``</think>``):
- ``qwen3``: the reasoning is what the output opens with a ``<think>`` tag (or, where the
  chat template ended the prompt with that tag, as Qwen3's thinking-only releases do, what the
  output opens with) up to ``</think>``; an output without either is all answer (Qwen3 with
  ``chat_template_kwargs: {"enable_thinking": false}``).
- ``deepseek_r1``: the output opens with reasoning (its template ends the prompt in
  ``<think>``; a ``<think>`` the model writes itself is dropped) up to ``</think>``; an output
  that never closes it is all reasoning.

One causal splitter serves the stream and the whole response alike (the whole text is one
delta), so a stream's pieces always join to the whole response's fields: text that may still
turn out to be a tag is held back until the next delta or the end.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str, opens_in_reasoning: bool) -> None:
        self.name = name
        self.opens_in_reasoning = opens_in_reasoning   # before any tag is seen

    def splitter(self, prompt_text: str) -> "ThinkSplitter":
        """A splitter for one choice; ``prompt_text``: the rendered prompt (does it end inside
        an open think block?)."""
        tail = prompt_text.rstrip()
        in_prompt = tail.endswith(START) or (tail.rfind(START) > tail.rfind(END))
        return ThinkSplitter(opened=self.opens_in_reasoning or in_prompt)


class ThinkSplitter:
    """Feeds a choice's text deltas; returns (reasoning delta, content delta) for each."""

    def __init__(self, opened: bool) -> None:
        self._phase = "start"         # start -> reasoning -> content
        self._opened = opened         # reasoning from the first character, without a tag
        self._pending = ""            # held back: may be the start of a tag
        self.saw_reasoning = opened

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text = self._pending + text
        self._pending = ""
        reasoning = content = ""
        if self._phase == "start":
            stripped = text.lstrip()
            if stripped.startswith(START):
                self._phase, text, self.saw_reasoning = "reasoning", stripped[len(START):], True
            elif not final and START.startswith(stripped):   # "", "<", "<thi": wait for more
                self._pending = text
                return "", ""
            else:
                self._phase = "reasoning" if self._opened else "content"
        if self._phase == "reasoning":
            at = text.find(END)
            if at >= 0:
                reasoning, content = text[:at], text[at + len(END):]
                self._phase = "content"
            else:
                keep = 0 if final else _partial_suffix(text, END)
                reasoning, self._pending = text[:len(text) - keep], text[len(text) - keep:]
            return reasoning, content
        return reasoning, text

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole response's (reasoning_content, content); None where a part is absent."""
        reasoning, content = self.feed(text, final=True)
        return (reasoning if self.saw_reasoning else None), (content or None)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", opens_in_reasoning=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_in_reasoning=True),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser {name!r}: choose one of {', '.join(sorted(REASONING_PARSERS))}") from None
