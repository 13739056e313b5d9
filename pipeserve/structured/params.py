"""What a request constrains its output to, shaped like vLLM's ``StructuredOutputsParams``.

    SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    SamplingParams(guided_decoding=GuidedDecodingParams(regex=r"\\d+"))   # vLLM's older name

Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` (Lark syntax, as
llguidance and vLLM's guidance backend read it) or ``json_object`` is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None            # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None                # Lark grammar (``start:`` rule)
    json_object: bool | None = None           # any JSON object
    # JSON only: a regex for the whitespace allowed between tokens (default: none, one line).
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.whitespace_pattern is not None and given[0] not in ("json", "json_object"):
            raise ValueError("StructuredOutputsParams.whitespace_pattern applies to json and json_object only")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c
                                                                   for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> dict | None:
        """The JSON schema as a dict (``json`` given as text is parsed)."""
        if self.json is None:
            return None
        if isinstance(self.json, dict):
            return self.json
        try:
            value = json.loads(self.json)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("the JSON schema must be a JSON object")
        return value

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> "StructuredOutputsParams":
        fields = set(_KINDS) | {"whitespace_pattern"}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**value)


# vLLM's name before v0.12 for the same object.
GuidedDecodingParams = StructuredOutputsParams
