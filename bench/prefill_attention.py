"""Prefill attention on CPU: the compiled kernel against torch's flash kernel, one layer.

The bench model's attention shape (8 query heads, 4 KV heads, head size 64, fp32, blocks of
16 scattered over the cache as a long-running server's free list leaves them), one thread.
Two steps, each computed by ``paged_attention`` with ``impl="native_cpu"`` (the prefill
kernel, ``kernels/paged_prefill_cpu.cpp``: KV read out of its blocks once, causal, keys above
the diagonal skipped) and ``impl="flash_cpu"`` (the path it replaced: KV gathered into a
padded copy, torch's fused kernel under an additive causal mask), interleaved A, B, A, B, ...
and reported as medians:

  prompts  ``--prompts`` fresh prompts of ``--prompt-len`` tokens (a serving step's prefill)
  chunk    one ``--chunk``-token chunk after ``--prefix`` cached tokens (chunked prefill)

    python bench/prefill_attention.py [--repeats 21]

Last line: ``prefill kernel/flash at <n> prompts: <ratio>`` (lower is faster).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from functools import partial

import torch

from bench.interleave import seconds_in_turns
from kernels import paged_attention_cpu
from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import paged_attention, plan_attention
from kernels.kv_cache import allocate_kv_cache

BLOCK, HQ, HKV, HEAD_DIM = 16, 8, 4, 64


def step(query_lens: list[int], context_lens: list[int], seed: int):
    """q, caches and metadata for one step; every sequence's blocks scattered."""
    rng = random.Random(seed)
    need = [-(-c // BLOCK) for c in context_lens]
    free = list(range(sum(need) + 8))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    ((k_cache, v_cache),) = allocate_kv_cache(1, sum(need) + 8, BLOCK, HKV, HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK)
    q = torch.randn(sum(query_lens), HQ, HEAD_DIM, generator=gen)
    return q, k_cache, v_cache, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if paged_attention_cpu.load() is None:
        sys.exit(f"the CPU attention kernels are unavailable: {paged_attention_cpu.error()}")
    steps = {
        "prompts": step([args.prompt_len] * args.prompts, [args.prompt_len] * args.prompts, 0),
        "chunk": step([args.chunk], [args.prefix + args.chunk], 1),
    }
    impls = ("native_cpu", "flash_cpu")
    times: dict[tuple[str, str], list[float]] = {(s, i): [] for s in steps for i in impls}
    scale = HEAD_DIM**-0.5
    for name, (q, k_cache, v_cache, meta) in steps.items():
        plan = plan_attention(meta)
        outs = [paged_attention(q, k_cache, v_cache, meta, scale, plan, impl=i) for i in impls]
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-5)
        calls = {
            i: partial(paged_attention, q, k_cache, v_cache, meta, scale, plan, impl=i)
            for i in impls
        }
        for impl, seconds in seconds_in_turns(calls, args.repeats).items():  # A, B, A, B, ...
            times[name, impl] = seconds
    print(f"{'step':<44}{'kernel ms':>11}{'flash ms':>10}{'ratio':>8}")
    label = {
        "prompts": f"{args.prompts} prompts of {args.prompt_len}",
        "chunk": f"{args.chunk}-token chunk after {args.prefix} cached",
    }
    ratios = {}
    for name in steps:
        kernel = statistics.median(times[name, "native_cpu"]) * 1e3
        flash = statistics.median(times[name, "flash_cpu"]) * 1e3
        ratios[name] = kernel / flash
        print(f"{label[name]:<44}{kernel:>11.2f}{flash:>10.2f}{ratios[name]:>8.2f}")
    print(f"prefill kernel/flash at {args.prompts} prompts: {ratios['prompts']:.2f}")


if __name__ == "__main__":
    main()
