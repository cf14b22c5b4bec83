"""The demo: generate from the built-in tiny model (or a model folder) with the Python API.

python -m actors.demo [--model DIR] [--prompt TEXT] [--max-tokens N] [--temperature T]
"""

from __future__ import annotations

import argparse
import time

from actors import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Hugging Face model folder (default: tiny)")
    ap.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts = args.prompt or ["Hello, Meridian!", "The quick brown fox", "Once upon a time"]
    llm = LLM(args.model)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for p, out in zip(prompts, outputs, strict=True):
        print(f"prompt: {p!r}\n  tokens: {out.token_ids}\n  text:   {out.text!r}")
    n = sum(len(o.token_ids) for o in outputs)
    print(f"{n} tokens in {dt:.2f} s; streaming the first prompt:")
    for delta in llm.stream(prompts[0], params):
        print(delta.token_ids[0] if delta.token_ids else "", end=" ", flush=True)
    print()


if __name__ == "__main__":
    main()
