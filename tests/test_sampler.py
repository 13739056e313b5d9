"""Sampler: greedy, seeded reproducibility, distributions, truncation, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pipeserve.sampling.filters import apply_min_p, apply_top_k, apply_top_p
from pipeserve.sampling.inputs import SeqSampling
from pipeserve.sampling.penalties import apply_penalties
from pipeserve.sampling.sampler import Sampler, argmax
from tests.kernels import skip_without_kernel


def sp(**kw) -> SeqSampling:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)
    base.update(kw)
    return SeqSampling(**base)


def tokens(results) -> list[int]:
    return [r[0] for r in results]


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 300, generator=g) * 2.0


def test_greedy_is_argmax(logits):
    out = Sampler(0).sample(logits, [sp(temperature=0.0)] * 8)
    assert tokens(out) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5, 50.0])
def test_top_k_one_is_greedy_at_any_temperature(logits, temperature):
    out = Sampler(0).sample(logits, [sp(temperature=temperature, top_k=1)] * 8)
    assert tokens(out) == logits.argmax(-1).tolist()


def test_bad_shape_is_rejected(logits):
    with pytest.raises(ValueError, match="len\\(params\\)"):
        Sampler(0).sample(logits, [sp()] * 3)


# -- seeded reproducibility -------------------------------------------------

def _seeded_tokens(sampler: Sampler, row: torch.Tensor, seed: int, steps: int,
                   mates: torch.Tensor | None = None, position: int = 0) -> list[int]:
    """Sample ``steps`` tokens for one seeded row, optionally among batch mates."""
    out = []
    for step in range(steps):
        if mates is None:
            batch, params, where = row[None], [sp(seed=seed, step_index=step)], 0
        else:
            mate_params = [sp(temperature=0.7 + 0.1 * i, seed=(None if i % 2 else 1000 + i),
                              step_index=step * 3 + i, top_k=5 * i) for i in range(len(mates))]
            batch = torch.cat([mates[:position], row[None], mates[position:]])
            params = mate_params[:position] + [sp(seed=seed, step_index=step)] + mate_params[position:]
            where = position
        out.append(sampler.sample(batch, params)[where][0])
    return out


def test_seeded_rows_ignore_batch_mates_position_and_sampler(logits):
    row = torch.zeros(300)  # a flat distribution: every draw matters
    alone = _seeded_tokens(Sampler(0), row, seed=42, steps=12)
    for position in (0, 3, 7):
        mixed = _seeded_tokens(Sampler(position + 9), row, seed=42, steps=12,
                               mates=logits[:7], position=position)
        assert mixed == alone
    assert len(set(alone)) > 1  # the stream really is random across steps


def test_different_seeds_give_different_streams():
    row = torch.zeros(300)
    streams = {tuple(_seeded_tokens(Sampler(0), row, seed=s, steps=10)) for s in range(5)}
    assert len(streams) == 5


def test_unseeded_rows_follow_the_engine_generator(logits):
    params = [sp()] * 8
    assert Sampler(3).sample(logits, params) == Sampler(3).sample(logits, params)


# -- distributions ----------------------------------------------------------

def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Critical value of chi-square with 4 degrees of freedom at p = 0.001.
_CHI2_DF4_P001 = 18.47


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_frequencies(temperature):
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 20000
    out = Sampler(7).sample(base.expand(n, 5).contiguous(), [sp(temperature=temperature)] * n)
    counts = torch.bincount(torch.tensor(tokens(out)), minlength=5).float()
    assert _chi_square(counts, torch.softmax(base / temperature, -1)) < _CHI2_DF4_P001


def test_seeded_draws_match_softmax_frequencies():
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 20000
    params = [sp(temperature=0.8, seed=s, step_index=s % 7) for s in range(n)]
    out = Sampler(0).sample(base.expand(n, 5).contiguous(), params)
    counts = torch.bincount(torch.tensor(tokens(out)), minlength=5).float()
    assert _chi_square(counts, torch.softmax(base / 0.8, -1)) < _CHI2_DF4_P001


# -- truncation -------------------------------------------------------------

def _ref_allowed(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Allowed tokens per vLLM's definitions, by a plain full sort."""
    probs = torch.softmax(row, -1)
    allowed = set(range(len(row)))
    if min_p > 0:
        allowed = {i for i in allowed if probs[i] >= min_p * probs.max()}
    order = sorted(allowed, key=lambda i: -float(row[i]))
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        kept_probs = torch.softmax(row[order], -1).tolist()
        kept, mass = [], 0.0
        for i, q in zip(order, kept_probs):
            if mass >= top_p:
                break
            kept.append(i)
            mass += q
        order = kept
    return set(order)


