"""What batch invariance costs: generate throughput with ``batch_invariant`` off and on.

Two in-process engines of the same model (default: the pretrained SmolLM2-135M-Instruct,
fp32) generate for ``--prompts`` prompts of about ``--prompt-len`` random tokens,
``--max-tokens`` tokens each (greedy, EOS ignored), all submitted at once. Off and on run
interleaved ``--rounds`` times, each round on fresh prompts (so no prefix-cache hits), the
same prompts for both; each mode's throughput is its median round.

    python bench/batch_invariance.py
    python bench/batch_invariance.py --dtype bfloat16

Last line: ``batch-invariant tok/s on/off: <ratio>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from actors import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    engines = {
        mode: LLM(args.model, dtype=args.dtype, batch_invariant=mode == "on")
        for mode in ("off", "on")
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        prompts = [
            [rng.randrange(5, 20000) for _ in range(args.prompt_len + rng.randrange(-20, 21))]
            for _ in range(args.prompts)
        ]
        for mode, llm in engines.items():
            began = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            took = time.perf_counter() - began
            tokens = sum(len(o.token_ids) for o in outs)
            rates[mode].append(tokens / took)
            rate = tokens / took
            print(f"round {round_} {mode:>3}: {tokens} tokens in {took:.2f} s ({rate:.1f} tok/s)")
    off, on = (statistics.median(rates[m]) for m in ("off", "on"))
    print(f"median tok/s: off {off:.1f}, on {on:.1f} ({args.model}, {args.dtype})")
    print(f"batch-invariant tok/s on/off: {on / off:.2f}")


if __name__ == "__main__":
    main()
