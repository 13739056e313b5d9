"""Tokens in, text and ``RequestOutput``s out: detokenization, stop checks, logprobs, timings.

Keeps no state of its own: a sequence's text lives on the ``Sequence``, the
request's timestamps on its ``SequenceGroup``.
"""

from __future__ import annotations

import time

from pipeserve.engine.detokenizer import IncrementalDetokenizer
from pipeserve.engine.stop import check_stop, streamable_length
from pipeserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pipeserve.sequence import Sequence, SequenceGroup
from pipeserve.worker.step import SampledToken


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def add(self, group: SequenceGroup) -> None:
        """Give each sequence of a new request its detokenizer (and logprob list if asked)."""
        skip = group.params.skip_special_tokens
        for seq in group.seqs:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, skip)
            seq.output_logprobs = [] if group.params.logprobs is not None else None

    def on_token(self, group: SequenceGroup, seq: Sequence, tok: SampledToken) -> str | None:
        """Account for the token just appended to ``seq``; returns a finish reason or None."""
        now = time.time()
        group.first_token_time = group.first_token_time or now
        group.last_token_time = now
        delta = seq.detokenizer.step([tok.token_id])
        seq.output_text += delta
        seq.cumulative_logprob += tok.logprob
        if seq.output_logprobs is not None:
            seq.output_logprobs.append(self._logprob_entry(tok))
        decision = check_stop(seq.params, token_id=tok.token_id, num_output_tokens=seq.num_output_tokens,
                              text=seq.output_text, num_new_chars=len(delta), num_tokens=seq.num_tokens,
                              max_model_len=self.max_model_len)
        if decision is None:
            return None
        if decision.finish_reason == "length" and decision.truncate_to is None:
            seq.output_text += seq.detokenizer.flush()
        if decision.truncate_to is not None:
            seq.output_text = seq.output_text[:decision.truncate_to]
        seq.stop_reason = decision.stop_reason
        return decision.finish_reason

    def _logprob_entry(self, tok: SampledToken) -> dict[int, Logprob]:
        entry = {tid: Logprob(lp, rank=r + 1, decoded_token=self._decode_one(tid))
                 for r, (tid, lp) in enumerate(tok.top_logprobs)}
        if tok.token_id not in entry:
            entry[tok.token_id] = Logprob(tok.logprob, rank=None, decoded_token=self._decode_one(tok.token_id))
        return entry

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- outputs -----------------------------------------------------------
    def request_output(self, group: SequenceGroup) -> RequestOutput:
        """The request so far; unfinished text holds back a tail that may become a stop string."""
        outputs = [self._completion(seq) for seq in group.seqs]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=outputs, finished=group.is_finished, metrics=_metrics(group),
            num_cached_tokens=max((s.num_cached_tokens for s in group.seqs), default=0), error=group.error)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = seq.output_text
        if not seq.is_finished:
            text = text[:streamable_length(text, seq.params.stop)]
        return CompletionOutput(index=seq.index, text=text, token_ids=seq.output_token_ids,
                                logprobs=seq.output_logprobs, finish_reason=seq.finish_reason,
                                stop_reason=seq.stop_reason,
                                cumulative_logprob=None if seq.output_logprobs is None else seq.cumulative_logprob)

    def finish(self, group: SequenceGroup, reason: str | None, error: str | None = None) -> RequestOutput:
        """Final output of a request; ``reason`` marks sequences not yet finished (abort, error)."""
        for seq in group.seqs:
            if seq.finish_reason is None and reason is not None:
                seq.finish_reason = reason
        group.error = group.error or error
        group.finished_time = time.time()
        out = self.request_output(group)
        out.finished = True
        return out


def _metrics(group: SequenceGroup) -> RequestMetrics:
    return RequestMetrics(arrival_time=group.arrival_time, first_scheduled_time=group.first_scheduled_time,
                          first_token_time=group.first_token_time, last_token_time=group.last_token_time,
                          finished_time=group.finished_time)
