"""When does loading a stored prefix beat computing it? A colocated replica with the KV
store (``actors.serving.store_engine``) against itself with loads turned off.

For each prefix length N (a multiple of the block size), a prompt of N + 1 random tokens
is served once (its N tokens' blocks go to a store shard on this node), then, with the
replica's own prefix cache emptied before each run, interleaved (A, B, A, B, ...):

- A, compute: the replica serves the prompt with loads off (``min_load_tokens`` above N):
  it computes all N + 1 tokens;
- B, load: the same replica with loads on (``min_load_tokens`` 0): it reads the N tokens'
  blocks from the shard into its cache (map refresh, pin, one shared-memory read, publish)
  and computes the last token.

Each run is one request of ``max_tokens=1``, timed from ``add_request`` to its token on
the engine thread (this process). The table holds the medians and load/compute; the
break-even N is the smallest N from which loading is faster at every larger N measured.
The replica's default ``min_load_tokens`` (``actors/engine/defaults.py``) comes from the
SmolLM2 row (docs/configuration.md).

    python bench/colocated_store.py                      # tiny model and SmolLM2-135M
    python bench/colocated_store.py --models tiny --sizes 16 64 256 --repeats 5

Models: ``tiny`` (the test model: 4 layers, hidden 64), ``smollm2`` (SmolLM2-135M-Instruct,
30 layers, hidden 576, fp32; ``models/pretrained.py``). Needs Ray (a private local
instance is started).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.interleave import interleaved
from bench.local_serve import local_ray

MODELS = {"tiny": None, "smollm2": "SmolLM2-135M-Instruct"}
NEVER = 1 << 30  # min_load_tokens that turns loads off


def serve_once(engine, request) -> float:
    """Seconds from ``add_request`` to the request's end (its one token)."""
    rid = request.request_id
    start = time.perf_counter()
    engine.add_request(request)
    while not (engine.has_request(rid) and engine.output(rid).finished):
        engine.step()
    seconds = time.perf_counter() - start
    engine.release(rid)
    return seconds


def settle(engine) -> None:
    """Let the writes in flight end (``check_blocks`` waits for them), so none runs during
    a timed request; then empty the replica's own prefix cache."""
    assert engine.check_blocks() == {"kvp0": 0}
    engine.one_rank_kv.evict_all_cached()


def measure(model: str | None, sizes: list[int], repeats: int, seed: int) -> list[tuple]:
    from actors.engine.config import EngineConfig
    from actors.serving.store_engine import store_engine
    from models.pretrained import resolve_model
    from policies.request import SamplingParams

    path = str(resolve_model(model)) if model is not None else None
    config = EngineConfig(kv_cache_memory=1 << 28, max_num_seqs=4)
    pool = f"bench-colocated-store/{model or 'tiny'}"
    engine = store_engine(path, config, pool, "bench", NEVER, dram_bytes=1 << 28)
    builder = engine.request_builder()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.config.vocab_size
    rng = random.Random(seed)
    rows = []
    ids = iter(range(1 << 30))
    for n in sizes:
        if n + 1 > engine.max_model_len:
            print(f"  N={n}: skipped (the model's context is {engine.max_model_len})")
            continue
        prompt = [rng.randrange(3, vocab) for _ in range(n + 1)]

        def fresh(prompt=prompt):
            return builder.build(prompt, params, request_id=f"r{next(ids)}")

        engine.min_load_tokens = NEVER
        serve_once(engine, fresh())  # computes it; its blocks go to the store
        settle(engine)

        def timed(side: str, _repeat: int, n: int = n, fresh=fresh) -> float:
            before = engine.loaded_blocks
            engine.min_load_tokens = 0 if side == "load" else NEVER
            seconds = serve_once(engine, fresh())
            if side == "load":
                assert engine.loaded_blocks - before == n // engine.block_size, "not loaded"
            settle(engine)
            return seconds

        times = interleaved(("compute", "load"), repeats, timed, rotate=False)
        rows.append((n, statistics.median(times["compute"]), statistics.median(times["load"])))
        a, b = rows[-1][1:]
        print(f"  N={n}: compute {a * 1e3:.1f} ms, load {b * 1e3:.1f} ms", flush=True)
    engine.shutdown()
    from actors.serving.store_shards import stop

    stop(pool)
    return rows


def break_even(rows: list[tuple]) -> int | None:
    """The smallest N from which loading is faster at every larger N measured."""
    best = None
    for n, compute, load in reversed(rows):
        if load >= compute:
            break
        best = n
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--sizes", nargs="+", type=int, default=[16, 32, 48, 64, 128, 256, 512, 1024, 2048]
    )
    parser.add_argument("--repeats", type=int, default=5, help="A/B pairs per size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    summary = []
    with local_ray(num_cpus=1):
        for name in args.models:
            print(f"{name}: {args.repeats} interleaved pairs per N", flush=True)
            rows = measure(MODELS[name], args.sizes, args.repeats, args.seed)
            print(f"\n{name}")
            print("| N tokens | compute (ms) | load (ms) | load/compute |")
            print("|---:|---:|---:|---:|")
            for n, a, b in rows:
                print(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |")
            even = break_even(rows)
            print(f"break-even N ({name}): {even if even is not None else 'none measured'}\n")
            summary.append(f"{name} {even if even is not None else 'none'}")
    print("colocated_store break-even N: " + ", ".join(summary))


if __name__ == "__main__":
    main()
