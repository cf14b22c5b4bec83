"""SkyWalker's cost experiment live at reduced scale: the global-peak provisioning with and
without forwarding, against region-local serving at the region-peak provisioning.

Three regions (us, eu, asia) in one process, as in ``bench/regions.py`` (its replica
builder and inter-region delays: us-eu 40 ms, us-asia 80 ms, eu-asia 100 ms), each region's
replicas behind its own ``actors.regions.BalancerRuntime`` running
``policies.region_balancer``.

Workload, open loop: Poisson arrivals at ``--rate`` req/s in all, each one's region drawn
in proportion to ``sim.regional_workload.region_weights`` at its time (the simulator's
diurnal split: region ``k`` weighs ``1 + amplitude cos(2 pi (t / period - k / 3))``, peaks a
third of a ``--period`` apart, the sum flat). A request is ``--prompt`` random tokens and
``--max-tokens`` greedy output tokens; the same arrivals in every run. SLO: TTFT at the
client (from the call to the region's balancer to the first token) within ``--slo`` s;
a region's attainment is the share of its clients' requests that met it.

Capacity is queueing-bound, not CPU-bound: a replica runs at most ``--max-num-seqs``
requests at once, and each engine step lasts at least ``--step-ms`` (a step hook sleeps
out the rest, standing for each replica's own accelerator), well above the step's CPU time,
so three replicas serve three times one replica's rate on this machine's shared cores
(``--capacity`` measures both).

Setups, interleaved (``--repeats`` rounds, fresh engines per run):
- global-forwarding: one replica per region (the global-peak provisioning), SkyWalker
  (selective pushing, forwarding to peers);
- global-local: one replica per region, forwarding off (region-local serving);
- peak-local: ``--peak-replicas`` per region (the region-peak provisioning), forwarding off.

Medians over the rounds of each region's attainment and P90 TTFT. The last line is
``skywalker live attainment global-forwarding/global-local: <ratio>``, the ratio of the
two setups' lowest region attainment (medians).

    python bench/regions_cost.py --capacity      # one replica's rate, then three at once
    python bench/regions_cost.py [--load 2.0] [--period 45] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.engine.worker_hooks import WorkerHooks
from actors.regions.runtime import BalancerRuntime, LocalReplica
from bench.bench_model import MODEL, write_bench_model
from bench.interleave import interleaved
from bench.regions import REGIONS, build_replica, connect_all, delay
from policies.region_balancer import BalancerConfig, RegionBalancer
from policies.request import SamplingParams
from sim.metrics import percentile
from sim.regional_workload import diurnal_arrivals

# name -> (replicas per region, forwarding)
SETUPS = {
    "global-forwarding": (1, True),
    "global-local": (1, False),
    "peak-local": (2, False),
}


def attainment(ttfts: list[tuple[str, float | None]], slo: float) -> dict[str, float]:
    """Region -> share of its requests whose TTFT (None: not answered) is within ``slo``."""
    sent = dict.fromkeys(REGIONS, 0)
    met = dict.fromkeys(REGIONS, 0)
    for region, ttft in ttfts:
        sent[region] += 1
        met[region] += ttft is not None and ttft <= slo
    return {g: met[g] / sent[g] if sent[g] else 1.0 for g in REGIONS}


class StepFloor:
    """A step hook that makes each engine step last at least ``seconds`` (wall time)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._began = 0.0

    def begin_step(self, plan: Any, kv_caches: Any) -> None:
        self._began = time.monotonic()

    def after_layer(self, layer: int, kv_cache: Any) -> None:
        pass

    def end_step(self, plan: Any, kv_caches: Any) -> None:
        left = self.seconds - (time.monotonic() - self._began)
        if left > 0:
            time.sleep(left)


@dataclass
class Run:
    setup: str
    ttfts: list[tuple[str, float | None]] = field(default_factory=list)
    forwarded: int = 0
    elapsed: float = 0.0

    def attainment(self, slo: float) -> dict[str, float]:
        return attainment(self.ttfts, slo)

    def p90(self, region: str) -> float:
        xs = [t for g, t in self.ttfts if g == region and t is not None]
        return percentile(xs, 90)


