"""The driver's grammar matchers: one per constrained sequence, advanced as its tokens come back.

The mask for a sequence's next token is computed as soon as its last token
returns, while the other micro-batches are in the stages, and travels with the
next step as a packed bitmask (``ceil(vocab / 32)`` int32 words, bit ``t % 32``
of word ``t // 32`` set when token ``t`` is allowed). Unconstrained sequences
have no matcher and no mask: they cost nothing here or on the last stage.
"""

from __future__ import annotations

import logging

import torch

from pipeserve.sequence import Sequence
from pipeserve.structured.grammar import grammar_of

logger = logging.getLogger(__name__)


class Guides:
    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None          # built on the first constrained request (~0.3 s)
        self._matchers: dict[int, object] = {}
        self._masks: dict[int, torch.Tensor] = {}   # seq_id -> [ceil(vocab/32)] int32

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    def start(self, seq: Sequence) -> None:
        """Give ``seq`` a matcher (it has generated nothing yet) and its first mask."""
        spec = seq.params.structured_outputs
        if spec is None:
            return
        from llguidance import LLMatcher
        matcher = LLMatcher(self._tokenizer(), grammar_of(spec))
        if matcher.is_error():
            raise ValueError(f"the grammar could not start: {matcher.get_error()}")
        self._matchers[seq.seq_id] = matcher
        self._masks[seq.seq_id] = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self._fill(seq.seq_id)

    def advance(self, seq: Sequence, token_id: int) -> bool:
        """Feed the token just sampled; compute the next mask. False if the grammar
        refused the token (only possible when every allowed token was banned)."""
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            return True
        if not matcher.consume_token(token_id):
            logger.warning("seq %d: the grammar refused token %d: %s", seq.seq_id, token_id,
                           matcher.get_error())
            return False
        self._fill(seq.seq_id)
        return True

    def mask(self, seq_id: int) -> bytes | None:
        """The packed mask as the step carries it (``SeqSampling.allowed_token_mask``)."""
        mask = self._masks.get(seq_id)
        return None if mask is None else mask.numpy().tobytes()

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
        self._masks.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def _fill(self, seq_id: int) -> None:
        # What llguidance.torch.fill_next_token_bitmask does, without importing that module
        # (it pulls in torch.jit scripting): the matcher writes the words into our buffer.
        mask = self._masks[seq_id]                       # [ceil(vocab/32)] int32, contiguous
        self._matchers[seq_id].unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
