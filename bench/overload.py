"""SLO-aware admission under 10x overload: one colocated replica, in process.

The bench model of ``bench/bench_model.py`` (8 layers, hidden 512, fp32) in a
``ColocatedEngine`` driven by its ``EngineLoop`` (the replica's own path, no HTTP). First
a calibration: ``--clients`` closed-loop clients for ``--calibrate`` seconds measure the
completion rate the replica sustains; the SLO replica warms up the same way for half as
long. Then Poisson arrivals at ``--overload`` x that rate for ``--duration`` seconds, with
and without a TTFT SLO (``--slo`` seconds; interleaved, ``--repeats`` each, medians and
ranges). Prompts are random tokens, uniform in
[``--prompt-min``, ``--prompt-max``], ``--max-tokens`` each (EOS ignored). Without the SLO
the replica admits by queue length (``--max-waiting``, the serving default 256).

After arrivals stop, admitted requests get ``--drain`` seconds to reach their first token;
then the rest are aborted (a TTFT still pending counts as the time it had waited: a lower
bound, marked ``>=``). Recovery: the replica is idle again, every KV block free (its
integrity check), and a probe request's TTFT is printed next to the idle one.

    python bench/overload.py [--duration 15] [--repeats 2] [--slo 1.0]

Last line: ``admitted-ttft-p99/slo: <ratio>`` (the SLO runs' median; target <= 1.0).

``--pd`` runs Mooncake's P/D overload experiment instead (``bench/overload_pd.py``: a live
1 + 1 P/D deployment at 2x, admission baseline / early / predictive interleaved; its own
options follow).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.engine.events import Delta
from actors.serving.colocated_engine import ColocatedEngine
from actors.serving.engine_loop import EngineLoop
from bench.bench_model import MODEL, write_bench_model
from bench.interleave import schedule
from errors import OverloadedError
from policies.request import SamplingParams
from sim.metrics import percentile


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Run:
    slo: float | None
    offered: int = 0
    admitted: int = 0
    refused: int = 0
    retry_after: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    censored: int = 0  # admitted, no first token by the end (TTFT counted as waited so far)
    peak_rss: int = 0
    recovered: str = ""


class Bench:
    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        self.args = args
        self.engines: dict[float | None, tuple[ColocatedEngine, EngineLoop]] = {}
        for slo in (None, args.slo):
            engine = ColocatedEngine.build(
                model_dir,
                block_size=16,
                token_budget=args.token_budget,
                max_num_seqs=args.max_num_seqs,
                kv_cache_memory=256 << 20,
                ttft_slo=slo,
            )
            self.engines[slo] = (engine, EngineLoop(engine, args.max_waiting))
        self.builder = self.engines[None][0].request_builder()
        self.rng = random.Random(0)
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0)

    def request(self):
        n = self.rng.randint(self.args.prompt_min, self.args.prompt_max)
        tokens = [self.rng.randrange(3, MODEL["vocab_size"]) for _ in range(n)]
        return self.builder.build(tokens, self.params)

    async def one(self, loop: EngineLoop, run: Run | None, pending: dict) -> float | None:
        """Send one request; its TTFT (None if refused). Records into ``run``."""
        t0 = time.monotonic()
        task = asyncio.current_task()
        stream = loop.stream([self.request()])
        try:
            await anext(stream)
        except OverloadedError as e:
            if run is not None:
                run.refused += 1
                run.retry_after.append(e.retry_after or 0.0)
            return None
        if run is not None:
            run.admitted += 1
        pending[task] = t0
        ttft = None
        try:
            async for item in stream:
                if ttft is None and isinstance(item, Delta):
                    ttft = time.monotonic() - t0
                    pending.pop(task, None)
                    if run is not None:
                        run.ttft.append(ttft)
        finally:
            pending.pop(task, None)
            await stream.aclose()
        return ttft

    async def calibrate(self, slo: float | None = None, seconds: float | None = None) -> float:
        """Completions per second of ``--clients`` closed-loop clients (also warms an
        engine up: its step-cost fit and its measured prediction error)."""
        _, loop = self.engines[slo]
        done = 0
        stop = time.monotonic() + (seconds or self.args.calibrate)

        async def client() -> None:
            nonlocal done
            while time.monotonic() < stop:
                await self.one(loop, None, {})
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(self.args.clients)))
        return done / (time.monotonic() - t0)

    async def overload(self, slo: float | None, rate: float) -> Run:
        engine, loop = self.engines[slo]
        run = Run(slo)
        pending: dict = {}
        tasks: list[asyncio.Task] = []
        arrivals = random.Random(1)
        rss_stop = asyncio.Event()

        async def sample_rss() -> None:
            while not rss_stop.is_set():
                run.peak_rss = max(run.peak_rss, rss_bytes())
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample_rss())
        end = time.monotonic() + self.args.duration
        next_at = time.monotonic()
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(self.one(loop, run, pending)))
            run.offered += 1
            next_at += arrivals.expovariate(rate)
        drain_end = time.monotonic() + self.args.drain
        while pending and time.monotonic() < drain_end:
            await asyncio.sleep(0.05)
        now = time.monotonic()
        for t0 in list(pending.values()):  # no first token yet: censored
            run.ttft.append(now - t0)
            run.censored += 1
        for task in tasks:
            task.cancel()  # the client leaves: its stream aborts what still runs
        await asyncio.gather(*tasks, return_exceptions=True)
        rss_stop.set()
        await sampler
        run.recovered = await self.recovery(engine, loop)
        return run

    async def recovery(self, engine: ColocatedEngine, loop: EngineLoop) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            blocks = await asyncio.wrap_future(loop.call(lambda e: e.check_blocks()))
            idle = not await asyncio.wrap_future(loop.call(lambda e: e.has_unfinished()))
            if idle and not any(blocks.values()):
                break
            await asyncio.sleep(0.1)
        else:
            return "no (still busy after 60 s)"
        ttft = await self.one(loop, None, {})
        return "no (probe refused)" if ttft is None else f"yes (probe TTFT {ttft:.2f}s)"


def row(run: Run, slo: float) -> dict[str, float]:
    admitted = run.ttft
    return {
        "offered": run.offered,
        "admitted": run.admitted,
        "refused": run.refused,
        "p50": percentile(admitted, 50),
        "p99": percentile(admitted, 99),
        "p99/slo": percentile(admitted, 99) / slo,
        "censored": run.censored,
        "rss": run.peak_rss / (1 << 20),
        "retry": statistics.median(run.retry_after) if run.retry_after else float("nan"),
    }


async def amain(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_bench_model(Path(tmp) / "bench")
        bench = Bench(args, model_dir)
        idle = [await bench.one(bench.engines[None][1], None, {}) for _ in range(3)]
        idle_ttft = statistics.median(t for t in idle if t is not None)
        rate = await bench.calibrate()
        await bench.calibrate(args.slo, args.calibrate / 2)  # a replica that has served
        offered = args.overload * rate
        print(f"model: {MODEL}, fp32, torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(
            f"prompts {args.prompt_min}-{args.prompt_max} tokens, {args.max_tokens} new; "
            f"token_budget {args.token_budget}, max_num_seqs {args.max_num_seqs}, "
            f"max_waiting {args.max_waiting}; idle TTFT {idle_ttft:.2f}s"
        )
        print(
            f"sustained {rate:.2f} req/s ({args.clients} closed-loop clients, "
            f"{args.calibrate:.0f}s); offered {offered:.1f} req/s (x{args.overload:g}, Poisson) "
            f"for {args.duration:.0f}s; TTFT SLO {args.slo:g}s"
        )
        runs: dict[float | None, list[Run]] = {None: [], args.slo: []}
        for i, slo in schedule(list(runs), args.repeats):
            r = await bench.overload(slo, offered)
            runs[slo].append(r)
            label = "slo" if slo else "queue-length"
            d = row(r, args.slo)
            print(
                f"  run {i + 1} {label:>12}: offered {d['offered']}, 200 {d['admitted']}, "
                f"429 {d['refused']}, TTFT p50 {d['p50']:.2f}s p99 "
                f"{'>=' if r.censored else ''}{d['p99']:.2f}s, recovered {r.recovered}"
            )
        print()
        head = (
            f"{'admission':>12} {'offered':>8} {'200':>6} {'429':>6} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'p99/slo':>8} {'range':>12} {'Retry-After':>11} {'peak RSS':>9}"
        )
        print(head + "   (medians over runs; TTFT of admitted requests)")
        ratio = float("nan")
        for slo, label in ((None, "queue-length"), (args.slo, f"ttft<={args.slo:g}s")):
            rows = [row(r, args.slo) for r in runs[slo]]

            def med(key: str, rows: list = rows) -> float:
                return statistics.median(x[key] for x in rows)

            ratios = [x["p99/slo"] for x in rows]
            censored = any(r.censored for r in runs[slo])
            print(
                f"{label:>12} {med('offered'):>8.0f} {med('admitted'):>6.0f} "
                f"{med('refused'):>6.0f} {med('p50'):>8.2f}s "
                f"{'>=' if censored else '  '}{med('p99'):>6.2f}s {med('p99/slo'):>8.2f} "
                f"{min(ratios):>5.2f}-{max(ratios):<6.2f} {med('retry'):>10.1f}s "
                f"{med('rss'):>7.0f}MB"
            )
            if slo is not None:
                ratio = med("p99/slo")
        for _, loop in bench.engines.values():
            loop.shutdown()
        print(f"admitted-ttft-p99/slo: {ratio:.2f}")


def main() -> None:
    if "--pd" in sys.argv[1:]:
        from bench.overload_pd import main as pd_main

        pd_main([a for a in sys.argv[1:] if a != "--pd"])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slo", type=float, default=1.0, help="TTFT SLO, seconds")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--overload", type=float, default=10.0)
    ap.add_argument("--calibrate", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--drain", type=float, default=10.0)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-waiting", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
