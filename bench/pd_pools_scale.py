"""``bench/pd_pools.py --scale``: a load step that needs a second prefill replica, and then
does not, against one P/D cluster whose prefill pool scales (``prefill.autoscaling``).

The app: the two-raylet cluster of ``bench/pd_pools.py``, one disaggregated group of one
cluster (``num_replicas: 1``), ``num_prefill: 1`` scaled within [1, 2] on queued prefill
tokens (``--target`` per replica, ``--up-delay`` / ``--down-delay``), one decode replica
(its pool scaled within [1, 2] on KV use too, so both pools' decisions show), the store.

Load, closed loop over the OpenAI completions API (streamed, greedy, ``ignore_eos``):
``--before`` seconds of one client sending short prompts, ``--during`` seconds of
``--clients`` clients sending long prompts (the step), ``--after`` seconds of one client
with short prompts again, until the prefill pool is back at one replica (at most
``--settle`` seconds more). ``/metrics`` is read every 0.5 s for each pool's size
(``meridian:pd_pool_replicas``) and what its load needs at the target
(``meridian:pd_pool_scaling_need``, labelled with the signal).

Printed: each change of a pool's size (time from the start, pool, old -> new, signal and
need at that moment), TTFT p50 / p99 per phase, requests sent and failed per phase.
Last line: ``pd-pools scale failed requests: <n>`` (must be 0).
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.pd_apps import model_name, running_apps, samples
from bench.sse import StreamCut, StreamError, sse_json
from sim.metrics import percentile


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    scaling = {"min_replicas": 1, "max_replicas": 2}
    delays = {"upscale_delay_s": args.up_delay, "downscale_delay_s": args.down_delay}
    group = {
        "name": "pd",
        "num_replicas": 1,
        "num_prefill": 1,
        "num_decode": 1,
        "engine": {"kv_cache_memory": args.kv_mib << 20, "token_budget": args.token_budget},
        "prefill": {"autoscaling": {**scaling, **delays, "target": args.target}},
        "decode": {"autoscaling": {**scaling, **delays, "target": 0.8}},
        "store": {"dram_bytes": args.store_mib << 20},
    }
    model = None if args.model == "tiny" else args.model
    out: dict[str, Any] = {"model": model, "groups": [group]}
    if model is not None:
        out["model_name"] = model_name(args)
    return out


@dataclass
class Sample:
    phase: str
    ttft: float | None  # None: failed
    why: str = ""


@dataclass
class Watch:
    """Pool sizes and needs read from /metrics, kept only when a size changes."""

    start: float
    sizes: dict[str, int] = field(default_factory=dict)
    needs: dict[str, tuple[str, float]] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)

    def read(self, text: str) -> None:
        needs: dict[str, tuple[str, float]] = {}
        sizes: dict[str, int] = {}
        for labels, n in samples(text, "meridian:pd_pool_replicas"):
            sizes[labels["pool"]] = int(n)
        for labels, need in samples(text, "meridian:pd_pool_scaling_need"):
            needs[labels["pool"]] = (labels["signal"], need)
        self.needs.update(needs)
        for pool, n in sizes.items():
            old = self.sizes.get(pool)
            if old is not None and old != n:
                signal, need = self.needs.get(pool, ("?", float("nan")))
                t = time.monotonic() - self.start
                self.changes.append(
                    f"{t:7.1f} s  {pool:7}  {old} -> {n}  ({signal} needs {need:.2f} replicas)"
                )
            self.sizes[pool] = n


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]  # in every model's vocabulary


def one(http: httpx.Client, model: str, tokens: list[int], max_tokens: int) -> Sample:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.monotonic()
    first: float | None = None
    try:
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Sample("", None, f"HTTP {r.status_code}")
            for _ in sse_json(r.iter_lines()):
                if first is None:
                    first = time.monotonic()
    except httpx.HTTPError as e:
        return Sample("", None, type(e).__name__)
    except (StreamError, StreamCut) as e:
        return Sample("", None, type(e).__name__)
    return Sample("", None if first is None else first - sent, "" if first else "no token")


def run(url: str, args: argparse.Namespace) -> tuple[list[Sample], Watch]:
    model = model_name(args)
    start = time.monotonic()
    watch = Watch(start)
    phase = ["before"]
    stop = threading.Event()
    samples: list[Sample] = []
    lock = threading.Lock()

    def client(seed: int, step_only: bool) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=300) as http:
            while not stop.is_set():
                now = phase[0]
                if step_only and now != "during":
                    if now == "after":
                        return
                    time.sleep(0.05)
                    continue
                n = args.long_prompt if now == "during" else args.short_prompt
                s = one(http, model, prompt(rng, n), args.max_tokens)
                s.phase = now
                with lock:
                    samples.append(s)

    threads = [threading.Thread(target=client, args=(0, False), daemon=True)]
    threads += [
        threading.Thread(target=client, args=(i, True), daemon=True) for i in range(1, args.clients)
    ]
    for t in threads:
        t.start()
    ends = {"before": args.before, "during": args.before + args.during}
    with httpx.Client(base_url=url, timeout=30) as http:
        while True:
            elapsed = time.monotonic() - start
            with lock:
                phase[0] = next((p for p, end in ends.items() if elapsed < end), "after")
            try:
                watch.read(http.get("/metrics").text)
            except httpx.HTTPError:
                pass
            after_s = elapsed - ends["during"]
            settled = watch.sizes.get("prefill") == 1 and after_s >= args.after
            if phase[0] == "after" and (settled or after_s >= args.after + args.settle):
                break
            time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=300)
    return samples, watch


def report(samples: list[Sample], watch: Watch, args: argparse.Namespace) -> None:
    print(f"prefill pool target {args.target:.0f} queued tokens per replica, delays "
          f"up {args.up_delay:.0f} s / down {args.down_delay:.0f} s; {args.clients} clients "
          f"during the step ({args.long_prompt}-token prompts), 1 before and after "
          f"({args.short_prompt}-token prompts)")  # fmt: skip
    print("\npool size changes (time since the load started):")
    for line in watch.changes or ["  none"]:
        print("  " + line)
    print("\n| phase | requests | failed | TTFT p50 (ms) | TTFT p99 (ms) |\n|---|---|---|---|---|")
    for phase in ("before", "during", "after"):
        mine = [s for s in samples if s.phase == phase]
        ok = [s.ttft for s in mine if s.ttft is not None]
        p50 = f"{percentile(ok, 50) * 1e3:.0f}" if ok else "-"
        p99 = f"{percentile(ok, 99) * 1e3:.0f}" if ok else "-"
        print(f"| {phase} | {len(mine)} | {len(mine) - len(ok)} | {p50} | {p99} |")
    failed = [s for s in samples if s.ttft is None]
    for why in sorted({s.why for s in failed}):
        print(f"  failed: {why} x{sum(1 for s in failed if s.why == why)}")
    print(f"pd-pools scale failed requests: {len(failed)}")


def add_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--scale")
    g.add_argument("--target", type=float, default=1024.0, help="queued prefill tokens/replica")
    g.add_argument("--up-delay", type=float, default=3.0)
    g.add_argument("--down-delay", type=float, default=15.0)
    g.add_argument("--clients", type=int, default=6)
    g.add_argument("--before", type=float, default=20.0)
    g.add_argument("--during", type=float, default=60.0)
    g.add_argument("--after", type=float, default=20.0)
    g.add_argument("--settle", type=float, default=120.0)
    g.add_argument("--long-prompt", type=int, default=768)
    g.add_argument("--short-prompt", type=int, default=64)


def main(args: argparse.Namespace) -> None:
    with running_apps({"scale": app_args(args)}, args) as urls:
        samples, watch = run(urls["scale"], args)
    report(samples, watch, args)
