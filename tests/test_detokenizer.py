"""Incremental detokenization (real SmolLM2 tokenizer) and stop handling."""

from __future__ import annotations

import random

import pytest

from pipeserve.engine.detokenizer import IncrementalDetokenizer
from pipeserve.engine.stop import StopDecision, check_stop, streamable_length
from pipeserve.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world!",
    " leading space and  double  spaces",
    "   three leading spaces\n\nand blank lines\t tabs",
    "Café, naïve, façade, Ångström, über, jalapeño",
    "你好，世界！这是一个测试。",
    "日本語のテキストと한국어 텍스트",
    "Emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧 ✨ done",
    "Mixed: résumé 😀 中文 x² ≤ ∞ — “quotes” …",
    "def f(x):\n    return x ** 2  # square\n",
    "Ελληνικά και русский текст",
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    """transformers' tokenizer of the SmolLM2 GGUF, as pipeserve loads it."""
    return smollm2_tokenizer.hf_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")


def stream(tok, prompt: list[int], ids: list[int], skip: bool = True,
           chunks: list[int] | None = None) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``ids`` in chunks (default one id at a time); return the deltas."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.step(ids[i:i + size]))
        i += size
    return detok, deltas


def random_text(rng: random.Random) -> str:
    pool = ("abc xyz ", "  ", "\n", "é", "ñ", "ü", "ß", "中", "文", "字", "😀", "🚀", "👍🏽",
            "Ω", "∑", "—", ".", ",", "'s", " the", "!?", "한", "ا", "\u200d")
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))


# -- detokenizer ------------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
def test_real_texts_stream_to_the_full_decode(tok, prompt_ids, skip):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok, deltas = stream(tok, prompt_ids, ids, skip)
        assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip) == text
        assert all(REPLACEMENT not in d for d in deltas)
        assert detok.token_ids == ids


def test_random_texts_in_random_chunks(tok, prompt_ids):
    rng = random.Random(0)
    for _ in range(150):
        text = random_text(rng)
        ids = tok.encode(text, add_special_tokens=False)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 3))
        detok, deltas = stream(tok, prompt_ids[-rng.randint(0, 6):] if rng.random() < 0.8 else [],
                               ids, chunks=chunks)
        assert "".join(deltas) == tok.decode(ids) == text
        assert all(REPLACEMENT not in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tok, prompt_ids, skip):
    # <|im_end|> (2) and <repo_name> (3) are both special in this vocabulary.
    ids = tok.encode(" Hi 😀 there", add_special_tokens=False) + [2, 3] \
        + tok.encode("\nmore 中文", add_special_tokens=False) + [0]
    _, deltas = stream(tok, prompt_ids, ids, skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) != skip


