"""Structured outputs and tool calling through ``pipeserve serve -pp 2`` on SmolLM2-135M-Instruct,
driven by the official ``openai`` client. One server for the whole module."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
ARGS = ["-pp", "2", "--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--threads-per-stage", "1",
        "--seed", "0"]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "doctor", "artist", "teacher"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "role", "address", "skills"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "status": {"enum": ["open", "shipped", "closed"]},
    "items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "express": {"type": "boolean"}},
    "required": ["id", "status", "items"], "additionalProperties": False}
TOPICS = ["a nurse", "a painter", "a chef", "a pilot", "a farmer"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("structured") / "server.log"
    cmd = [sys.executable, "-m", "pipeserve.entrypoints.cli", "serve", "--model", MODEL, "--port", str(port),
           *ARGS]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"the server was not healthy within 180 s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def _async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


# -- JSON schema ----------------------------------------------------------------------------------
def _json_jobs() -> list[tuple[dict, list[dict]]]:
    jobs = [(PERSON, [{"role": "user", "content": f"Describe {t} as a JSON person record."}]) for t in TOPICS]
    jobs += [(ORDER, [{"role": "user", "content": f"Write order number {i} for {t} as JSON."}])
             for i, t in enumerate(TOPICS)]
    return jobs


async def _json_answer(client: openai.AsyncOpenAI, schema: dict, messages: list[dict], stream: bool) -> tuple:
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
    args = dict(model=MODEL, messages=messages, max_tokens=160, temperature=0.7, seed=len(messages[0]["content"]),
                response_format=fmt)
    if not stream:
        r = await client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish


def test_json_schema_outputs_validate_streaming_and_not(url):
    """10 prompts (nested objects, arrays, enums, required fields), each whole and streamed, all at once."""
    async def run():
        client = _async_client(url)
        jobs = _json_jobs()
        return jobs, await asyncio.gather(*[_json_answer(client, schema, messages, stream)
                                            for stream in (False, True) for schema, messages in jobs])

    jobs, answers = asyncio.run(run())
    assert len(jobs) == 10
    for (schema, messages), (text, finish) in zip(jobs * 2, answers):
        assert finish == "stop", (messages, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_on_completions_and_length_keeps_the_valid_prefix(url):
    client = _client(url)
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=60,
                                  temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    # A grammar that cannot finish in max_tokens: "length" and the prefix so far, no hang.
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person?"}],
                                       max_tokens=4, temperature=0,
                                       extra_body={"structured_outputs": {"json": PERSON}})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith('{"') and r.usage.completion_tokens == 4


# -- regex and choice -------------------------------------------------------------------------------
def test_regex_and_choice_hold_on_20_samples_at_temperature_1(url):
    client = _client(url)
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}-[0-9]{2}"
    r = client.completions.create(model=MODEL, prompt="A name and a date:", n=20, max_tokens=24, temperature=1.0,
                                  extra_body={"guided_regex": pattern})
    assert len(r.choices) == 20
    for c in r.choices:
        assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c.text
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(model=MODEL, n=20, max_tokens=8, temperature=1.0,
                                       messages=[{"role": "user", "content": "Sentiment of: I love it"}],
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert len(r.choices) == 20 and all(c.message.content in choices for c in r.choices)


# -- tools --------------------------------------------------------------------------------------------
def test_tool_round_trip_with_required_choice(url):
    client = _client(url)
    params = WEATHER_TOOL["function"]["parameters"]
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                       tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), params)

    # The same call streamed: the openai client assembles the tool_calls deltas.
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert streamed and streamed[0].function.name == "get_weather"
    jsonschema.validate(json.loads(streamed[0].function.arguments), params)

    # The tool's result goes back with its tool_call_id; the model answers in text.
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18,
                                                                                  "unit": "celsius"})}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=40,
                                       temperature=0)
    answer = r.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert r.usage.prompt_tokens > 100  # the tools, the call and its result are all in the prompt


# -- bad requests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
])
def test_bad_constraints_are_400_naming_the_problem(url, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        _client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, extra_body=extra)
    body = err.value.body
    assert body["param"] == param and words in body["message"] and body["type"] == "invalid_request_error"
