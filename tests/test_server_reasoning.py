"""``--reasoning-parser``: a thinking model's reasoning apart from its answer, whole and streamed
(``server/reasoning.py``), against vLLM's rules for ``qwen3`` and ``deepseek_r1``; through the
app on a scripted fake engine (no model, no torch)."""

from __future__ import annotations

import json
import random

import pytest

from pipeserve.server.reasoning import REASONING_PARSERS, reasoning_parser
from tests.test_server_api import FakeEngine, make_client

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
CHATML_TAIL = "<|im_start|>assistant\n"


@pytest.mark.parametrize("parser, prompt, text, expected", [
    (QWEN3, CHATML_TAIL, "<think>\nsum it up\n</think>\n\nIt is 4.", ("\nsum it up\n", "\n\nIt is 4.")),
    (QWEN3, CHATML_TAIL, "It is 4.", (None, "It is 4.")),                            # thinking off
    (QWEN3, CHATML_TAIL + "<think>\n\n</think>\n\n", "It is 4.", (None, "It is 4.")),  # the template's empty block
    (QWEN3, CHATML_TAIL, "<think>\nstill thinking", ("\nstill thinking", None)),    # cut by max_tokens
    (QWEN3, CHATML_TAIL + "<think>\n", "sum it up\n</think>\n\nIt is 4.", ("sum it up\n", "\n\nIt is 4.")),
    (QWEN3, CHATML_TAIL, "  <think>a</think>b", ("a", "b")),
    (QWEN3, CHATML_TAIL, "<thinking is fun", (None, "<thinking is fun")),
    (QWEN3, CHATML_TAIL, "", (None, None)),
    (R1, CHATML_TAIL + "<think>\n", "sum it up\n</think>\n\nIt is 4.", ("sum it up\n", "\n\nIt is 4.")),
    (R1, CHATML_TAIL, "<think>sum</think>4", ("sum", "4")),
    (R1, CHATML_TAIL, "no end tag", ("no end tag", None)),
    (R1, CHATML_TAIL, "</think>4", ("", "4")),
])
def test_whole_text_splits_as_vllm_does(parser, prompt, text, expected):
    assert parser.splitter(prompt).split(text) == expected


@pytest.mark.parametrize("parser, prompt", [(QWEN3, CHATML_TAIL), (QWEN3, CHATML_TAIL + "<think>"), (R1, "")])
def test_any_chunking_of_a_stream_joins_to_the_whole_split(parser, prompt):
    rng = random.Random(0)
    texts = ["<think>\nsum it up\n</think>\n\nIt is 4.", "It is 4 <think> not a tag", "<think>x</thin",
             "<thi", "a</think>b</think>c", "\n\n<think></think>", "<think>\nhalf </thi"]
    for text in texts:
        whole = parser.splitter(prompt).split(text)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            splitter = parser.splitter(prompt)
            got = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
            reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
            assert (reasoning if splitter.saw_reasoning else None, content or None) == whole, (text, pieces)
            seen_content = False
            for r, c in got:        # no reasoning after the answer has begun
                assert not (seen_content and r), (text, pieces)
                seen_content = seen_content or bool(c)


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("llama")


class ScriptedEngine(FakeEngine):
    """Every sequence writes ``script``, one character (the fake tokenizer's token) a step."""

    def __init__(self, script: str) -> None:
        super().__init__(step_s=0.001)
        self.script = script

    def next_token(self, req, index: int, made: int) -> tuple[int, str | None]:
        if made + 1 == len(self.script):
            return ord(self.script[made]), "stop"
        return ord(self.script[made]), ("length" if made + 1 >= req.params.max_tokens else None)


SCRIPT = "<think>\nadd 2 and 2\n</think>\n\nIt is 4."
CHAT = {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 40}


def _stream_parts(client, body) -> tuple[str, str, list[str]]:
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    reasoning, content, order = "", "", []
    for line in r.text.split("\n\n"):
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                reasoning += delta["reasoning_content"]
                order.append("reasoning")
            if delta.get("content"):
                content += delta["content"]
                order.append("content")
    return reasoning, content, order


def test_the_server_reports_reasoning_apart_whole_and_streamed():
    with make_client(ScriptedEngine(SCRIPT), reasoning=QWEN3) as client:
        message = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "\nadd 2 and 2\n" and message["content"] == "\n\nIt is 4."
        reasoning, content, order = _stream_parts(client, CHAT)
        assert (reasoning, content) == (message["reasoning_content"], message["content"])
        assert order == sorted(order, key=lambda kind: kind == "content")     # reasoning first
        cut = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12}).json()["choices"][0]
        assert cut["message"] == {"role": "assistant", "content": None, "reasoning_content": "\nadd "}
        assert cut["finish_reason"] == "length"
    with make_client(ScriptedEngine(SCRIPT)) as client:        # no parser: the tags are content
        message = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert message["content"] == SCRIPT and "reasoning_content" not in message
        assert _stream_parts(client, CHAT)[:2] == ("", SCRIPT)


def test_a_streamed_reasoning_answer_carries_each_tokens_logprobs_once():
    with make_client(ScriptedEngine(SCRIPT), reasoning=QWEN3) as client:
        body = {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 1, "n": 2}
        r = client.post("/v1/chat/completions", json=body)
        per_choice = {0: [], 1: []}
        for line in r.text.split("\n\n"):
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: "):])["choices"]:
                    if choice.get("logprobs"):
                        per_choice[choice["index"]] += [e["token"] for e in choice["logprobs"]["content"]]
        assert per_choice == {0: list(SCRIPT), 1: list(SCRIPT)}
