"""The sampler's cost per decode step: batched seeded draws against drawing row by row.

Logits are real: SmolLM2-135M-Instruct's next-token logits (transformers, float32) at the
end of ShareGPT prompts rendered with its chat template, ``--rows`` of them a step. Each
step samples every row with one setting (greedy; temperature 1; temperature 0.7 with
top-p 0.9; temperature 0.7 with top-k 50), through:

  batched   ``actors.engine.sampling.sample_tokens``, the engine's sampler (one seeded
            uniform a row, inverse CDF over the rows at once; ``seeded_draw.py``)
  per-row   the sampler it replaced: a ``torch.Generator`` seeded per row and
            ``torch.multinomial`` over the row's softmax, top-p by a full sort

Greedy's argmax over the same logits is the floor. The sides are interleaved (A, B, A,
B, ...), one thread (a replica's engine thread runs one), medians of ``--repeats``.

    python bench/sampler.py [--rows 1 16 64] [--repeats 15]

Last line: ``sampling ms per step per-row/batched at 16 rows, top-p 0.9: <ratio>``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from actors.engine.sampling import sample_tokens, token_seed
from bench.interleave import interleaved, median_ratio
from bench.real_prompts import short_prompts, tokenizer
from models.hf_reference import hf_pretrained
from models.pretrained import resolve_model
from policies.request import SampleSpec, SamplingParams

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "t=1": dict(temperature=1.0),
    "t=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "t=0.7 top-k 50": dict(temperature=0.7, top_k=50),
}
LAST = ("t=0.7 top-p 0.9", 16)


def per_row(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """The replaced sampler, row by row (no penalties: the bench's specs have none)."""
    out = []
    for row, spec in zip(logits.float(), specs, strict=True):
        if spec.temperature == 0.0:
            out.append(int(row.argmax()))
            continue
        row = row / spec.temperature
        if 0 < spec.top_k < row.numel():
            row = row.masked_fill(row < torch.topk(row, spec.top_k).values[-1], float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if spec.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            sorted_probs[sorted_probs.cumsum(0) - sorted_probs >= spec.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        generator = torch.Generator().manual_seed(token_seed(spec.seed, spec.index))
        out.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return out


def real_logits(model: str, count: int, seed: int) -> torch.Tensor:
    """[count, vocab] float32: the model's logits after each of ``count`` ShareGPT prompts."""
    path = resolve_model(model)
    hf = hf_pretrained(path)
    rows = []
    with torch.inference_mode():
        for ids in short_prompts(tokenizer(model), count, seed):
            out = hf(torch.tensor([ids[-512:]]))
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logits = real_logits(args.model, max(args.rows), args.seed)
    vocab = logits.shape[-1]
    print(f"{args.model}: {logits.shape[0]} ShareGPT prompts' next-token logits, vocab {vocab}")
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} repeats (medians, ms a step)")
    print("rows | setting | batched | per-row | per-row/batched")
    last = float("nan")
    for rows in args.rows:
        batch = logits[:rows].contiguous()
        for name, kw in SETTINGS.items():
            params = SamplingParams(max_tokens=1, **kw)
            specs = [params.spec(1000 + r, 7) for r in range(rows)]
            calls = {
                "batched": lambda b=batch, s=specs: sample_tokens(b, s),
                "per-row": lambda b=batch, s=specs: per_row(b, s),
            }
            for call in calls.values():  # warm-up
                call()

            def timed(side: str, _rep: int, calls=calls) -> float:
                start = time.perf_counter()
                calls[side]()
                return time.perf_counter() - start

            times = interleaved(list(calls), args.repeats, timed, rotate=False)
            a, b = (statistics.median(times[s]) * 1e3 for s in ("batched", "per-row"))
            ratio = median_ratio(times["per-row"], times["batched"])
            print(f"{rows} | {name} | {a:.2f} | {b:.2f} | {ratio:.2f}")
            if (name, rows) == LAST:
                last = ratio
    print(f"sampling ms per step per-row/batched at 16 rows, top-p 0.9: {last:.2f}")


if __name__ == "__main__":
    main()
