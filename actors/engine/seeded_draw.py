"""Seeded draws for many rows at once: temperature, top-k, top-p, one uniform number a row.

Row r draws token ``index`` of its request with one uniform ``u_r`` in [0, 1), a hash of the
request's ``(seed, index)`` (``uniform``). Its token is the first candidate whose running
sum of weights exceeds ``u_r`` times the row's total weight (inverse CDF; running sums in
float64). A token's weight is ``exp((x - max x) / T)``, proportional to its probability
(float32 over a whole vocabulary, float64 over top-k / top-p candidates), or 0 where top-k
or top-p cut it. So a row's token depends only on its own logits, spec and ``(seed,
index)``: not on the rows beside it, the batch's size or which worker draws it.

Batched: the tempering, top-k, the running sums and the search run once for all rows,
where drawing row by row with a seeded ``torch.Generator`` and ``multinomial`` cost
0.8-2.6 ms a row on a 49k-151k vocabulary, and about 4 ms a row on 49k with top-p's full sort
(``bench/sampler.py``).

Top-p looks first at a row's 64 most likely tokens (one ``topk``), then 512, and only a row
whose top-p mass is not reached among those sorts its whole vocabulary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from policies.request import SampleSpec

# Whole-vocabulary rows are drawn this many bytes of logits at a time: each pass over them
# then stays in a core's cache, and its buffers are reused, not faulted in afresh.
CHUNK_BYTES = 1 << 20
WIDTHS = (64, 512)  # candidates a top-p row looks at before it sorts its whole vocabulary

_MASK64 = (1 << 64) - 1
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct (seed, index) -> distinct seeds


def token_seed(seed: int, index: int) -> int:
    return (seed * _SEED_MIX + index) % (1 << 63)


def uniform(seed: int, index: int) -> float:
    """A float in [0, 1) from ``(seed, index)``: splitmix64's finalizer over ``token_seed``,
    its top 53 bits."""
    z = (token_seed(seed, index) + _SEED_MIX) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


@dataclass
class Draws:
    """For each drawn row: its token, and its kept candidates' ids and weights.

    ``ids[r]``: [k_r] int64 token ids (None: the whole vocabulary in id order);
    ``weights[r]``: [k_r], not normalized, zero where top-k or top-p cut the token (float32
    over the whole vocabulary, float64 over candidates); None unless the row's spec asks
    for logprobs (the buffers of the others are reused as soon as they are drawn)."""

    tokens: list[int]
    ids: list[torch.Tensor | None]
    weights: list[torch.Tensor | None]

    def logprobs(self, r: int, vocab: int) -> torch.Tensor:
        """Row r's log-probabilities as drawn: [vocab] float64, -inf where cut."""
        kept = self.weights[r]
        assert kept is not None, "weights are kept only for rows that ask for logprobs"
        w = kept.double()
        lp = (w / w.sum()).log()
        ids = self.ids[r]
        if ids is None:
            return lp
        return torch.full(
            (vocab,), float("-inf"), dtype=torch.float64, device=w.device
        ).index_copy_(0, ids, lp)


def draw(logits: torch.Tensor, specs: list[SampleSpec]) -> Draws:
    """One token per row. logits: [n, vocab] float32, already shaped (penalties, bias,
    masks); every spec has ``temperature > 0``."""
    n, vocab = logits.shape
    temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype, device=logits.device)
    us = [uniform(s.seed, s.index) for s in specs]
    full = [r for r, s in enumerate(specs) if _top_k(s, vocab) == vocab and s.top_p >= 1.0]
    is_full = set(full)
    cut = [r for r in range(n) if r not in is_full]
    ids: list[torch.Tensor | None] = [None] * n
    weights: list[torch.Tensor | None] = [None] * n
    keep = [s.logprobs is not None for s in specs]
    at = [0] * n
    if full:
        for rows, x in _in_chunks(logits, full):
            w = (x - x.amax(-1, keepdim=True)).div_(temps[rows, None]).exp_()  # [c, vocab]
            for j, pick in enumerate(_inverse_cdf_blocked(w, [us[r] for r in rows])):
                at[rows[j]] = pick
                if keep[rows[j]]:
                    weights[rows[j]] = w[j]
    if cut:
        x = logits if len(cut) == n else logits[cut]
        for rows_of_group, row_ids, w in _cut_weights(x, temps[cut], [specs[r] for r in cut]):
            rows = [cut[i] for i in rows_of_group]
            for i, pick in enumerate(_inverse_cdf(w, [us[r] for r in rows])):
                ids[rows[i]], at[rows[i]] = row_ids[i], pick
                if keep[rows[i]]:
                    weights[rows[i]] = w[i]
    tokens = [a if (row := ids[r]) is None else int(row[a]) for r, a in enumerate(at)]
    return Draws(tokens, ids, weights)


