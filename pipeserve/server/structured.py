"""The request fields that constrain the output, as one ``StructuredOutputsParams`` (or a 400).

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's current
``structured_outputs`` object and its older ``guided_json`` / ``guided_regex``
/ ``guided_choice`` / ``guided_grammar`` fields; at most one may be given.
"""

from __future__ import annotations

from typing import Any

from pipeserve.server.errors import APIError
from pipeserve.structured.grammar import grammar_of
from pipeserve.structured.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """Read and compile the constraint of ``body`` (a request model); 400 names the field."""
    given = [(name, value) for name, value in _sources(body) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"give one output constraint, got {', '.join(n for n, _ in given)}",
                       param=given[1][0])
    param, value = given[0]
    try:
        spec = _spec(param, value)
        if spec is not None:
            grammar_of(spec)  # a bad schema, regex or grammar is refused here, not in the engine
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return spec


def _sources(body: Any) -> list[tuple[str, Any]]:
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") == "text":
        fmt = None
    return [("response_format", fmt), ("structured_outputs", body.structured_outputs)] + \
        [(name, getattr(body, name)) for name in _GUIDED]


def _spec(param: str, value: Any) -> StructuredOutputsParams | None:
    if param == "response_format":
        return _response_format(value)
    if param == "structured_outputs":
        if not isinstance(value, dict):
            raise ValueError("must be an object such as {'json': schema} or {'regex': pattern}")
        return StructuredOutputsParams.from_dict(value)
    return StructuredOutputsParams(**{_GUIDED[param]: value})


def _response_format(value: dict) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    body = value.get("json_schema")
    schema = body.get("schema", body.get("json_schema")) if isinstance(body, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("json_schema needs {'name': ..., 'schema': {...}}")
    return StructuredOutputsParams(json=schema)
