"""Does decode keep its pace while a long prompt prefills? Colocated against prefill/decode.

The 8-layer/hidden-512 bench model (random weights, HF format, fp32). Eight short requests
decode; once each has 8 tokens, a 3,072-token prompt arrives (prefill chunk 512). For the
short requests we take the gaps between consecutive tokens, as produced (the replica's
clock): "before" while only they run, "during" from the long prompt's arrival to its first
token. Two deployments, interleaved (A, B, A, B, ...), the median of each figure reported:

- colocated: one replica (in this process, every core) runs everything; its mixed steps
  carry a 512-token chunk next to the decodes, so decode waits for the chunk;
- P/D: one prefill and one decode replica, each a Ray actor running its own loop on its
  own core (``pin_cores``): the decode replica never waits for a prefill step.

Target: P/D p99 during the long prefill at most 1.3x its p50 before. The last line is
``isolation: <P/D p99 during / P/D p50 before>``.

``--model M --dataset sharegpt``: a real model (a ``.gguf``, a folder or a packaged name
such as SmolLM2-135M-Instruct) and real prompts: ShareGPT first turns in its chat template
as the short prompts, a 3,072-token window of MT-bench's reference answers as the long one.

``--http``: the same scenario through the public API (``bench/pd_isolation_http.py``): a
colocated and a 1+1 P/D app, each started by ``serve run`` at defaults, HTTP streaming
clients (``--client-nice N``: in a session of their own at priority N,
``bench/client_session.py``); the last line is then
``isolation-http: <P/D p99 during / P/D p50 before>`` (target at most 1.5 on the 2-core
machine).

    python bench/pd_isolation.py [--repeats 3] [--model M --dataset sharegpt] [--http]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDClusterConfig
from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.replica_loop import split_cores
from actors.engine.sampling import SamplingParams
from bench.bench_model import write_bench_model
from bench.client_session import rerun_as_client
from bench.interleave import interleaved
from bench.local_serve import local_ray
from bench.real_prompts import add_model_options, chosen_model
from sim.metrics import percentile

ENGINE = dict(block_size=16, chunk_size=512, token_budget=1024, max_num_seqs=32)
SHORT, SHORT_PROMPT, LONG_PROMPT = 8, 64, 3072
BEFORE_TOKENS = 8
SHORT_PARAMS = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
LONG_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


Prompts = Callable[[int], tuple[list[list[int]], list[int]]]  # seed -> (short ones, long one)


def random_prompts(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    short = [[rng.randrange(3, 8000) for _ in range(SHORT_PROMPT)] for _ in range(SHORT)]
    return short, [rng.randrange(3, 8000) for _ in range(LONG_PROMPT)]


def real_prompts(model: str) -> Prompts:
    """ShareGPT first turns (chat template) as the short prompts; a window of MT-bench's
    reference answers, starting where the seed says, as the long one."""
    from bench.real_prompts import short_prompts, tokenizer
    from sim.datasets import mtbench_reference_text

    tok = tokenizer(model)
    text = tok.encode(mtbench_reference_text(), add_special_tokens=False)
    if len(text) <= LONG_PROMPT:
        raise ValueError(f"MT-bench's reference answers have only {len(text)} tokens")

    def make(seed: int) -> tuple[list[list[int]], list[int]]:
        start = random.Random(seed).randrange(len(text) - LONG_PROMPT)
        return short_prompts(tok, SHORT, seed), text[start : start + LONG_PROMPT]

    return make


def gaps(times: list[list[float]], start: float, end: float) -> tuple[list[float], list[float]]:
    """Inter-token gaps (s) of each request, split by when the later token came."""
    before, during = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:], strict=False):
            if b < start:
                before.append(b - a)
            elif b <= end:
                during.append(b - a)
    return before, during


def colocated_run(
    engine: ReplicaController, prompts: Prompts, seed: int
) -> tuple[list[float], list[float]]:
    engine.kv.evict_all_cached()
    short, long = prompts(seed)
    build = engine.request_builder()
    ids = [engine.add_request(build.build(p, SHORT_PARAMS)) for p in short]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    long_id, arrival, first = None, 0.0, None
    while first is None:
        for d in engine.step():
            now = time.monotonic()
            if d.request_id in times:
                times[d.request_id] += [now] * len(d.token_ids)
            elif d.request_id == long_id and first is None:
                first = now
        if long_id is None and min(len(t) for t in times.values()) >= BEFORE_TOKENS:
            long_id = engine.add_request(build.build(long, LONG_PARAMS))
            arrival = time.monotonic()
    for rid in [*ids, long_id]:
        engine.abort(rid)
        engine.release(rid)
    return gaps(list(times.values()), arrival, first)


def pd_run(pd: PDCluster, prompts: Prompts, seed: int) -> tuple[list[float], list[float]]:
    short, long = prompts(seed)
    ids = [pd.submit(p, SHORT_PARAMS) for p in short]
    long_id, arrival, first = None, 0.0, None
    while first is None:
        pd.poll(0.01)
        if long_id is None and min(len(pd.token_times(r)) for r in ids) >= BEFORE_TOKENS:
            long_id, arrival = pd.submit(long, LONG_PARAMS), time.monotonic()
        if long_id is not None and pd.token_times(long_id):
            first = pd.token_times(long_id)[0]
    times = [pd.token_times(r) for r in ids]
    for rid in [*ids, long_id]:
        pd.abort(rid)
        pd.release(rid)
    return gaps(times, arrival, first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pin-client", action=argparse.BooleanOptionalAction, default=True)
    add_model_options(
        ap, "sharegpt: real prompts (ShareGPT first turns, MT-bench text), needs --model"
    )
    ap.add_argument("--http", action="store_true", help="through serve run and HTTP clients")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="with --http: where the P/D app's time goes (bench/pd_profile.py)",
    )
    ap.add_argument(
        "--client-nice",
        type=int,
        default=0,
        help="with --http (the apps in sessions of their own): run the clients in their own "
        "session at this priority, e.g. -10 (bench/client_session.py); 0: as started",
    )
    args = ap.parse_args()
    if args.http:
        status = rerun_as_client(args.client_nice)
        if status is not None:
            sys.exit(status)
    model_dir = chosen_model(ap, args) or write_bench_model(Path(tempfile.mkdtemp()) / "bench")
    prompts = real_prompts(args.model) if args.dataset != "random" else random_prompts
    if args.http:
        from bench.pd_isolation_http import run_http

        limit = SHORT_PARAMS.max_tokens
        med = run_http(
            model_dir, prompts, gaps, percentile, args.repeats, limit, BEFORE_TOKENS, args.profile
        )
        report(med, args.repeats, "isolation-http")
        return
    with local_ray(num_cpus=2):
        colocated = ReplicaController.build(model_dir, dtype=torch.float32, **ENGINE)
        engine = EngineConfig(dtype=torch.float32, **ENGINE)
        pd = PDCluster(PDClusterConfig(str(model_dir), engine, pin_cores=True))
        if args.pin_client and hasattr(os, "sched_setaffinity"):
            # this process is the P/D deployment's client: keep it off the decode replica's cores
            os.sched_setaffinity(0, split_cores(1, 1)["p0"])
        for seed in (98, 99):  # warm-up: first-use costs (new batch shapes) stay out of the figures
            colocated_run(colocated, prompts, seed)
            pd_run(pd, prompts, seed)

        def one(name: str, i: int) -> tuple[float, float, float, float]:
            if name == "colocated":
                before, during = colocated_run(colocated, prompts, i)
            else:
                before, during = pd_run(pd, prompts, i)
            figs = (
                percentile(before, 50),
                percentile(before, 99),
                percentile(during, 50),
                percentile(during, 99),
            )
            print(f"run {i} {name:9s} " + " ".join(f"{x * 1e3:7.1f}" for x in figs), flush=True)
            return figs

        runs = interleaved(("colocated", "P/D"), args.repeats, one, rotate=False)
        med = {
            name: [statistics.median(r[k] for r in rows) for k in range(4)]
            for name, rows in runs.items()
        }
        pd.shutdown()
        colocated.shutdown()
        report(med, args.repeats, "isolation")


def report(med: dict[str, list[float]], repeats: int, label: str) -> None:
    """The table of medians (seconds in, ms out) and the last line."""
    print(f"\ndecode inter-token time of {SHORT} short requests, ms (median of {repeats})")
    print(
        f"{'':10s} {'p50 before':>11s} {'p99 before':>11s} {'p50 during':>11s} {'p99 during':>11s}"
    )
    for name, figs in med.items():
        print(f"{name:10s} " + " ".join(f"{x * 1e3:11.1f}" for x in figs))
    print(f"{label}: {med['P/D'][3] / med['P/D'][0]:.2f}")


if __name__ == "__main__":
    main()
