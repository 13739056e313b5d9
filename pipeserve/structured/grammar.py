"""A ``StructuredOutputsParams`` as an llguidance grammar, checked before it reaches the engine."""

from __future__ import annotations

import json

from pipeserve.structured.params import StructuredOutputsParams


# JSON on one line, ", " and ": " between items (a schema's own "x-guidance" overrides it).
# Free whitespace lets a small model spend its max_tokens on newlines and indentation.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(spec: StructuredOutputsParams) -> str:
    """llguidance's serialised grammar for ``spec``. Raises ``ValueError`` naming the problem
    (an invalid schema, regex or grammar) so the API can answer 400."""
    from llguidance import LLMatcher  # imported where a constrained request appears

    kind = spec.kind
    layout = JSON_LAYOUT
    if spec.whitespace_pattern is not None:
        layout = {**JSON_LAYOUT, "whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
    if kind == "json":
        grammar = LLMatcher.grammar_from_json_schema(spec.schema(), defaults=layout)
    elif kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=layout)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(spec.regex)
    elif kind == "choice":
        # JSON string literals are Lark string literals, escapes included.
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    else:
        grammar = LLMatcher.grammar_from_lark(spec.grammar)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {_NAMES[kind]}: {error.strip()}")
    return grammar


_NAMES = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
          "choice": "choice", "grammar": "grammar (Lark syntax)"}