@pytest.mark.parametrize("top_k,top_p,min_p", [
    (10, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.1), (20, 0.8, 0.0), (0, 0.9, 0.02), (15, 0.5, 0.05),
])
def test_truncation_never_leaves_the_allowed_set(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(top_k * 7 + int(top_p * 100) + int(min_p * 1000))
    rows = torch.randn(4, 60, generator=g) * 1.5
    n = 1500
    for r in range(4):
        allowed = _ref_allowed(rows[r], top_k, top_p, min_p)
        batch = rows[r].expand(n, 60).contiguous()
        got = set(tokens(Sampler(r).sample(batch, [sp(top_k=top_k, top_p=top_p, min_p=min_p)] * n)))
        assert got <= allowed
        # And nothing likely was cut: every allowed token with >= 2% mass shows up.
        probs = torch.softmax(rows[r], -1)
        mass = float(probs[list(allowed)].sum())
        assert {i for i in allowed if probs[i] / mass >= 0.02} <= got


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_mask_matches_full_sort_for_wide_nuclei(top_p):
    # Flat-ish rows over 6000 tokens: nuclei of hundreds to thousands of tokens
    # exercise every candidate stage, including the full-sort fallback.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6000, generator=g) * torch.tensor([[0.2], [1.0], [3.0]])
    masked = x.clone()
    apply_top_p(masked, [top_p] * 3)
    for r in range(3):
        assert set(torch.isfinite(masked[r]).nonzero().flatten().tolist()) == _ref_allowed(x[r], 0, top_p, 0.0)


def test_top_k_and_min_p_masks():
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    k = x.clone()
    apply_top_k(k, [2, 0])
    assert torch.isfinite(k).tolist() == [[True, False, True, False], [True, True, True, True]]
    m = x.clone()
    apply_min_p(m, [0.0, math.exp(-1.5)])  # keeps logits >= 5 - 1.5
    assert torch.isfinite(m).tolist() == [[True, True, True, True], [False, False, True, True]]


# -- penalties and bans -----------------------------------------------------

def test_penalties_match_hand_computation():
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    x = raw.clone()
    params = [sp(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                 prompt_token_ids=[0, 1], output_token_ids=[3, 3, 4]),
              sp()]  # no penalty: row untouched
    apply_penalties(x, params)
    # 0,1 seen in the prompt: repetition only. 3 (twice), 4 (once) in the output: all three.
    expected = [1.0, -2.0, 0.5, 3.0 / 2 - 0.5 * 2 - 0.25, -2.0 * 2 - 0.5 - 0.25, 0.0]
    assert x[0].tolist() == pytest.approx(expected)
    assert torch.equal(x[1], raw[1])


def test_penalties_steer_greedy_but_logprobs_stay_raw():
    raw = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    out = Sampler(0).sample(raw, [sp(temperature=0.0, frequency_penalty=1.0, num_logprobs=0,
                                     prompt_token_ids=[], output_token_ids=[0])])
    token, logprob, _ = out[0]
    assert token == 1
    assert logprob == pytest.approx(float(torch.log_softmax(raw[0], -1)[1]), abs=1e-6)


def test_banned_ids_are_never_sampled():
    row = torch.tensor([10.0, 9.0, 0.0, 0.0, 8.0])
    n = 3000
    params = [sp(temperature=3.0, banned_token_ids=[0, 1], seed=i) for i in range(n)]
    got = set(tokens(Sampler(0).sample(row.expand(n, 5).contiguous(), params)))
    assert got.isdisjoint({0, 1}) and 4 in got
    greedy = Sampler(0).sample(row[None], [sp(temperature=0.0, banned_token_ids=[0, 99])])
    assert greedy[0][0] == 1  # an id outside the vocabulary is ignored


def test_logit_bias_shifts_the_choice_before_penalties_and_logprobs_stay_raw():
    raw = torch.tensor([[3.0, 2.9, 0.0, -1.0], [3.0, 2.9, 0.0, -1.0]])
    params = [sp(temperature=0.0, num_logprobs=0, logit_bias=[(3, 5.0)]),
              sp(temperature=0.0, logit_bias=[(0, -100.0), (99, 50.0)])]   # 99: outside, skipped
    out = Sampler(0).sample(raw.clone(), params)
    assert tokens(out) == [3, 1]
    assert out[0][1] == pytest.approx(float(torch.log_softmax(raw[0], -1)[3]), abs=1e-6)
    # Before the penalties, as vLLM: token 0 biased to 4.0, then its repetition penalty halves it.
    rep = sp(temperature=0.0, logit_bias=[(0, 1.0)], repetition_penalty=2.0, prompt_token_ids=[0],
             output_token_ids=[])
    assert tokens(Sampler(0).sample(torch.tensor([[3.0, 2.9, 0.0, -1.0]]), [rep])) == [1]
    n = 2000
    row = torch.tensor([5.0, 0.0, 0.0])
    drawn = tokens(Sampler(0).sample(row.expand(n, 3).contiguous(),
                                     [sp(logit_bias=[(2, 10.0)], seed=i) for i in range(n)]))
    assert drawn.count(2) > 0.95 * n


def test_logit_bias_is_checked_where_it_enters():
    from pipeserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams
    assert SamplingParams(logit_bias={5: -100, 6: 2.5}).logit_bias == {5: -100, 6: 2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad, match in [({-1: 1.0}, "non-negative"), ({"5": 1.0}, "token ids"), ({5: 101.0}, r"\[-100, 100\]"),
                       ({5: True}, "numbers"), ([(5, 1.0)], "map token ids"),
                       ({t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}, "at most")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(logit_bias=bad)


# -- logprobs ---------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_ordered_top_n(logits):
    params = [sp(temperature=0.6, top_k=20, num_logprobs=i % 4 if i % 4 else None,
                 repetition_penalty=1.3, prompt_token_ids=[1, 2], output_token_ids=[3])
              for i in range(8)]
    out = Sampler(0).sample(logits, params)
    ref = torch.log_softmax(logits, -1)
    for i, (token, logprob, top) in enumerate(out):
        # Rows that asked for no logprobs skip the normalisation and read 0.0.
        expected = float(ref[i, token]) if params[i].num_logprobs is not None else 0.0
        assert logprob == pytest.approx(expected, abs=1e-5)
        n = params[i].num_logprobs or 0
        assert len(top) == n
        values, ids = ref[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_zero_logprobs_returns_only_the_sampled_one(logits):
    out = Sampler(0).sample(logits, [sp(num_logprobs=0)] * 8)
    assert all(top == [] for _, _, top in out)


def test_full_vocabulary_batch_mixes_every_option():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 49152, generator=g) * 3
    kinds = [sp(temperature=0.0), sp(temperature=0.8, seed=3), sp(top_k=50), sp(top_p=0.9),
             sp(min_p=0.1), sp(temperature=1.2, repetition_penalty=1.2, presence_penalty=0.5,
                               prompt_token_ids=list(range(100)), output_token_ids=[5, 5, 7]),
             sp(num_logprobs=5, banned_token_ids=[int(x[6].argmax())]), sp(top_k=1)]
    params = [kinds[i % len(kinds)] for i in range(64)]
    out = Sampler(0).sample(x, params)
    assert len(out) == 64 and all(0 <= t < 49152 for t in tokens(out))
    assert out[0][0] == int(x[0].argmax()) and out[7][0] == int(x[7].argmax())
    assert out[6][0] != int(x[6].argmax()) and len(out[6][2]) == 5


def test_inverse_cdf_matches_a_full_float64_cumsum():
    from pipeserve.sampling.draw import inverse_cdf
    g = torch.Generator().manual_seed(11)
    weights = torch.rand(3, 3000, generator=g) ** 4          # 3000: not a multiple of the block
    weights[:, 1000:2100] = 0.0                              # a masked stretch over a block edge
    weights[:, 2900:] = 0.0                                  # masked tail
    u = torch.rand(3, 2000, generator=g, dtype=torch.float64)
    u[:, -1] = 1.0 - 2.0 ** -53                              # the very top of the CDF
    cdf = weights.double().cumsum(-1)
    for r in range(3):
        got = inverse_cdf(weights[r].expand(2000, 3000), u[r])
        want = torch.searchsorted(cdf[r], (u[r] * cdf[r, -1])[:, None], right=True).squeeze(1)
        want = want.clamp(max=2899)                          # the last token of positive weight
        assert torch.equal(got, want)
        assert bool((weights[r, got] > 0).all())


def test_cpu_argmax_matches_torch_on_ties_nan_and_inf():
    """Greedy on CPU takes NumPy's argmax: the same first-of-ties and NaN choices as torch's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 2, (6, 500), generator=g).float()   # many ties
    x[1, [40, 7, 300]] = float("nan")
    x[2] = float("-inf")
    x[3, 9] = float("inf")
    x[4, [0, 499]] = float("inf")
    assert argmax(x).dtype == torch.int64
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x[:, ::3]), x[:, ::3].argmax(dim=-1))   # a strided view
    out = Sampler(0).sample(x, [sp(temperature=0.0)] * 6)
    assert tokens(out) == x.argmax(-1).tolist()


@skip_without_kernel("elementwise")
def test_bf16_argmax_matches_numpy_on_the_widened_rows():
    """A bfloat16 model's greedy step hands the head's bf16 logits to elementwise.c's argmax:
    the first maximum of the rows widened to float32 (NaN first, -0 equal to +0, infinities,
    negative rows, ties at chunk edges, rows shorter than a chunk, a strided view), and the
    sampler's greedy tokens are those of the widened logits."""
    from pipeserve.sampling.sampler import _argmax_bf16
    assert _argmax_bf16() is not None
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(12, 49152, generator=g) * 8).bfloat16()
    x[0, [100, 64, 30000]] = float("nan")
    x[1] = float("-inf")
    x[2] = -1.0
    x[2, 5], x[2, 70] = -0.0, 0.0   # the first maximum is -0 at 5 (equal to +0 at 70)
    x[3, 9] = float("inf")
    x[4] = -torch.rand(49152, generator=g).bfloat16() - 1   # every value negative
    x[5, [63, 64, 127, 128]] = 1e30   # ties across chunk edges
    x[6, -1] = 1e30                   # the last
    x[7] = 1.0                         # all equal
    x[8, 0] = float("nan")
    x[9, 49151] = float("nan")
    x[10, 49088] = x[10].float().max().bfloat16()   # a tie in the last whole chunk
    wide = x.float()
    want = torch.from_numpy(wide.numpy().argmax(axis=-1))
    assert torch.equal(argmax(x), want) and torch.equal(want, wide.argmax(dim=-1))
    assert argmax(x)[2].item() == 5
    for n in (1, 3, 31, 32, 33, 63, 64, 65, 95, 96, 97, 200):
        assert torch.equal(argmax(x[:, :n]), wide[:, :n].argmax(dim=-1)), n
    # -0 the maximum with no +0 (its key alone); a negative NaN (sign set) after a positive
    # maximum; a NaN in a row's tail past its last whole 32 values.
    y = torch.full((3, 100), -2.0).bfloat16()
    y[0, [17, 60]] = -0.0
    y[1, 3] = 5.0
    y.view(torch.int16)[1, 50] = -64          # 0xFFC0: NaN with the sign bit set
    y[2, 98] = float("nan")
    assert argmax(y).tolist() == [17, 50, 98] == y.float().argmax(dim=-1).tolist()
    assert torch.equal(argmax(x[:, ::3]), wide[:, ::3].argmax(dim=-1))
    out = Sampler(0).sample(x, [sp(temperature=0.0)] * 12)
    assert tokens(out) == want.tolist()
    # Rows that sample (or ask for logprobs) are widened first, as before.
    mixed = Sampler(0).sample(x[3:5], [sp(temperature=0.0, num_logprobs=2), sp(temperature=0.0)])
    assert tokens(mixed) == want[3:5].tolist()