def _in_chunks(x: torch.Tensor, rows: list[int]) -> Iterator[tuple[list[int], torch.Tensor]]:
    """``rows`` of x: [n, vocab], ``CHUNK_BYTES`` of them at a time, each with its
    [c, vocab] slice (a view where the rows are consecutive)."""
    step = max(1, CHUNK_BYTES // (x.shape[-1] * x.element_size()))
    for i in range(0, len(rows), step):
        chunk = rows[i : i + step]
        consecutive = chunk[-1] - chunk[0] == len(chunk) - 1
        yield chunk, x[chunk[0] : chunk[-1] + 1] if consecutive else x[chunk]


def _top_k(spec: SampleSpec, vocab: int) -> int:
    return spec.top_k if 0 < spec.top_k < vocab else vocab


def _cut_weights(
    x: torch.Tensor, temps: torch.Tensor, specs: list[SampleSpec]
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """x: [c, vocab] logits of rows with a top-k or top-p cut, temps: [c] -> groups of rows
    (their positions in x), each with its candidates' ids [g, k] and float64 probabilities
    [g, k] (0 where cut), in descending order of logit.

    A top-k row's probabilities are normalized over its k tokens, any other row's over the
    whole vocabulary; top-p then keeps the smallest prefix reaching its mass. A top-p row
    without top-k takes its ``WIDTHS[0]`` most likely tokens, then ``WIDTHS[1]`` where
    their mass stays below its top-p, then its whole vocabulary sorted. Its kept prefix,
    and so its token, is the same at any width that reaches its mass."""
    c, vocab = x.shape
    ks = [_top_k(s, vocab) for s in specs]
    top = x.amax(-1, keepdim=True)  # [c, 1]
    t = temps[:, None].double()
    whole = [i for i, k in enumerate(ks) if k == vocab]
    norm = torch.zeros(c, dtype=torch.float64, device=x.device)
    for rows, part in _in_chunks(x, whole):  # their normalizer: the sum over the vocabulary
        norm[rows] = ((part - top[rows]) / temps[rows, None]).exp_().sum(-1).double()
    top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float64, device=x.device)
    groups = []
    pending = list(range(c))
    narrow = max([k for k in ks if k < vocab], default=0)
    for width in (*sorted({max(w, narrow) for w in WIDTHS if w < vocab}), vocab):
        rows = pending
        if width == vocab:
            values, order = torch.sort(x[rows], dim=-1, descending=True)
        else:
            values, order = torch.topk(x[rows], width, dim=-1)  # [g, width], descending
        cand = ((values - top[rows]).double() / t[rows]).exp()  # [g, width], 1 first
        limits = torch.tensor([ks[i] for i in rows], device=x.device)[:, None]
        cand.masked_fill_(torch.arange(width, device=x.device) >= limits, 0.0)
        scale = torch.where(limits.flatten() < vocab, cand.sum(-1), norm[rows])
        probs = cand / scale[:, None]
        mass = probs.sum(-1).tolist()
        reached = [
            j
            for j, i in enumerate(rows)
            if width == vocab or ks[i] < vocab or mass[j] >= specs[i].top_p
        ]
        if reached:
            kept = [rows[j] for j in reached]
            groups.append((kept, order[reached], _top_p(probs[reached], top_p[kept])))
        done = set(reached)
        pending = [i for j, i in enumerate(rows) if j not in done]
        if not pending:
            break
    return groups


def _top_p(p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """p: [g, k] float64 probabilities, each row descending; top_p: [g] -> each row's
    smallest prefix whose mass reaches its ``top_p`` (always at least one token); the rest
    0. A row with ``top_p`` 1 keeps every token."""
    drop = (p.cumsum(-1) - p >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return p.masked_fill(drop, 0.0)


def _inverse_cdf(w: torch.Tensor, us: list[float]) -> list[int]:
    """w: [g, k] non-negative weights, us: g uniforms -> each row's position: the first
    candidate whose running sum exceeds ``us[r]`` times the row's total. A zero-weight
    candidate is never chosen: ``u * total`` below the total always stops at or before the
    last positive one, and where it rounds up to the total, the last positive one is
    taken. The running sums are sequential, so zeros after a row's last positive weight
    (a wider candidate list) change nothing."""
    sums = w.cumsum(-1, dtype=torch.float64)  # [g, k]
    totals = sums[:, -1]
    targets = torch.tensor(us, dtype=torch.float64, device=w.device) * totals
    at = torch.searchsorted(sums, targets[:, None], right=True).flatten().tolist()
    return _past_the_end(w, targets >= totals, at)


def _inverse_cdf_blocked(w: torch.Tensor, us: list[float]) -> list[int]:
    """``_inverse_cdf`` over whole-vocabulary rows in two levels: each block of ``_block``
    tokens is summed (float32, a fixed order for a fixed vocabulary), the running sum over
    the blocks finds the block where the row crosses its target, and only that block is
    summed running. w: [g, vocab]."""
    g, vocab = w.shape
    size = _block(vocab)
    tiles = w.view(g, vocab // size, size)
    block_sums = tiles.sum(-1).double()  # [g, blocks]
    sums = block_sums.cumsum(-1)
    totals = sums[:, -1]
    targets = torch.tensor(us, dtype=torch.float64, device=w.device) * totals
    b = torch.searchsorted(sums, targets[:, None], right=True)
    b.clamp_(max=vocab // size - 1)  # [g, 1]
    before = sums.gather(1, b) - block_sums.gather(1, b)  # [g, 1]: the mass ahead of block b
    tile = tiles[torch.arange(g, device=w.device), b.flatten()]  # [g, size]
    inner = before + tile.cumsum(-1, dtype=torch.float64)
    within = torch.searchsorted(inner, targets[:, None], right=True)
    last = torch.where(tile > 0, torch.arange(size, device=w.device), -1).amax(-1, keepdim=True)
    at = (b * size + torch.minimum(within, last)).flatten().tolist()
    return _past_the_end(w, targets >= totals, at)


@functools.cache
def _block(vocab: int) -> int:
    """The smallest divisor of ``vocab`` at least its square root: blocks of about
    sqrt(vocab) tokens that tile it exactly (49,152 -> 256, 151,936 -> 1,187; a prime
    vocabulary is one block)."""
    size = max(1, math.isqrt(vocab))
    while vocab % size:
        size += 1
    return size


def _past_the_end(w: torch.Tensor, over: torch.Tensor, at: list[int]) -> list[int]:
    """Rows whose target rounded up to their total take their last positive candidate."""
    for r in over.nonzero().flatten().tolist():
        at[r] = int((w[r] > 0).nonzero()[-1])
    return at