def test_multibyte_character_is_held_until_complete(tok, prompt_ids):
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) >= 2, "the test needs an emoji split across tokens"
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert [detok.step([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == " 😀"


def test_first_token_keeps_its_leading_space(tok, prompt_ids):
    ids = tok.encode(" Hello there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert detok.step(ids[:1]) == " Hello"


def test_flush_releases_an_unfinished_character(tok, prompt_ids):
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-1]  # cut mid-emoji
    detok, deltas = stream(tok, prompt_ids, ids)
    tail = detok.flush()
    assert REPLACEMENT in tail and "".join(deltas) + tail == tok.decode(ids) == detok.text


# -- stop handling ----------------------------------------------------------

def run_until_stop(tok, prompt_ids, text: str, params: SamplingParams, max_model_len: int = 10_000
                   ) -> tuple[str, StopDecision | None, list[str], int]:
    """Drive detokenizer + check_stop like the engine: returns (final text,
    decision, streamed chunks, tokens used)."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, params.skip_special_tokens)
    out_text, streamed_upto, chunks = "", 0, []
    for n, token in enumerate(ids, start=1):
        delta = detok.step([token])
        out_text += delta
        decision = check_stop(params, token_id=token, num_output_tokens=n, text=out_text,
                              num_new_chars=len(delta), num_tokens=len(prompt_ids) + n,
                              max_model_len=max_model_len)
        if decision is not None and decision.truncate_to is not None:
            out_text = out_text[:decision.truncate_to]
        safe = len(out_text) if decision else streamable_length(out_text, params.stop)
        chunks.append(out_text[streamed_upto:safe])
        streamed_upto = max(streamed_upto, safe)
        if decision is not None:
            return out_text, decision, chunks, n
    return out_text, None, chunks, len(ids)


def test_stop_string_spanning_two_tokens(tok, prompt_ids):
    text = "Hello world. The end of it"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([t]) for t in ids]
    assert "." in pieces and " The" in pieces, pieces  # "d. T" crosses token boundaries
    final, decision, chunks, _ = run_until_stop(tok, prompt_ids, text, SamplingParams(stop=["d. T"]))
    assert final == "Hello worl" and "".join(chunks) == final
    assert decision == StopDecision("stop", "d. T", len("Hello worl"))
    final, _, chunks, _ = run_until_stop(
        tok, prompt_ids, text, SamplingParams(stop=["d. T"], include_stop_str_in_output=True))
    assert final == "Hello world. T" and "".join(chunks) == final


def test_stream_never_shows_a_partial_stop_string(tok, prompt_ids):
    text = "alpha beta STOP gamma"
    final, decision, chunks, _ = run_until_stop(tok, prompt_ids, text,
                                                SamplingParams(stop=["STOP", "zzz"], max_tokens=100))
    assert final == "alpha beta " and decision.stop_reason == "STOP"
    assert all("S" not in c for c in chunks) and "".join(chunks) == final


def test_earliest_stop_string_wins():
    params = SamplingParams(stop=["cd", "bc"])
    decision = check_stop(params, token_id=9, num_output_tokens=1, text="abcde", num_new_chars=5,
                          num_tokens=3, max_model_len=100)
    assert decision == StopDecision("stop", "bc", 1)


def test_streamable_length_holds_partial_matches():
    assert streamable_length("abc wor", ["world"]) == 4
    assert streamable_length("abc wor", ["world", "r!", "c wo"]) == 4
    assert streamable_length("abc wor", ["xyz"]) == 7
    assert streamable_length("abc", []) == 3
    assert streamable_length("ab", ["abcdef"]) == 0


def _check(params: SamplingParams, token: int, n: int, text: str = "x", new: int = 1,
           total: int | None = None, max_len: int = 1000) -> StopDecision | None:
    return check_stop(params, token_id=token, num_output_tokens=n, text=text, num_new_chars=new,
                      num_tokens=total if total is not None else 10 + n, max_model_len=max_len)


def test_eos_and_stop_token_ids():
    params = SamplingParams(stop_token_ids=[7], eos_token_ids=(2,), max_tokens=50)
    assert _check(params, 2, 3, text="ab<e>", new=3) == StopDecision("stop", None, 2)
    assert _check(params, 7, 3, text="abc", new=1) == StopDecision("stop", 7, 2)
    assert _check(params, 5, 3) is None
    keep = SamplingParams(eos_token_ids=(2,), include_stop_str_in_output=True)
    assert _check(keep, 2, 3, text="ab<e>", new=3) == StopDecision("stop", None, None)
    assert _check(params, 2, 3, text="ab", new=0) == StopDecision("stop", None, None)


def test_min_tokens_delays_stops_but_not_length():
    params = SamplingParams(stop=["x"], stop_token_ids=[7], eos_token_ids=(2,),
                            min_tokens=3, max_tokens=10)
    assert _check(params, 2, 2) is None
    assert _check(params, 7, 2) is None
    assert _check(params, 5, 2, text="x") is None
    assert _check(params, 2, 3) == StopDecision("stop", None, 0)
    assert _check(params, 5, 3, text="ax", new=1) == StopDecision("stop", "x", 1)
    # The model length is a hard limit, min_tokens or not.
    assert _check(params, 5, 2, total=64, max_len=64) == StopDecision("length")


def test_max_tokens_gives_length_unless_a_stop_comes_first():
    params = SamplingParams(max_tokens=4, eos_token_ids=(2,))
    assert _check(params, 5, 3) is None
    assert _check(params, 5, 4) == StopDecision("length")
    assert _check(params, 2, 4).finish_reason == "stop"
    assert _check(SamplingParams(max_tokens=None), 5, 500, total=900, max_len=900) == StopDecision("length")


def test_ignore_eos():
    params = SamplingParams(ignore_eos=True, eos_token_ids=(2,), stop_token_ids=[9], max_tokens=20)
    assert _check(params, 2, 5) is None
    assert _check(params, 9, 5) == StopDecision("stop", 9, 0)
    assert _check(params, 2, 20) == StopDecision("length")


def test_tokenizer_direct_decode_equals_the_wrappers(tok) -> None:
    """pipeserve's Tokenizer decodes through the Rust tokenizer directly (the driver pays
    a decode twice per token); the text must be the Hugging Face wrapper's, byte for byte."""
    from pipeserve.tokenizer import Tokenizer
    ours = Tokenizer(tok)
    assert ours._direct_decode is not None            # SmolLM2's fast tokenizer takes the direct path
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    windows = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    windows += [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))] + rng.sample(specials, 1)
                for _ in range(200)]
    for ids in windows:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)

    class Overridden(type(tok)):                       # a class that decodes its own way keeps it
        def decode(self, ids, skip_special_tokens=False, **kwargs):
            return "custom"
    tok_cls = tok.__class__
    try:
        tok.__class__ = Overridden
        assert Tokenizer(tok)._direct_decode is None and Tokenizer(tok).decode([1, 2]) == "custom"
    finally:
        tok.__class__ = tok_cls
