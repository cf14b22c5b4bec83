"""A mixed step costs what its parts cost: one prefill chunk plus many decodes, in process.

The 8-layer, hidden-512 bench model of ``bench/engine_cpu.py`` (random weights written in HF
format, fp32, oneDNN-packed linears as the worker packs them, torch's default threads as the
engine runs them, or ``--threads``), driven one step at a time through the worker's own
path: a hand-built ``StepPlan`` -> ``build_worker_inputs`` -> ``ModelShard`` forward over the
paged KV cache.
Three steps, interleaved A, B, C, A, B, C, ... and reported as medians:

  A  one prefill chunk alone (``--chunk`` tokens, ``--chunk-prefix`` cached tokens before it)
  B  ``--decodes`` decode rows alone (contexts uniform in [256, 320])
  C  both in one step

Target: C <= 1.2 x (A + B). ``--compare-padded`` also times the old attention path that pads
every row of a step to the longest query (``TorchAttentionBackend(split=False)``).

    python bench/mixed_step.py [--repeats 15] [--compare-padded] [--threads N]

Last line: ``mixed/(chunk+decodes): <ratio>`` for the default backend.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from actors.engine.step_plan import PlanEntry, StepPlan
from actors.engine.worker_inputs import build_worker_inputs
from bench.bench_model import MODEL, write_bench_model
from bench.interleave import interleaved
from kernels.attention_torch import TorchAttentionBackend
from kernels.cpu_linear import can_pack, pack_linears
from kernels.kv_cache import allocate_kv_cache
from models import load_model
from models.sharding import ModelShard

BLOCK = 16


def build_plans(args, vocab: int) -> dict[str, StepPlan]:
    """Plans A (chunk), B (decodes), C (both). Every request owns its own blocks, scattered
    over the cache as a long-running server's free list leaves them (so every sequence's KV
    is gathered; none is read in place)."""
    rng = random.Random(0)
    total = -(-(args.chunk_prefix + args.chunk) // BLOCK) + args.decodes * (320 // BLOCK)
    free = list(range(1, total + 1))
    rng.shuffle(free)

    def blocks_for(n: int) -> list[int]:
        return [free.pop() for _ in range(-(-n // BLOCK))]

    chunk_end = args.chunk_prefix + args.chunk
    chunk = PlanEntry(
        "chunk",
        args.chunk_prefix,
        [rng.randrange(3, vocab) for _ in range(args.chunk)],
        [(0, 0, blocks_for(chunk_end))],
        None,
    )
    decodes = []
    for i in range(args.decodes):
        ctx = rng.randint(256, 320)  # context after this step; the new token is the last
        decodes.append(
            PlanEntry(f"d{i}", ctx - 1, [rng.randrange(3, vocab)], [(0, 0, blocks_for(ctx))], None)
        )
    return {
        "A": StepPlan(0, [chunk]),
        "B": StepPlan(1, decodes),
        "C": StepPlan(2, [chunk, *decodes]),
    }


def num_blocks_needed(plans: dict[str, StepPlan]) -> int:
    return 1 + max(b for e in plans["C"].entries for _, _, blocks in e.shards for b in blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--chunk-prefix", type=int, default=0)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compare-padded", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model_dir = write_bench_model(Path(tmp) / "bench")
        model = load_model(model_dir, torch.float32, "cpu")
        shard = ModelShard(model)
        if can_pack(shard):
            pack_linears(shard)
        plans = build_plans(args, MODEL["vocab_size"])
        caches = allocate_kv_cache(
            shard.num_layers,
            num_blocks_needed(plans),
            BLOCK,
            shard.num_kv_heads,
            shard.config.head_dim,
        )
        for k_cache, v_cache in caches:  # stands in for the prompts' KV written earlier
            k_cache.normal_()
            v_cache.normal_()
        inputs = {name: build_worker_inputs(plan, 0, 1, BLOCK) for name, plan in plans.items()}

        backends = {"split": TorchAttentionBackend()}
        if args.compare_padded:
            backends["padded"] = TorchAttentionBackend(split=False)

        def step(name: str, backend: TorchAttentionBackend) -> float:
            shard.attention_backend = backend
            x = inputs[name]
            # a fresh metadata object per step, as the worker builds one per step
            meta = build_worker_inputs(plans[name], 0, 1, BLOCK).meta
            t0 = time.perf_counter()
            shard(x.input_ids, x.positions, caches, meta)
            return time.perf_counter() - t0

        for backend in backends.values():  # warm-up
            for name in "ABC":
                step(name, backend)
        sides = [(b, n) for b in backends for n in "ABC"]
        times = interleaved(sides, args.repeats, lambda s, _: step(s[1], backends[s[0]]), False)

        print(f"model: {MODEL}, block {BLOCK}, fp32")
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{args.repeats} repeats (medians, ms)"
        )
        print(
            f"A: one {args.chunk}-token chunk (cached prefix {args.chunk_prefix}); "
            f"B: {args.decodes} decodes (contexts 256-320); C: both in one step"
        )
        print(f"{'attention':>9} {'A chunk':>8} {'B decodes':>10} {'C mixed':>8} {'C/(A+B)':>8}")
        ratios = {}
        for bname in reversed(backends):
            a, b, c = (statistics.median(times[bname, n]) * 1e3 for n in "ABC")
            ratios[bname] = c / (a + b)
            print(f"{bname:>9} {a:>8.1f} {b:>10.1f} {c:>8.1f} {ratios[bname]:>8.2f}")
        print(f"mixed/(chunk+decodes): {ratios['split']:.2f}")


if __name__ == "__main__":
    main()
