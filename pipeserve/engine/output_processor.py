"""Tokens in, text and ``RequestOutput``s out: detokenization, stop checks, logprobs, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeserve.engine.detokenizer import IncrementalDetokenizer
from pipeserve.engine.stop import check_stop, streamable_length
from pipeserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pipeserve.sequence import Sequence, SequenceGroup
from pipeserve.worker.step import SampledToken


@dataclass
class _SeqText:
    detok: IncrementalDetokenizer
    text: str = ""                       # the output text (cut at a stop string once finished)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finished: bool = False


@dataclass
class _Request:
    seqs: dict[int, _SeqText] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._requests: dict[str, _Request] = {}

    def add(self, group: SequenceGroup) -> None:
        skip = group.params.skip_special_tokens
        want_logprobs = group.params.logprobs is not None
        self._requests[group.request_id] = _Request({
            seq.seq_id: _SeqText(IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, skip),
                                 logprobs=[] if want_logprobs else None)
            for seq in group.seqs})

    def on_token(self, group: SequenceGroup, seq: Sequence, tok: SampledToken) -> str | None:
        """Account for the token just appended to ``seq``; returns a finish reason or None."""
        now = time.time()
        group.first_token_time = group.first_token_time or now
        group.last_token_time = now
        state = self._requests[group.request_id].seqs[seq.seq_id]
        delta = state.detok.step([tok.token_id])
        state.text += delta
        state.cumulative_logprob += tok.logprob
        if state.logprobs is not None:
            state.logprobs.append(self._logprob_entry(tok))
        decision = check_stop(seq.params, token_id=tok.token_id, num_output_tokens=seq.num_output_tokens,
                              text=state.text, num_new_chars=len(delta), num_tokens=seq.num_tokens,
                              max_model_len=self.max_model_len)
        if decision is None:
            return None
        if decision.finish_reason == "length" and decision.truncate_to is None:
            state.text += state.detok.flush()
        if decision.truncate_to is not None:
            state.text = state.text[:decision.truncate_to]
        seq.stop_reason = decision.stop_reason
        state.finished = True
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
        request = self._requests[group.request_id]
        outputs = [self._completion(seq, request.seqs[seq.seq_id]) for seq in group.seqs]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=outputs, finished=group.is_finished, metrics=_metrics(group),
            num_cached_tokens=max((s.num_cached_tokens for s in group.seqs), default=0), error=group.error)

    def _completion(self, seq: Sequence, state: _SeqText) -> CompletionOutput:
        text = state.text
        if not seq.is_finished:
            text = text[:streamable_length(text, seq.params.stop)]
        return CompletionOutput(index=seq.index, text=text, token_ids=seq.output_token_ids,
                                logprobs=state.logprobs, finish_reason=seq.finish_reason,
                                stop_reason=seq.stop_reason,
                                cumulative_logprob=None if state.logprobs is None else state.cumulative_logprob)

    def finish(self, group: SequenceGroup, reason: str | None, error: str | None = None) -> RequestOutput:
        """Final output of a request; ``reason`` marks sequences not yet finished (abort, error)."""
        for seq in group.seqs:
            if seq.finish_reason is None and reason is not None:
                seq.finish_reason = reason
        group.error = group.error or error
        group.finished_time = time.time()
        out = self.request_output(group)
        out.finished = True
        del self._requests[group.request_id]
        return out


def _metrics(group: SequenceGroup) -> RequestMetrics:
    return RequestMetrics(arrival_time=group.arrival_time, first_scheduled_time=group.first_scheduled_time,
                          first_token_time=group.first_token_time, last_token_time=group.last_token_time,
                          finished_time=group.finished_time)