class CostBench:
    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        self.args = args
        self.model_dir = model_dir
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0)

    def replica(self, name: str) -> tuple[Any, LocalReplica]:
        hooks = WorkerHooks(step=StepFloor(self.args.step_ms / 1000))
        engine, loop = build_replica(self.model_dir, self.args, hooks)
        return engine, LocalReplica(name, loop)

    def prompt(self, k: int) -> list[int]:
        rng = random.Random(f"prompt/{k}")
        return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(self.args.prompt)]

    async def run_setup(self, name: str, arrivals: list[tuple[float, str]]) -> Run:
        a = self.args
        per_region, forward = SETUPS[name]
        if name == "peak-local":
            per_region = a.peak_replicas
        built = {g: [self.replica(f"{g}{i}") for i in range(per_region)] for g in REGIONS}
        builder = built["us"][0][0].request_builder()
        lbs = {
            g: BalancerRuntime(
                RegionBalancer(f"lb-{g}", g, BalancerConfig(forward=forward)),
                [r for _, r in built[g]],
                delay,
                a.probe_interval,
            )
            for g in REGIONS
        }
        connect_all(list(lbs.values()))
        for lb in lbs.values():
            lb.start()
        run = Run(name)

        async def one(k: int, at: float, region: str) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            rid = f"r{k}"
            req = builder.build(self.prompt(k), self.params, request_id=rid)
            sent = time.monotonic()
            try:
                res = await lbs[region].handle(req, session_id=rid)
            except Exception as e:  # counted as a miss, reported
                print(f"  {rid} ({region}) failed: {e!r}", flush=True)
                run.ttfts.append((region, None))
                return
            run.ttfts.append((region, res.first_token_at - sent))
            run.forwarded += res.forwarded

        t0 = time.monotonic()
        try:
            await asyncio.gather(*(one(k, at, g) for k, (at, g) in enumerate(arrivals)))
        finally:
            run.elapsed = time.monotonic() - t0
            for lb in lbs.values():
                await lb.close()
            for _, r in (x for reps in built.values() for x in reps):
                r.loop.shutdown()
        return run

    async def saturate(self, replicas: int, n: int) -> float:
        """Requests per second of ``replicas`` replicas, ``n`` requests queued on each at once."""
        built = [self.replica(f"c{i}") for i in range(replicas)]
        builder = built[0][0].request_builder()
        t0 = time.monotonic()
        try:
            await asyncio.gather(
                *(
                    r.run(builder.build(self.prompt(k), self.params, request_id=f"c{i}/{k}"), _noop)
                    for i, (_, r) in enumerate(built)
                    for k in range(n)
                )
            )
        finally:
            elapsed = time.monotonic() - t0
            for _, r in built:
                r.loop.shutdown()
        return replicas * n / elapsed


def _noop() -> None:
    pass


def report(runs: dict[str, list[Run]], slo: float) -> dict[str, float]:
    """Prints the medians' table; returns each setup's lowest region attainment (median)."""
    print("setup              attainment us/eu/asia   TTFT p90 us/eu/asia (s)  forwarded")
    lowest = {}
    for name, rs in runs.items():
        att = {g: statistics.median(r.attainment(slo)[g] for r in rs) for g in REGIONS}
        p90 = {g: statistics.median(r.p90(g) for r in rs) for g in REGIONS}
        fwd = statistics.median(r.forwarded for r in rs)
        lowest[name] = min(att.values())
        print(
            f"{name:17s}  {'/'.join(f'{att[g]:.2f}' for g in REGIONS):22s}  "
            f"{'/'.join(f'{p90[g]:.2f}' for g in REGIONS):23s}  {fwd:g}"
        )
    return lowest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--capacity", action="store_true", help="measure replica capacity only")
    p.add_argument(
        "--rate", type=float, default=0.0, help="arrivals per second in all (0: --load x capacity)"
    )
    p.add_argument("--load", type=float, default=2.0, help="rate over one replica's capacity")
    p.add_argument("--saturate", type=int, default=40, help="requests per replica, capacity")
    p.add_argument("--period", type=float, default=45.0, help="seconds of one diurnal period")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per run")
    p.add_argument("--amplitude", type=float, default=0.8)
    p.add_argument("--slo", type=float, default=2.0, help="TTFT SLO at the client, seconds")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--peak-replicas", type=int, default=2, help="per region, peak-local")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=2, help="batch size of a replica")
    p.add_argument("--step-ms", type=float, default=100.0, help="least wall time of a step")
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--probe-interval", type=float, default=0.1)
    p.add_argument("--kv-mib", type=int, default=16, help="KV cache per replica, MiB")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        bench = CostBench(a, write_bench_model(Path(tmp) / "bench"))
        if a.capacity or a.rate <= 0:
            one = asyncio.run(bench.saturate(1, a.saturate))
            three = asyncio.run(bench.saturate(3, a.saturate))
            print(
                f"capacity: one replica {one:.2f} req/s, three at once {three:.2f} req/s "
                f"(three/one {three / one:.2f})",
                flush=True,
            )
            if a.capacity:
                return
            a.rate = round(a.load * one, 1)
        arrivals = diurnal_arrivals(a.rate, a.duration, REGIONS, a.period, a.amplitude, a.seed)
        print(
            f"{len(arrivals)} arrivals over {a.duration:g} s (Poisson {a.rate:g} req/s, period "
            f"{a.period:g} s, amplitude {a.amplitude:g}): "
            + ", ".join(f"{g} {sum(1 for _, x in arrivals if x == g)}" for g in REGIONS)
            + f"; SLO TTFT <= {a.slo:g} s; step >= {a.step_ms:g} ms, "
            f"max_num_seqs {a.max_num_seqs}",
            flush=True,
        )

        def setup_run(name: str, rep: int) -> Run:
            r = asyncio.run(bench.run_setup(name, arrivals))
            att = r.attainment(a.slo)
            print(
                f"round {rep} {name:17s}: attainment "
                + "/".join(f"{att[g]:.2f}" for g in REGIONS)
                + ", TTFT p90 "
                + "/".join(f"{r.p90(g):.2f}" for g in REGIONS)
                + f" s, forwarded {r.forwarded}, {r.elapsed:.1f} s",
                flush=True,
            )
            return r

        runs = interleaved(list(SETUPS), a.repeats, setup_run, rotate=False)
    lowest = report(runs, a.slo)
    base = lowest["global-local"]
    ratio = f"{lowest['global-forwarding'] / base:.2f}" if base else "inf"
    print(f"skywalker live attainment global-forwarding/global-local: {ratio}")


if __name__ == "__main__":
    main()
