"""Mooncake's overload experiment, live: a 1 prefill + 1 decode deployment under 2x load,
three admission modes interleaved (``bench/overload.py --pd``).

One ``PDCluster`` of the bench model (``bench/bench_model.py``) on a local Ray cluster
(prefill and decode on their own cores, ``pin_cores``). First the idle TTFT and TBT of one
request, from which the SLOs follow (``--ttft-slo-x`` and ``--tbt-slo-x`` times idle, or
``--ttft-slo`` / ``--tbt-slo`` seconds); then ``--clients`` closed-loop clients measure the
completion rate the deployment sustains. Each run sends Poisson arrivals at ``--overload``
x that rate for ``--duration`` seconds under one mode of the Conductor's admission, the
same arrivals and prompts in every mode; modes are interleaved, ``--repeats`` times:

- *baseline*: each pool judges its own load when the request reaches it, as the paper's
  baseline: the TTFT at arrival (the Conductor, ``early`` with no TBT bound), decode's TBT
  only once the prompt's KV has landed there (below);
- *early*: the Conductor's early rejection, TTFT and TBT judged at arrival;
- *predictive*: the default, decode's TBT judged at the moment the request would reach it.

In every mode the decode pool still guards itself: when a request's first token comes back
from decode, the TBT of the batch it joins there (the requests decoding on that instance,
itself included) above the SLO refuses it; its prompt was computed for nothing (*wasted
prefill tokens*). That TBT is priced by the step-time model fitted from the instance's
measured steps (each the gap between tokens it delivered): the model the Conductor
predicts with, so prediction and check differ only in the batch foreseen and in refits
between admission and arrival; against those the Conductor judges its prediction times a
margin, the 0.9 quantile of recent decode steps' measured / predicted time (``--trace``
prints both per request, the margin, and the gap measured last). Goodput: requests that
finished with TTFT <= SLO and mean time between tokens <= SLO, per second of arrivals.
After arrivals stop, admitted requests get ``--drain`` seconds; the rest are aborted (not
good).

    python bench/overload.py --pd [--duration 20] [--repeats 1]

Last line: ``pd-overload goodput predictive/baseline: <ratio>`` (medians over repeats;
target >= 1.1, and predictive's wasted prefill tokens <= 0.2x the baseline's).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDClusterConfig
from actors.disagg.conductor import (
    ConductorOptions,
    RequestRejected,
    default_conductor,
)
from actors.engine.config import EngineConfig
from actors.engine.sampling import SamplingParams
from bench.bench_model import MODEL, write_bench_model
from bench.interleave import interleaved
from bench.local_serve import local_ray
from kernels.kv_cache import kv_cache_bytes_per_block
from models.config import read_model_config
from policies.conductor import (
    Conductor,
    ConductorDecision,
    ConductorRequest,
    DecodeInstance,
    PrefillInstance,
)
from sim.metrics import percentile

MODES = ("baseline", "early", "predictive")
ENGINE = dict(block_size=16, chunk_size=256, token_budget=512, max_num_seqs=64, num_blocks=1024)


@dataclass
class Run:
    mode: str
    offered: int = 0
    rejected: int = 0  # 429: at arrival, or after waiting for decode room
    reasons: dict[str, int] = field(default_factory=dict)  # the Conductor's, at arrival
    refused_at_decode: int = 0  # after prefill: decode's own TBT check
    wasted_prefill_tokens: int = 0
    good: int = 0
    finished: int = 0
    aborted: int = 0  # unfinished at the end of the drain, or ended without a token
    ttft: list[float] = field(default_factory=list)
    tbt: list[float] = field(default_factory=list)  # each finished request's mean
    seconds: float = 1.0

    @property
    def goodput(self) -> float:
        return self.good / self.seconds


class TracingConductor(Conductor):
    """The default Conductor, keeping each accepted request's decision (its predicted TBT
    and batch at the moment the request reaches decode) for ``--trace``."""

    decisions: dict[str, ConductorDecision]

    def schedule(
        self,
        request: ConductorRequest,
        prefills: Sequence[PrefillInstance],
        decodes: Sequence[DecodeInstance],
        now: float,
    ) -> ConductorDecision:
        d = super().schedule(request, prefills, decodes, now)
        if d.accepted:
            self.decisions[request.request_id] = d
        return d


class Bench:
    def __init__(self, args: argparse.Namespace, pd: PDCluster) -> None:
        self.args, self.pd = args, pd
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        self.ttft_slo = math.inf
        self.tbt_slo = math.inf
        self.mode = "baseline"

    def prompt(self, rng: random.Random) -> list[int]:
        n = rng.randint(self.args.prompt_min, self.args.prompt_max)
        return [rng.randrange(3, self.pd.limits.vocab_size) for _ in range(n)]

    def set_mode(self, mode: str) -> None:
        c = self.pd.conductor
        self.mode = mode
        c.admission = "early" if mode == "baseline" else mode
        c.ttft_slo = self.ttft_slo
        c.tbt_slo = math.inf if mode == "baseline" else self.tbt_slo

    def idle(self) -> tuple[float, float]:
        """Median TTFT and mean TBT of requests sent one at a time."""
        rng = random.Random(7)
        ttfts, tbts = [], []
        for _ in range(5):
            prompt, t0 = self.prompt(rng), time.monotonic()
            rid = self.pd.submit(prompt, self.params)
            while self.pd.output(rid) is None:
                self.pd.poll(0.01)
            times = self.pd.token_times(rid)
            self.pd.release(rid)
            ttfts.append(times[0] - t0)
            tbts.append((times[-1] - times[0]) / max(1, len(times) - 1))
        return statistics.median(ttfts), statistics.median(tbts)

    def calibrate(self) -> float:
        """Completions per second of ``--clients`` closed-loop clients, no admission."""
        self.set_mode("baseline")
        self.pd.conductor.admission = "none"
        rng = random.Random(11)
        live: set[str] = set()
        done = 0
        t0 = time.monotonic()
        stop = t0 + self.args.calibrate
        while time.monotonic() < stop or live:
            while time.monotonic() < stop and len(live) < self.args.clients:
                live.add(self.pd.submit(self.prompt(rng), self.params))
            self.pd.poll(0.02)
            for rid in [r for r in live if self.pd.output(r) is not None]:
                self.pd.release(rid)
                live.discard(rid)
                done += 1
        return done / (time.monotonic() - t0)

    def run(self, mode: str, rate: float, seed: int) -> Run:
        pd, run = self.pd, Run(mode)
        self.set_mode(mode)
        rng, arrivals = random.Random(seed), random.Random(seed + 1)
        at, start = 0.0, time.monotonic()
        schedule: list[tuple[float, list[int]]] = []
        while at < self.args.duration:
            schedule.append((start + at, self.prompt(rng)))
            at += arrivals.expovariate(rate)
        run.seconds = self.args.duration
        live: dict[str, tuple[float, int]] = {}  # request -> (arrival, prompt tokens)
        seen_first: set[str] = set()
        i, end = 0, start + self.args.duration + self.args.drain
        while (i < len(schedule) or live) and time.monotonic() < end:
            now = time.monotonic()
            while i < len(schedule) and schedule[i][0] <= now:
                arrival, prompt = schedule[i]
                i += 1
                run.offered += 1
                try:
                    live[pd.submit(prompt, self.params)] = (arrival, len(prompt))
                except RequestRejected as e:
                    run.rejected += 1
                    run.reasons[e.reason] = run.reasons.get(e.reason, 0) + 1
            wait = schedule[i][0] - time.monotonic() if i < len(schedule) else 0.02
            pd.poll(max(0.0, min(0.02, wait)))
            for rid in [r for r in live if r not in seen_first and pd.token_times(r)]:
                seen_first.add(rid)
                if self.decode_refuses(rid, live):
                    pd.abort(rid)
                    pd.release(rid)
                    run.refused_at_decode += 1
                    run.wasted_prefill_tokens += live.pop(rid)[1]
            for rid in [r for r in live if pd.output(r) is not None]:
                arrival = live.pop(rid)[0]
                refused = pd.refusal(rid)
                if pd.token_times(rid):
                    self.finish(run, rid, arrival)
                elif refused is not None:  # waited for decode room, then its 429
                    pd.release(rid)
                    run.rejected += 1
                    reason = f"{refused.reason} (waited)"
                    run.reasons[reason] = run.reasons.get(reason, 0) + 1
                else:  # ended without a token (out of attempts)
                    pd.release(rid)
                    run.aborted += 1
        for rid in live:  # not finished by the end of the drain
            pd.abort(rid)
            pd.release(rid)
            run.aborted += 1
        self.settle()
        return run

    def decode_refuses(self, rid: str, live: dict[str, tuple[float, int]]) -> bool:
        """Decode's own check as the request reaches it: the TBT of the batch it joins
        there (the requests decoding on its instance now, itself included, with their
        lifetime KV blocks), priced by the step-time model fitted from that instance's
        measured steps (the gap between tokens each delivers: the model the Conductor
        predicts with), above the SLO. An instance decoding nothing else never refuses."""
        pd = self.pd
        _, did = pd.placement(rid)
        batch = [rid] + [
            r
            for r in live
            if r != rid
            and pd.token_times(r)
            and pd.output(r) is None  # finished there: no longer in its batch
            and pd.placement(r)[1] == did
        ]
        if len(batch) == 1:
            return False
        blocks = sum(-(-(live[r][1] + self.args.max_tokens) // ENGINE["block_size"]) for r in batch)
        tbt = pd.conductor.decode_tbt(len(batch), blocks)
        refused = tbt > self.tbt_slo
        if self.args.trace:
            self.trace(rid, batch, tbt, refused)
        return refused

    def trace(self, rid: str, batch: list[str], tbt: float, refused: bool) -> None:
        """One request reaching decode: what the Conductor predicted at admission (TBT and
        batch) against decode's check on arrival, and the gap between tokens measured
        there (the median of each other decoding request's last gap)."""
        c = self.pd.conductor
        d = c.decisions.get(rid) if isinstance(c, TracingConductor) else None
        gaps = [t[-1] - t[-2] for t in map(self.pd.token_times, batch[1:]) if len(t) >= 2]
        measured = statistics.median(gaps) * 1e3 if gaps else float("nan")
        pred = "-"
        if d:
            pred = f"{d.predicted_tbt * 1e3:6.1f} ms x{d.tbt_margin:.2f} @ {d.predicted_batch:2d}"
        print(
            f"    {self.mode[:4]} {'REFUSED' if refused else 'ok     '} {rid[:8]}: predicted "
            f"{pred}; decode {tbt * 1e3:6.1f} ms @ {len(batch):2d}, measured gap "
            f"{measured:6.1f} ms; slo {self.tbt_slo * 1e3:.1f} ms"
        )

    def finish(self, run: Run, rid: str, arrival: float) -> None:
        times = self.pd.token_times(rid)
        self.pd.release(rid)
        run.finished += 1
        ttft = times[0] - arrival
        tbt = (times[-1] - times[0]) / max(1, len(times) - 1)
        run.ttft.append(ttft)
        run.tbt.append(tbt)
        if ttft <= self.ttft_slo and tbt <= self.tbt_slo:
            run.good += 1

    def settle(self) -> None:
        """Wait until nothing runs and every KV block is back."""
        deadline = time.monotonic() + 60
        while self.pd.has_unfinished() and time.monotonic() < deadline:
            self.pd.poll(0.05)
        for _ in range(10):  # aborted requests' reports
            self.pd.poll(0.05)
        blocks = self.pd.check_blocks()
        if any(blocks.values()):
            raise RuntimeError(f"blocks still held after a run: {blocks}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--drain", type=float, default=15.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--calibrate", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ttft-slo-x", type=float, default=5.0, help="TTFT SLO / idle TTFT")
    ap.add_argument("--tbt-slo-x", type=float, default=2.0, help="TBT SLO / idle TBT")
    ap.add_argument("--ttft-slo", type=float, default=0.0, help="seconds (overrides -x)")
    ap.add_argument("--tbt-slo", type=float, default=0.0, help="seconds (overrides -x)")
    ap.add_argument("--trace", action="store_true", help="log each request refused at decode")
    args = ap.parse_args(argv)

    model_dir = write_bench_model(Path(tempfile.mkdtemp()) / "bench")
    with local_ray(num_cpus=2):
        engine = EngineConfig(dtype=torch.float32, **ENGINE)
        spec = read_model_config(model_dir)
        block_bytes = kv_cache_bytes_per_block(
            spec.num_hidden_layers,
            engine.block_size,
            spec.num_key_value_heads,
            spec.head_dim,
            torch.float32,
        )
        d = default_conductor(block_bytes, ConductorOptions())
        conductor = TracingConductor(
            d.prefill_time, d.decode_tbt, d.transfer_time, d.ttft_slo, d.tbt_slo
        )
        conductor.decisions = {}
        config = PDClusterConfig(str(model_dir), engine, conductor=conductor, pin_cores=True)
        pd = PDCluster(config)
        bench = Bench(args, pd)
        try:
            bench.set_mode("baseline")
            bench.pd.conductor.admission = "none"
            idle_ttft, idle_tbt = bench.idle()
            bench.ttft_slo = args.ttft_slo or args.ttft_slo_x * idle_ttft
            bench.tbt_slo = args.tbt_slo or args.tbt_slo_x * idle_tbt
            rate = bench.calibrate()
            bench.settle()
            offered = args.overload * rate
            print(f"model: {MODEL}, fp32, torch {torch.__version__}; 1 prefill + 1 decode replica")
            print(
                f"prompts {args.prompt_min}-{args.prompt_max} tokens, {args.max_tokens} new; idle "
                f"TTFT {idle_ttft * 1e3:.0f} ms, TBT {idle_tbt * 1e3:.1f} ms; SLOs TTFT "
                f"{bench.ttft_slo * 1e3:.0f} ms, TBT {bench.tbt_slo * 1e3:.1f} ms"
            )
            print(
                f"sustained {rate:.2f} req/s ({args.clients} closed-loop clients); offered "
                f"{offered:.2f} req/s (x{args.overload:g}, Poisson) for {args.duration:.0f}s"
            )

            def one(mode: str, i: int) -> Run:
                r = bench.run(mode, offered, seed=100 + i)
                print(
                    f"  run {i + 1} {mode:>10}: offered {r.offered}, rejected {r.rejected} "
                    f"{r.reasons or ''} + "
                    f"{r.refused_at_decode} at decode, wasted prefill "
                    f"{r.wasted_prefill_tokens} "
                    f"tokens, finished {r.finished} (good {r.good}), aborted {r.aborted}, "
                    f"TTFT p90 {percentile(r.ttft, 90):.2f}s, "
                    f"TBT p90 {percentile(r.tbt, 90) * 1e3:.1f} ms"
                )
                return r

            runs = interleaved(MODES, args.repeats, one)
            print()
            print(
                f"{'admission':>10} {'offered':>8} {'rejected':>9} {'at decode':>10} "
                f"{'wasted prefill':>15} {'good':>5} {'goodput':>9}   (medians over runs)"
            )
            med: dict[str, dict[str, float]] = {}
            for mode in MODES:
                rs = runs[mode]

                def m(key: str, rs: list[Run] = rs) -> float:
                    return statistics.median(float(getattr(r, key)) for r in rs)

                med[mode] = {k: m(k) for k in ("wasted_prefill_tokens", "goodput")}
                print(
                    f"{mode:>10} {m('offered'):>8.0f} {m('rejected'):>9.0f} "
                    f"{m('refused_at_decode'):>10.0f} {m('wasted_prefill_tokens'):>15.0f} "
                    f"{m('good'):>5.0f} {m('goodput'):>7.2f}/s"
                )
            base, pred = med["baseline"], med["predictive"]
            waste = pred["wasted_prefill_tokens"] / max(1.0, base["wasted_prefill_tokens"])
            print(f"wasted prefill predictive/baseline: {waste:.2f}")
            ratio = pred["goodput"] / base["goodput"] if base["goodput"] > 0 else float("inf")
            print(f"pd-overload goodput predictive/baseline: {ratio:.2f}")
        finally:
            pd.shutdown()


if __name__ == "__main__":
    main()
