"""Sampling parameters of one request, and the sampler that turns logits into tokens.

Greedy when ``temperature == 0``. Sampling is stateless: token ``index`` of a request is drawn
with a generator seeded from ``(seed, index)``, so a seeded request draws the same tokens
whatever shares its batch, on whichever worker samples it, and after its KV was recomputed.
Requests without a seed get a random one when they are added.

Everything else that shapes a row (penalties over the request's history, ``logit_bias``,
``min_tokens``, the grammar mask of structured output) arrives in the row's ``SampleSpec``,
computed by the replica controller, so the worker that samples keeps no per-request state
and any layout (tp, spp, kvp, a prefill replica sampling the first token) draws the same
token from the same logits. The order is vLLM's; see ``SamplingParams``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.outputs import TokenLogprob
from policies.request import SampleSpec, SamplingParams

__all__ = [
    "SampleSpec",
    "SampledToken",
    "SamplingParams",
    "TokenLogprob",
    "process_logits",
    "sample",
    "sample_tokens",
    "token_seed",
]


_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct (seed, index) -> distinct seeds


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


def token_seed(seed: int, index: int) -> int:
    return (seed * _SEED_MIX + index) % (1 << 63)


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """One token per row. logits: [N, vocab] (any float dtype, any device)."""
    return [s.token_id for s in sample_tokens(logits, specs)]


def sample_tokens(logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampledToken]:
    """One token per row (with its logprobs when the row's spec asks for them)."""
    if not specs:
        return []
    logits = logits.float()
    fast = logits.argmax(dim=-1).tolist()
    out = []
    for i, spec in enumerate(specs):
        if spec.plain and spec.temperature == 0.0 and spec.logprobs is None:
            out.append(SampledToken(int(fast[i])))
        else:
            out.append(_sample_row(logits[i].cpu(), spec))
    return out


def process_logits(row: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """The grammar mask, logit bias, min_tokens suppression and penalties of ``spec`` applied
    to one row of fp32 logits (a new tensor; temperature and top-k/top-p are not applied)."""
    row = row.clone()
    if spec.plain:
        return row
    vocab = row.numel()
    if spec.allowed is not None:
        row = row.masked_fill(~allowed_mask(spec.allowed, vocab), float("-inf"))
    if spec.logit_bias:
        ids = torch.tensor([t for t, _ in spec.logit_bias], dtype=torch.int64)
        bias = torch.tensor([b for _, b in spec.logit_bias], dtype=row.dtype)
        row.index_add_(0, ids, bias)
    if spec.suppress:
        suppressed = row.index_fill(0, torch.tensor(spec.suppress), float("-inf"))
        if spec.allowed is None or bool(torch.isfinite(suppressed).any()):
            row = suppressed  # a grammar that allows nothing but EOS wins over min_tokens
    if spec.repetition_penalty != 1.0:
        seen = set(spec.prompt_tokens) | {t for t, _ in spec.output_counts}
        if seen:
            ids = torch.tensor(sorted(seen), dtype=torch.int64)
            vals = row[ids]
            p = spec.repetition_penalty
            row[ids] = torch.where(vals > 0, vals / p, vals * p)
    if spec.output_counts and (spec.frequency_penalty != 0.0 or spec.presence_penalty != 0.0):
        ids = torch.tensor([t for t, _ in spec.output_counts], dtype=torch.int64)
        counts = torch.tensor([c for _, c in spec.output_counts], dtype=row.dtype)
        row.index_add_(0, ids, -(spec.frequency_penalty * counts + spec.presence_penalty))
    return row


def allowed_mask(words: bytes, vocab: int) -> torch.Tensor:
    """A grammar bitmask (little-endian int32 words) -> [vocab] bool."""
    w = torch.frombuffer(bytearray(words), dtype=torch.int32)
    bits = (w.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    mask = bits.reshape(-1).bool()
    if mask.numel() < vocab:  # ids past the tokenizer's vocabulary are never allowed
        mask = torch.cat([mask, torch.zeros(vocab - mask.numel(), dtype=torch.bool)])
    return mask[:vocab]


def _sample_row(raw: torch.Tensor, spec: SampleSpec) -> SampledToken:
    """raw: [vocab] fp32 logits -> a token from the processed, tempered, top-k/top-p cut
    softmax (argmax of the processed logits when greedy)."""
    row = process_logits(raw, spec)
    if spec.temperature == 0.0:
        token = int(row.argmax().item())
        final = torch.log_softmax(row.double(), dim=-1)
    else:
        probs = _probs(row / spec.temperature, spec.top_k, spec.top_p)
        generator = torch.Generator().manual_seed(token_seed(spec.seed, spec.index))
        token = int(torch.multinomial(probs, 1, generator=generator).item())
        final = (probs.double() / probs.double().sum()).log()
    if spec.logprobs is None:
        return SampledToken(token)
    if spec.logprobs_mode == "raw":
        final = torch.log_softmax(raw.double(), dim=-1)
    return SampledToken(token, _logprobs(final, token, spec.logprobs))


def _probs(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Tempered logits -> the probabilities a token is drawn with (top-k and top-p cut
    entries are 0; the rest are not renormalised, ``multinomial`` does not need it)."""
    if top_k > 0 and top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def _logprobs(lp: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """lp: [vocab] fp64 log-probabilities."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token].item()), top)
