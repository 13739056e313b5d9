"""Tool calling: the tools in the prompt, the grammar that forces a call, the calls parsed back.

Three output formats, picked from the chat template:
- ``hermes`` (Hermes, Qwen 2.5: templates that write ``<tool_call>``): one
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call;
- ``llama3`` (templates that take ``tools`` otherwise, e.g. Llama 3.1): a bare
  ``{"name": ..., "parameters": {...}}`` object;
- ``smollm2`` (templates that ignore ``tools``, SmolLM2's among them): the tools
  go into the system message in SmolLM2's function-calling prompt and the model
  answers ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.
The parser reads all three, so a model that answers in a neighbouring format
still yields its calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pipeserve.structured.grammar import JSON_LAYOUT

FORMATS = ("hermes", "llama3", "smollm2")
_TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                    # JSON text, as the OpenAI API carries it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def check_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` -> the list of their ``function`` objects; ``ValueError`` names the problem."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             "'parameters': {...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    return functions


def choice_mode(tool_choice: Any, functions: list[dict]) -> str:
    """``"none" | "auto" | "required"`` or the name of the forced function."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    if name not in {f["name"] for f in functions}:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return name


def template_format(chat_template: str | None) -> str:
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "tools" in template:
        return "llama3"
    return "smollm2"


# -- the grammar that forces a call -------------------------------------------------------------
def forced_call_grammar(functions: list[dict], mode: str, fmt: str) -> str:
    """Lark grammar (llguidance) for ``required`` or a named function: the output is one or
    more calls of the allowed functions, their arguments valid against each parameters schema."""
    allowed = functions if mode == "required" else [f for f in functions if f["name"] == mode]
    key = "parameters" if fmt == "llama3" else "arguments"
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                       "required": ["name", key], "additionalProperties": False} for f in allowed]}
    one = {**call, "x-guidance": JSON_LAYOUT}
    if fmt == "llama3":
        return f"start: %json {json.dumps(one)}"
    if fmt == "hermes":
        return f'start: ("<tool_call>\\n" %json {json.dumps(one)} "\\n</tool_call>")+'
    many = {"type": "array", "items": call, "minItems": 1, "x-guidance": JSON_LAYOUT}
    return f'start: "<tool_call>" %json {json.dumps(many)} "</tool_call>"'


# -- the prompt ---------------------------------------------------------------------------------
def smollm2_system_prompt(functions: list[dict]) -> str:
    """SmolLM2's function-calling system prompt (its format: tools in ``<tools>``, calls as a
    JSON list in ``<tool_call>``)."""
    tools = json.dumps([{"name": f["name"], "description": f["description"], "parameters": f["parameters"]}
                        for f in functions])
    return ("You are an expert in composing functions. You are given a question and a set of possible "
            "functions. Based on the question, you will need to make one or more function/tool calls to "
            "achieve the purpose. If none of the functions can be used, say so and answer normally.\n\n"
            f"You have access to the following tools:\n<tools>{tools}</tools>\n\n"
            "To call tools, answer only with a list of calls in this format:\n"
            '<tool_call>[{"name": "func_name", "arguments": {"argument1": "value1"}}]</tool_call>')


def calls_as_text(tool_calls: list[dict], fmt: str) -> str:
    """An assistant message's ``tool_calls`` in the model's own output format."""
    calls = [{"name": c["function"]["name"], "arguments": arguments_value(c["function"].get("arguments"))}
             for c in tool_calls]
    if fmt == "llama3":
        return "".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    return f"<tool_call>{json.dumps(calls)}</tool_call>"


def arguments_value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}


# -- the answer ---------------------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls or None, the calls) of a model answer in any of the formats."""
    bodies = _TAG.findall(text)
    if bodies:
        rest = _TAG.sub("", text).strip()
    else:
        stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not stripped.startswith(("{", "[")):
            return text, []
        bodies, rest = [stripped], ""
    calls = [call for body in bodies for call in _calls_in(body)]
    if not calls:
        return text, []
    return rest or None, calls


def _calls_in(body: str) -> list[ToolCall]:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(item["name"], args if isinstance(args, str) else json.dumps(args),
                              id=f"call_{uuid.uuid4().hex[:24]}"))
    return calls


def may_become_tool_call(text: str) -> bool:
    """While True, a streamed answer is held back: it may still turn out to be a call."""
    head = text.lstrip()
    if not head:
        return True
    for marker in ("<tool_call>", _PYTHON_TAG, "{", "["):
        if head.startswith(marker) or marker.startswith(head):
            return True
    return False
