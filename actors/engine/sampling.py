"""Sampling parameters of one request, and the sampler that turns logits into tokens.

Greedy when ``temperature == 0``. Sampling is stateless: token ``index`` of a request is drawn
with one uniform number hashed from ``(seed, index)`` (``actors/engine/seeded_draw.py``), so a
seeded request draws the same tokens whatever shares its batch, on whichever worker samples
it, and after its KV was recomputed.
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
from actors.engine.seeded_draw import draw, token_seed
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


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """One token per row. logits: [N, vocab] (any float dtype, any device)."""
    return [s.token_id for s in sample_tokens(logits, specs)]


def sample_tokens(logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampledToken]:
    """One token per row (with its logprobs when the row's spec asks for them).

    Batched over rows (argmax, the seeded draws, log-softmax); a row's result never
    depends on its neighbours. Only the shaping (penalties, bias, masks) runs row by row."""
    if not specs:
        return []
    logits = logits.float()  # [N, vocab]
    shaped = [i for i, s in enumerate(specs) if not s.plain]
    processed = logits
    if shaped:
        processed = logits.clone()
        for i in shaped:
            _shape_row_(processed[i], specs[i])
    drawn_rows = [i for i, s in enumerate(specs) if s.temperature != 0.0]
    greedy_rows = [i for i, s in enumerate(specs) if s.temperature == 0.0]
    greedy_logits = processed if len(greedy_rows) == len(specs) else processed[greedy_rows]
    greedy = dict(zip(greedy_rows, greedy_logits.argmax(dim=-1).tolist(), strict=True))
    drawn = None
    if drawn_rows:
        drawn_logits = processed if len(drawn_rows) == len(specs) else processed[drawn_rows]
        drawn = draw(drawn_logits, [specs[i] for i in drawn_rows])
    draw_of = {i: j for j, i in enumerate(drawn_rows)}
    raw_rows = [
        i for i, s in enumerate(specs) if s.logprobs is not None and s.logprobs_mode == "raw"
    ]
    raw_lp: dict[int, torch.Tensor] = {}
    if raw_rows:
        lps = torch.log_softmax(logits[raw_rows].double(), dim=-1)  # [len(raw_rows), vocab]
        raw_lp = {i: lps[j] for j, i in enumerate(raw_rows)}
    out = []
    for i, spec in enumerate(specs):
        final = raw_lp.get(i)
        if drawn is None or i not in draw_of:
            token = int(greedy[i])
            if spec.logprobs is not None and final is None:
                final = torch.log_softmax(processed[i].double(), dim=-1)
        else:
            token = drawn.tokens[draw_of[i]]
            if spec.logprobs is not None and final is None:
                final = drawn.logprobs(draw_of[i], processed.shape[-1])
        if spec.logprobs is None or final is None:
            out.append(SampledToken(token))
        else:
            out.append(SampledToken(token, _logprobs(final, token, spec.logprobs)))
    return out


def process_logits(row: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """The grammar mask, logit bias, min_tokens suppression and penalties of ``spec`` applied
    to one row of fp32 logits (a new tensor; temperature and top-k/top-p are not applied)."""
    row = row.clone()
    if not spec.plain:
        _shape_row_(row, spec)
    return row


def _shape_row_(row: torch.Tensor, spec: SampleSpec) -> None:
    """``process_logits`` in place on ``row`` ([vocab] fp32, a view is fine)."""
    vocab = row.numel()
    if spec.allowed is not None:
        row.masked_fill_(~allowed_mask(spec.allowed, vocab).to(row.device), float("-inf"))
    if spec.logit_bias:
        ids = torch.tensor([t for t, _ in spec.logit_bias], dtype=torch.int64, device=row.device)
        bias = torch.tensor([b for _, b in spec.logit_bias], dtype=row.dtype, device=row.device)
        row.index_add_(0, ids, bias)
    if spec.suppress:
        ids = torch.tensor(spec.suppress, dtype=torch.int64, device=row.device)
        if spec.allowed is None:
            row.index_fill_(0, ids, float("-inf"))
        else:
            suppressed = row.index_fill(0, ids, float("-inf"))
            if bool(torch.isfinite(suppressed).any()):
                row.copy_(suppressed)  # a grammar that allows nothing but EOS wins over min_tokens
    if spec.repetition_penalty != 1.0:
        seen = set(spec.prompt_tokens) | {t for t, _ in spec.output_counts}
        if seen:
            ids = torch.tensor(sorted(seen), dtype=torch.int64, device=row.device)
            vals = row[ids]
            p = spec.repetition_penalty
            row[ids] = torch.where(vals > 0, vals / p, vals * p)
    if spec.output_counts and (spec.frequency_penalty != 0.0 or spec.presence_penalty != 0.0):
        dev = row.device
        ids = torch.tensor([t for t, _ in spec.output_counts], dtype=torch.int64, device=dev)
        counts = torch.tensor([c for _, c in spec.output_counts], dtype=row.dtype, device=dev)
        row.index_add_(0, ids, -(spec.frequency_penalty * counts + spec.presence_penalty))


def allowed_mask(words: bytes, vocab: int) -> torch.Tensor:
    """A grammar bitmask (little-endian int32 words) -> [vocab] bool."""
    w = torch.frombuffer(bytearray(words), dtype=torch.int32)
    bits = (w.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    mask = bits.reshape(-1).bool()
    if mask.numel() < vocab:  # ids past the tokenizer's vocabulary are never allowed
        mask = torch.cat([mask, torch.zeros(vocab - mask.numel(), dtype=torch.bool)])
    return mask[:vocab]


def _logprobs(lp: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """lp: [vocab] fp64 log-probabilities."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token].item()), top)
