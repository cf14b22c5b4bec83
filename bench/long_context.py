"""One long prompt on the tiny model: single process against sequence pipelining x KV
parallelism on a local Ray cluster; identical greedy tokens, TTFT per layout.

The tiny model (4 layers, 4 query and 2 KV heads; positions raised to fit the prompt),
float64 so an argmax tie cannot flip between summation orders, one greedy request of
``--tokens`` prompt tokens and ``--new`` new ones, chunks of ``--chunk`` tokens. The
``spp x kvp`` layout splits the layers over ``spp`` pipeline stages (chunks of the prompt
overlap across them) and the request's KV over ``kvp`` ranks (``kvp_rank_tokens`` half the
context each, so the prompt spills onto the second rank halfway).

    python bench/long_context.py [--tokens 100000] [--spp 2] [--kvp 2]

Last line: ``ttft single/spp<S>xkvp<K>: <ratio>``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from bench.local_serve import local_ray
from models import write_tiny_model

BLOCK = 16
CHANNEL_ENV = {"RAY_CGRAPH_buffer_size_bytes": str(1 << 24)}


def run(folder: Path, prompt: list[int], args, **layout: int) -> tuple[list[int], float]:
    kvp = layout.get("kvp", 1)
    per_rank = -(-(len(prompt) + args.new) // kvp)
    rank_tokens = -(-per_rank // BLOCK) * BLOCK
    engine = ReplicaController.build(
        folder,
        dtype=torch.float64,
        block_size=BLOCK,
        chunk_size=args.chunk,
        token_budget=args.chunk,
        num_blocks=rank_tokens // BLOCK + 4,
        kvp_rank_tokens=rank_tokens if kvp > 1 else None,
        enable_prefix_caching=False,
        **layout,
    )
    try:
        builder = engine.request_builder()
        params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
        rid = engine.add_request(builder.build(prompt, params))
        while engine.has_unfinished():
            engine.step()
        out = engine.release(rid)
        assert out.first_token_time is not None
        return out.token_ids, out.first_token_time - out.arrival_time
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--spp", type=int, default=2)
    ap.add_argument("--kvp", type=int, default=2)
    args = ap.parse_args()
    with local_ray(CHANNEL_ENV, num_cpus=2):
        with tempfile.TemporaryDirectory() as tmp:
            positions = 1 << (args.tokens + args.new).bit_length()
            folder = write_tiny_model(Path(tmp) / "m", max_position_embeddings=positions)
            prompt = [3 + (i * 7919) % 400 for i in range(args.tokens)]
            t0 = time.monotonic()
            ref, ttft_ref = run(folder, prompt, args)
            print(f"single process: TTFT {ttft_ref:.1f}s, tokens {ref}", flush=True)
            layout = f"spp{args.spp}xkvp{args.kvp}"
            toks, ttft = run(folder, prompt, args, spp=args.spp, kvp=args.kvp)
            print(f"{layout}: TTFT {ttft:.1f}s, tokens {toks}", flush=True)
            if toks != ref:
                raise SystemExit(f"{layout}: tokens differ from the single process")
            print(f"tokens identical; {time.monotonic() - t0:.0f}s in all")
            print(f"ttft single/{layout}: {ttft_ref / ttft:.2f}")


if __name__ == "__main__":
    main()
