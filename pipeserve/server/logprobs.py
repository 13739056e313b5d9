"""Token logprobs in the two shapes of the OpenAI API (completions and chat)."""

from __future__ import annotations

from collections.abc import Callable

from pipeserve.outputs import CompletionOutput, Logprob

Decode = Callable[[int], str]


def completion_logprobs(out: CompletionOutput, start: int, end: int, decode: Decode,
                        text_offset: int) -> dict | None:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for tokens [start, end)."""
    if out.logprobs is None:
        return None
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(out.token_ids[start:end], out.logprobs[start:end]):
        text = _text(token_id, entry.get(token_id), decode)
        result["tokens"].append(text)
        result["token_logprobs"].append(_value(entry.get(token_id)))
        result["top_logprobs"].append({_text(t, lp, decode): _value(lp) for t, lp in _ranked(entry)})
        result["text_offset"].append(text_offset)
        text_offset += len(text)
    return result


def chat_logprobs(out: CompletionOutput, start: int, end: int, decode: Decode,
                  top_n: int) -> dict | None:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
    if out.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(out.token_ids[start:end], out.logprobs[start:end]):
        item = _chat_token(token_id, entry.get(token_id), decode)
        item["top_logprobs"] = [_chat_token(t, lp, decode) for t, lp in _ranked(entry)[:top_n]]
        content.append(item)
    return {"content": content}


def _chat_token(token_id: int, lp: Logprob | None, decode: Decode) -> dict:
    text = _text(token_id, lp, decode)
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def _text(token_id: int, lp: Logprob | None, decode: Decode) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode(token_id)


# JSON has no -inf: a masked-out token reports this floor instead, as vLLM does.
_FLOOR = -9999.0


def _value(lp: Logprob | None) -> float:
    if lp is None or lp.logprob != lp.logprob:  # missing, or NaN
        return _FLOOR
    return max(_FLOOR, float(lp.logprob))
