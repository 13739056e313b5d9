"""Incremental detokenization: output token ids in, stable text deltas out.

Decoding one token at a time is wrong for two reasons: a token may hold only
part of a multi-byte UTF-8 character (it decodes to U+FFFD until the rest
arrives), and some tokenizers change a token's text by its neighbours (the
leading space a SentencePiece decoder strips at the start of a string). So we
use the prefix/read offset method: each step decodes a short window of ids
twice, ``ids[prefix:read]`` (text already emitted) and ``ids[prefix:]`` (that
plus the new ids), and emits only the difference. Text that ends in U+FFFD is
held back (offsets do not move) until the character completes.

Windows are decoded with the tokenizer's own ``decode``, so special tokens are
kept or dropped exactly as ``decode(..., skip_special_tokens=...)`` would.
The window starts with the last few prompt ids, so the first output token
decodes in context (its leading space survives).

Duck-typed tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
"""

from __future__ import annotations

from typing import Protocol

# How many already-emitted ids the window keeps as context before the read offset.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Stable text of one output stream, delta by delta.

    ``step(new_ids)`` returns the newly stable text; ``"".join`` of all deltas
    equals ``text``, which equals ``tokenizer.decode(token_ids,
    skip_special_tokens=...)`` for valid text. Text still incomplete at the
    end (a model that stopped mid-character) comes out with ``flush()``.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context          # context + output ids
        self._prefix_offset = 0                 # window start in _ids
        self._read_offset = len(context)        # ids up to here are emitted as text
        self._num_context = len(context)
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """The output ids so far (the prompt context excluded)."""
        return self._ids[self._num_context:]

    def step(self, new_token_ids: list[int]) -> str:
        """Add output ids; return the text they make stable (may be "")."""
        self._ids.extend(new_token_ids)
        emitted = self._decode(self._ids[self._prefix_offset:self._read_offset])
        current = self._decode(self._ids[self._prefix_offset:])
        if len(current) <= len(emitted) or current.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = current[len(emitted):]
        self._advance()
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back, replacement characters included; for
        the end of a stream, where no further id can complete it."""
        emitted = self._decode(self._ids[self._prefix_offset:self._read_offset])
        current = self._decode(self._ids[self._prefix_offset:])
        delta = current[len(emitted):] if len(current) > len(emitted) else ""
        self._advance()
        self.text += delta
        return delta

    def _advance(self) -> None:
        # Keep a few emitted ids as context for the next window, not the whole stream.
        self._prefix_offset = max(self._read_offset, len(self._ids) - _CONTEXT_TOKENS)
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
