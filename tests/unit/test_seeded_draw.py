"""The batched seeded sampler (actors/engine/seeded_draw.py): its tokens follow the
distribution top-k and top-p define, never a cut token, and a row's token does not depend
on the rows beside it, whichever path (whole vocabulary, top-k, top-p at each candidate
width, the full sort) each row takes."""

from __future__ import annotations

import math

import torch

from actors.engine.sampling import sample_tokens
from actors.engine.seeded_draw import WIDTHS, draw, uniform
from policies.request import SamplingParams

VOCAB = 3000


def spec(seed: int, index: int = 0, **kw):
    return SamplingParams(max_tokens=1, **kw).spec(seed, index)


def peaked(seed: int, rows: int = 1, scale: float = 3.0) -> torch.Tensor:
    """[rows, VOCAB] float32 logits with a few likely tokens, as a model's are."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=g) * scale).float()


def allowed_set(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """The tokens the cut keeps, by a full sort in float64 (the definition)."""
    x = row.double() / temperature
    order = torch.argsort(x, descending=True)
    k = top_k if 0 < top_k < row.numel() else row.numel()
    order = order[:k]
    p = torch.softmax(x[order], -1) if k < row.numel() else torch.softmax(x, -1)[order]
    before = p.cumsum(0) - p
    return set(order[before < top_p].tolist())


def test_uniform_is_in_the_unit_interval_and_differs_per_seed_and_index():
    values = [uniform(seed, index) for seed in range(50) for index in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_frequencies_follow_the_tempered_probabilities():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    temperature = 0.8
    want = torch.softmax(logits[0].double() / temperature, -1)
    draws = 20000
    counts = [0] * 5
    for seed in range(draws):
        (token,) = draw(logits, [spec(seed, temperature=temperature)]).tokens
        counts[token] += 1
    chi2 = sum(
        (counts[i] - draws * float(want[i])) ** 2 / (draws * float(want[i])) for i in range(5)
    )
    assert chi2 < 20.5, (counts, want)  # 4 degrees of freedom: p < 0.0005 by chance


def test_top_k_and_top_p_never_draw_a_cut_token():
    settings = [
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.7, top_p=0.5),
        dict(temperature=1.5, top_p=0.9),
        dict(temperature=1.0, top_k=40, top_p=0.8),
        dict(temperature=1.0, top_k=1),
    ]
    for n, kw in enumerate(settings):
        logits = peaked(n, rows=8)
        for seed in range(40):
            specs = [spec(seed * 8 + r, **kw) for r in range(8)]
            tokens = draw(logits, specs).tokens
            for r, token in enumerate(tokens):
                keep = allowed_set(
                    logits[r], kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0)
                )
                assert token in keep, (kw, r, token)


def test_top_k_one_and_a_tiny_top_p_are_the_argmax():
    logits = peaked(3, rows=6)
    argmax = logits.argmax(-1).tolist()
    assert draw(logits, [spec(r, temperature=1.3, top_k=1) for r in range(6)]).tokens == argmax
    assert draw(logits, [spec(r, temperature=1.3, top_p=1e-9) for r in range(6)]).tokens == argmax


def test_a_rows_token_is_the_same_alone_and_beside_any_other_rows():
    flat = torch.zeros(1, VOCAB)  # top-p 0.9 of a flat row is past every candidate width
    flat[0, :7] = 0.01
    rows = torch.cat([peaked(10, 4), peaked(11, 2, scale=0.2), flat, peaked(12, 3, scale=8.0)])
    kinds = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=0.9, top_k=50),
        dict(temperature=1.0, top_k=200, top_p=0.95),
        dict(temperature=1.0, top_p=0.99),  # the 0.2-scale rows need more than WIDTHS[0]
        dict(temperature=2.0, top_p=0.95),
        dict(temperature=1.0, top_p=0.9),  # the flat row: the full sort
        dict(temperature=0.5),
        dict(temperature=0.6, top_k=7),
        dict(temperature=1.2, top_p=0.3),
    ]
    specs = [spec(100 + r, r, **kinds[r]) for r in range(len(kinds))]
    together = draw(rows, specs)
    for r in range(len(specs)):
        alone = draw(rows[r : r + 1], [specs[r]])
        assert alone.tokens == [together.tokens[r]], r
    reversed_rows = draw(rows.flip(0), specs[::-1])
    assert reversed_rows.tokens == together.tokens[::-1]
    widest = max(WIDTHS)
    assert len(allowed_set(rows[6], 1.0, 0, 0.9)) > widest  # the flat row did need the sort


def test_logprobs_of_a_drawn_token_are_over_the_kept_tokens_only():
    logits = peaked(5, rows=1)
    specs = [spec(7, temperature=0.8, top_k=20, top_p=0.9, logprobs=3)]
    (out,) = sample_tokens(logits, specs)
    keep = allowed_set(logits[0], 0.8, 20, 0.9)
    assert out.token_id in keep
    assert out.logprob is not None and math.isfinite(out.logprob.logprob)
    assert {t for t, _ in out.logprob.top} <= keep
    drawn = draw(logits, specs)
    lp = drawn.logprobs(0, VOCAB)
    assert set(torch.isfinite(lp).nonzero().flatten().tolist()) == keep
    assert abs(float(lp[torch.isfinite(lp)].exp().sum()) - 1.0) < 1e-9


def test_greedy_rows_beside_drawn_rows_stay_the_argmax():
    logits = peaked(9, rows=5)
    specs = [spec(r, temperature=0.0 if r % 2 else 1.0) for r in range(5)]
    tokens = [s.token_id for s in sample_tokens(logits, specs)]
    for r in (1, 3):
        assert tokens[r] == int(logits[r].argmax())
