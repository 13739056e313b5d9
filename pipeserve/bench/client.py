"""One streaming request to an OpenAI-compatible ``/v1/completions``, timed token by token.

Works against pipeserve, vLLM and llama.cpp servers: it reads Server-Sent
Events, takes ``usage.completion_tokens`` when the server reports it
(``stream_options.include_usage``) and counts content chunks otherwise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from pipeserve.bench.stats import RequestRecord


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True

    def payload(self) -> dict:
        # ignore_eos is an extension (vLLM, llama.cpp, pipeserve) that keeps output lengths fixed.
        return {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "ignore_eos": self.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model_id(client: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> str:
    """The id of the first model the server lists under ``/v1/models``."""
    resp = await client.get(f"{base_url.rstrip('/')}/v1/models", headers=auth_headers(api_key))
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    return str(models[0]["id"])


async def send_completion(client: httpx.AsyncClient, base_url: str, request: CompletionRequest,
                          api_key: str | None = None, run_start: float = 0.0) -> RequestRecord:
    """Send one request and time it; a failure is recorded, never raised."""
    record = RequestRecord(prompt_len=request.prompt_len)
    url = f"{base_url.rstrip('/')}/v1/completions"
    start = time.perf_counter()
    record.start_time = start - run_start
    try:
        async with client.stream("POST", url, json=request.payload(), headers=auth_headers(api_key)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                return _failed(record, f"HTTP {resp.status_code}: {body}")
            await _read_stream(resp, record, start)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        return _failed(record, f"{type(exc).__name__}: {exc}")
    if record.output_len == 0:
        return _failed(record, record.error or "the stream carried no token")
    return record


async def _read_stream(resp: httpx.Response, record: RequestRecord, start: float) -> None:
    last = None
    chunks = 0
    usage_tokens = None
    async for line in resp.aiter_lines():
        data = _sse_data(line)
        if data is None:
            continue
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("error"):
            record.error = str(event["error"])
            break
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens", usage_tokens)
        choices = event.get("choices") or []
        if not choices or not choices[0].get("text"):
            continue
        now = time.perf_counter()
        if last is None:
            record.ttft = now - start
        else:
            record.itl.append(now - last)
        last = now
        chunks += 1
    record.e2el = (last if last is not None else time.perf_counter()) - start
    record.output_len = usage_tokens if usage_tokens is not None else chunks
    if record.error:
        record.success = False


def _sse_data(line: str) -> str | None:
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def _failed(record: RequestRecord, message: str) -> RequestRecord:
    record.success = False
    record.error = message
    return record
