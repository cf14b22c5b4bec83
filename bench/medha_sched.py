"""Medha's scheduling on the live CPU engine: short requests behind one very long prompt.

The 8-layer, hidden-512 bench model (``bench/bench_model.py``, positions raised to fit the
long prompt), one in-process ``ReplicaController`` per configuration, fp32, greedy. The
workload, open loop on the wall clock: one ``--long``-token prompt at t=0, then a short
request (``--short`` prompt tokens, ``--short-new`` new tokens) every ``--gap`` seconds,
``--shorts`` of them. Two configurations, run interleaved (A, B, A, B, ...; the first
two pairs warm up and fit B's runtime predictor from its measured steps, not counted):

  fcfs  FCFS with fixed chunks: ``--chunk`` tokens per step, the token budget the same
        (Sarathi-Serve's setting: a running prefill takes every step's budget)
  ilrs  ILRS (relative slack, re-sorted every step) + adaptive chunks under a target step
        time of ``--target`` seconds + prefill-prefill batching (short prefills' share at
        most ``--share``), deadlines derived from predicted prefill time (3x, at least
        ``--min-slo`` seconds); the torch engine, one thread (``--threads``)

Reported per configuration, medians over the counted repeats: the short requests' p50 and
p99 TTFT and their mean time per output token (TPOT, first token to last), and the long
request's TTFT. Every request's tokens must equal across configurations (greedy: the
schedule may change, the tokens may not).

``--model M --dataset sharegpt``: a real model (a ``.gguf``, a folder or a packaged name
such as SmolLM2-135M-Instruct) and real prompts: ShareGPT first turns in its chat template
as the short requests (their own lengths; ``--short`` is then unused) and a ``--long``-token
window of MT-bench's reference answers as the long prompt.

    python bench/medha_sched.py [--repeats 3] [--long 4096] [--shorts 16] [--gap 0.25]
    python bench/medha_sched.py --model SmolLM2-135M-Instruct --dataset sharegpt

Last line: ``short-ttft-p50 fcfs/ilrs: <ratio>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from bench.bench_model import MODEL
from bench.interleave import interleaved, medians
from bench.real_prompts import add_model_options, chosen_model
from models import write_tiny_model
from sim.metrics import percentile

WARMUP = 2  # interleaved pairs run first and not counted


def random_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The long prompt, then the short ones: random ids of the bench model's vocabulary."""
    rng = random.Random(0)
    vocab = MODEL["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.long)]]
    return prompts + [
        [rng.randrange(3, vocab) for _ in range(args.short)] for _ in range(args.shorts)
    ]


def real_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The long prompt (MT-bench's reference answers, a window from the start), then
    ShareGPT first turns in the model's chat template."""
    from bench.real_prompts import short_prompts, tokenizer
    from sim.datasets import mtbench_reference_text

    tok = tokenizer(args.model)
    text = tok.encode(mtbench_reference_text(), add_special_tokens=False)
    if len(text) < args.long:
        raise SystemExit(f"MT-bench's reference answers have only {len(text)} tokens")
    return [text[: args.long], *short_prompts(tok, args.shorts, seed=0)]


def run_once(engine: ReplicaController, args, prompts: list[list[int]]) -> dict:
    """Feed the workload on the wall clock; step the engine until every request ends."""
    builder = engine.request_builder()
    long_params = SamplingParams(max_tokens=args.long_new, temperature=0.0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=args.short_new, temperature=0.0, ignore_eos=True)
    arrivals = [0.0] + [args.first + i * args.gap for i in range(args.shorts)]
    start = time.monotonic()
    ids: list[str] = []
    nxt = 0
    while nxt < len(arrivals) or engine.has_unfinished():
        now = time.monotonic() - start
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            params = long_params if nxt == 0 else short_params
            req = builder.build(prompts[nxt], params, arrival_time=start + arrivals[nxt])
            ids.append(engine.add_request(req))
            nxt += 1
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(max(0.0, min(0.01, arrivals[nxt] - now)))
    outs = [engine.release(rid) for rid in ids]
    ttft = [o.first_token_time - o.arrival_time for o in outs]
    tpot = [
        (o.finish_time - o.first_token_time) / (len(o.token_ids) - 1)
        for o in outs[1:]
        if len(o.token_ids) > 1
    ]
    return {
        "tokens": [o.token_ids for o in outs],
        "short_p50": percentile(ttft[1:], 50),
        "short_p99": percentile(ttft[1:], 99),
        "tpot": statistics.mean(tpot),
        "long_ttft": ttft[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--long-new", type=int, default=4)
    ap.add_argument("--shorts", type=int, default=16)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--short-new", type=int, default=8)
    ap.add_argument("--first", type=float, default=0.2, help="first short arrival (s)")
    ap.add_argument("--gap", type=float, default=0.25)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--target", type=float, default=0.1)
    ap.add_argument("--share", type=float, default=0.5)
    ap.add_argument("--min-slo", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    add_model_options(ap, "sharegpt: ShareGPT first turns and MT-bench text; needs --model")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    real = chosen_model(ap, args)
    prompts = real_prompts(args) if real else random_prompts(args)
    common = dict(block_size=16, enable_prefix_caching=False, max_num_seqs=64)
    configs = {
        "fcfs": dict(common, chunk_size=args.chunk, token_budget=args.chunk),
        "ilrs": dict(
            common,
            token_budget=4096,
            scheduling="ilrs",
            target_batch_time=args.target,
            max_prefill_share=args.share,
            min_ttft_slo=args.min_slo,
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = dict(MODEL, max_position_embeddings=max(8192, 2 * args.long))
        folder = real or write_tiny_model(Path(tmp) / "m", kind="dense", seed=0, **model)
        engines = {name: ReplicaController.build(folder, **cfg) for name, cfg in configs.items()}
        t0 = time.monotonic()

        def one(name: str, rep: int) -> dict:
            r = run_once(engines[name], args, prompts)
            print(
                f"{'warm-up' if rep < 0 else f'repeat {rep + 1}'} {name}: short TTFT p50 "
                f"{r['short_p50']:.3f}s p99 {r['short_p99']:.3f}s, TPOT {r['tpot']:.4f}s, "
                f"long TTFT {r['long_ttft']:.2f}s",
                flush=True,
            )
            return r

        # warm-up pairs first (they fit ilrs), not counted
        results = interleaved(list(engines), args.repeats, one, rotate=False, warmup=WARMUP)
        pred = engines["ilrs"].predictor
        assert pred is not None
        print(f"ilrs predictor: {pred.describe()} ({pred.fitter.num_fits['prefill']} fits)")
        differ = [
            f"{name} repeat {k + 1}"
            for name in configs
            for k, r in enumerate(results[name])
            if r["tokens"] != results["fcfs"][0]["tokens"]
        ]
        same = f"tokens DIFFER from fcfs's first run in: {differ}" if differ else "tokens identical"
        print(f"{same} across configurations and repeats; {time.monotonic() - t0:.0f}s")
        med = {
            name: medians(rs, [k for k in rs[0] if k != "tokens"]) for name, rs in results.items()
        }
        for name, m in med.items():
            print(
                f"{name}: short TTFT p50 {m['short_p50']:.3f}s p99 {m['short_p99']:.3f}s, "
                f"short TPOT {m['tpot'] * 1e3:.1f}ms, long TTFT {m['long_ttft']:.2f}s (medians)"
            )
        f, i = med["fcfs"], med["ilrs"]
        print(f"short-ttft-p99 fcfs/ilrs: {f['short_p99'] / i['short_p99']:.2f}")
        print(f"short-tpot fcfs/ilrs: {f['tpot'] / i['tpot']:.2f}")
        print(f"long-ttft fcfs/ilrs: {f['long_ttft'] / i['long_ttft']:.2f}")
        print(f"short-ttft-p50 fcfs/ilrs: {f['short_p50'] / i['short_p50']:.2f}")
        if differ:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
